// The per-parameter-group optimizer: the one entry point through which the daemon (and the
// conformance tool) runs every update rule of microsoft/dion (ALGORITHMS.md §5-§9, §13).
//
// A GroupOptimizer is created for one GroupConfig and a fixed list of parameter shapes. It owns
// the optimizer state of those parameters (named exactly as the reference's state dict:
// "momentum", "variance_neuron", "Q", "variance", "step_dev"), and Step() applies one update
// to caller-owned float32 parameter buffers given float32 gradients.
//
// Megabatching (§2.4): parameters of the same shape are processed together, each phase
// (momentum, orthogonalization, normalization, update) as one batched call over all of them.
// Because every batched op of the ops API runs the same per-matrix kernel, the result of a
// batch is bit-identical to processing the parameters one at a time.
//
// THE DEVICE CONTRACT. An optimizer created with a Context on device D (CreateGroupOptimizer
// below) keeps its state and staging in D's memory (Buffers of that Context's allocator), and
// every call that computes takes a Context on D:
//   * Step / Stage(ctx, params, grads): params[i] and grads[i] are pointers into D's memory
//     (for the CPU: host memory; for a CUDA or TEST context: device allocations, e.g. a
//     session's device staging). They are handed to the ops as views made with ctx.device();
//     nothing here dereferences them on the host. WriteStagedParams and CommitStagedState run on
//     the Stage's context (it must outlive them); ApplyCapturedUpdate's x is on ctx.device().
//   * Host memory is reached only through explicit copies (kernels/ops.h CopyFromHost /
//     CopyToHost), each a sync point listed in docs/KERNELS.md §4.3: Get/SetState, the initial
//     state (zeros are a Fill; Dion's Q and sketch are drawn on the host and uploaded), the
//     Σ(Δx)² of a step (one read-back), Dion2's bf16 selection order, capture payloads and
//     replica_average (the orthogonalizer keeps its scalars on the device, AdamW's step_dev is
//     advanced on the device and mirrored on the host).
//   * Get/SetState and ReleaseState have overloads taking the Context; the ones without it use
//     a process-wide CPU context and refuse (FAILED_PRECONDITION) an optimizer whose state is
//     not on the CPU.
// On the CPU context the copies are plain copies: the numbers are the same as before, bit for bit.
//
// Thread-safety: not thread-safe; one thread drives a GroupOptimizer (and its Context).
#ifndef DIOND_KERNELS_OPTIM_GROUP_OPTIMIZER_H_
#define DIOND_KERNELS_OPTIM_GROUP_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim {

class GroupOptimizer {
 public:
  virtual ~GroupOptimizer() = default;

  const GroupConfig& config() const { return config_; }
  const std::vector<ParamShape>& shapes() const { return shapes_; }
  // Number of successful Step() calls.
  int64_t steps_taken() const { return steps_taken_; }
  // Memory: Step() stages its results in buffers as large as the group's parameters, gradients
  // and state; they are allocated at the first step and reused (CreateGroupOptimizer below).
  //
  // Frobenius norm of the change the last successful Step() made to the parameters (computed
  // while the staged results are committed, so it costs one read and no copy).
  double last_update_norm() const { return last_update_norm_; }

  // One optimizer step. params[i] and grads[i] point at contiguous float32 buffers of
  // shapes()[i] (row-major) in the memory of ctx.device() (the device contract above). grads[i] ==
  // nullptr means "parameter i has no gradient this step": its parameter and state are left alone
  // (the reference skips it, and AdamW's step_dev does not advance). params are updated in place;
  // grads are only read and may not alias params.
  //
  // Everything is validated before anything is written: INVALID_ARGUMENT for a count mismatch,
  // a null param with a non-null grad, or a bad override in `options` (naming the value). On any
  // error (including a backend failure after validation, e.g. RESOURCE_EXHAUSTED) params and
  // state are unchanged: results are staged and committed only when every computation succeeded.
  absl::Status Step(const kernels::Context& ctx, absl::Span<float* const> params,
                    absl::Span<const float* const> grads, const StepOptions& options = {});

  // The same step in three phases, for a caller whose parameter or gradient memory can vanish
  // under it (server/session: a trainer's shm segment that shrinks; it checks its memory between
  // the phases). Step() is Stage + WriteStagedParams + CommitStagedState.
  //  * Stage validates and computes, reading params and grads, and changes nothing; on error the
  //    staged results are dropped.
  //  * WriteStagedParams writes the new parameters into `params` (the same buffers Stage read)
  //    and measures the update's norm; the state is still unchanged.
  //  * CommitStagedState makes the staged state current and counts the step.
  //  * DiscardStaged, after Stage or WriteStagedParams, drops what was staged: the state and
  //    steps_taken() stay as they were (the parameters keep whatever was written into them).
  absl::Status Stage(const kernels::Context& ctx, absl::Span<float* const> params,
                     absl::Span<const float* const> grads, const StepOptions& options = {});
  void WriteStagedParams(absl::Span<float* const> params);
  // WriteStagedParams without its one sync point: the read-back of the change's Σ(Δx)² is only
  // queued on the step's context (kernels::CopyToHostAsync). The caller waits for that
  // context's stream (kernels::Synchronize: a device session's final wait, after it queued the
  // new weights' copies too) and then calls FinishStagedNorm, before staged_update_norm or
  // CommitStagedState. On the CPU the copy is immediate and FinishStagedNorm only sums.
  // `norm_host`, when given, is where the read-back lands (at least params.size() floats that
  // stay valid until FinishStagedNorm: a device session's pinned memory, so that the copy can be
  // part of a captured graph); else the optimizer's own host buffer.
  void WriteStagedParamsDeferringNorm(absl::Span<float* const> params, float* norm_host = nullptr);
  void FinishStagedNorm();
  // The norm of the change WriteStagedParams made (last_update_norm() once committed).
  double staged_update_norm() const;
  void CommitStagedState();
  void DiscardStagedStep();

  // The same staged step in parts, e.g. one per bucket of gradients as backward produces them.
  //  * BeginStagedStep drops whatever was staged and opens a step with `options` on `ctx` (which
  //    must outlive the step). INVALID_ARGUMENT as Stage, and for in_place (a later part could
  //    fail). With capture, each part captures its parameters' compact updates into it. With
  //    replica_average (compressed Dion), each part averages its own sub-batches: every replica
  //    must stage the same parts in the same order.
  //  * StagePart stages, as Stage would, the parameters i with grads[i] != nullptr; params holds
  //    every parameter. Parts are disjoint (INVALID_ARGUMENT for a parameter that an earlier part
  //    of the step gave a gradient) and may come in any order. On error the part changes nothing
  //    and the parts before it stay staged (retry it, or DiscardStagedStep). FAILED_PRECONDITION
  //    without an open step (none begun, or WriteStagedParams since).
  //  * Then WriteStagedParams and CommitStagedState (or DiscardStagedStep), as after Stage. A
  //    parameter that no part gave a gradient is left alone, as with a null grad.
  // The result is, bit for bit, Stage's with the union of the parts' gradients (parameters,
  // state, steps_taken, last_update_norm): a part runs the rules on its parameters of each shape
  // bucket as one sub-batch, a batch's results are those of its matrices one at a time, and the
  // commit and the norm's sum go parameter by parameter, whichever part staged them.
  absl::Status BeginStagedStep(const kernels::Context& ctx, const StepOptions& options = {});
  absl::Status StagePart(absl::Span<float* const> params, absl::Span<const float* const> grads);
  // The new value a part of the open step staged for parameter p, copied on the step's context
  // into dst (shapes()[p]'s elements, on the state's device), before WriteStagedParams: a
  // world's owner sends it while later parts are still to come. FAILED_PRECONDITION when no part
  // of the open step staged p, or when its rule keeps a compact update there (capture it).
  absl::Status CopyStagedParam(size_t p, float* dst) const;

  // The state names of this group's algorithm (StateNames(config().algorithm)).
  std::vector<std::string> StateNames() const;
  // Shape of state `name` of parameter `param_index`: momentum/variance = the parameter's shape,
  // variance_neuron = shape[:-1] + [1], Q = [b, r] (§9.3), step_dev = [] (a scalar).
  // NOT_FOUND for an unknown name, OUT_OF_RANGE for a bad index.
  virtual absl::StatusOr<std::vector<int64_t>> StateShape(size_t param_index,
                                                          absl::string_view name) const = 0;
  // Copies state `name` of parameter `param_index` into / from a row-major float buffer of
  // exactly StateShape's element count (INVALID_ARGUMENT otherwise; nothing is written then).
  // SetState lets a checkpoint or golden state (e.g. the reference's random Dion Q) be injected.
  // FAILED_PRECONDITION for a parameter whose state was released (below).
  // `out` / `values` are host memory; the copies run on `ctx` (on the state's device, else
  // INVALID_ARGUMENT). Without a context: CPU state only (FAILED_PRECONDITION otherwise).
  absl::Status GetState(size_t param_index, absl::string_view name, absl::Span<float> out) const;
  absl::Status SetState(size_t param_index, absl::string_view name, absl::Span<const float> values);
  absl::Status GetState(const kernels::Context& ctx, size_t param_index, absl::string_view name,
                        absl::Span<float> out) const;
  absl::Status SetState(const kernels::Context& ctx, size_t param_index, absl::string_view name,
                        absl::Span<const float> values);

  // Sharded state (a world session, docs/DISTRIBUTED.md): frees the state of every parameter i
  // with keep[i] == false, for good. Afterwards Step() refuses a gradient for a released
  // parameter (FAILED_PRECONDITION; pass nullptr: its update comes from its owner), and its
  // Get/SetState fail. Kept parameters step exactly as before (their state, including Dion's
  // initial Q, is untouched). INVALID_ARGUMENT if keep.size() != shapes().size().
  // The kept rows are copied on `ctx` (the state's device); without a context: CPU state only.
  absl::Status ReleaseState(const std::vector<bool>& keep);
  absl::Status ReleaseState(const kernels::Context& ctx, const std::vector<bool>& keep);
  bool StateReleased(size_t param_index) const {
    return param_index < released_.size() && released_[param_index];
  }
  // Floats of state this optimizer holds.
  virtual int64_t StateFloats() const = 0;

 protected:
  GroupOptimizer(GroupConfig config, std::vector<ParamShape> shapes)
      : config_(std::move(config)), shapes_(std::move(shapes)) {}

  // Implemented per algorithm family (kernels/optim/internal/): computes the step for all
  // parameters with a gradient and stages the results; CommitStagedParams writes the new
  // parameters, CommitStagedStateImpl the new state. Validation of the arguments has already
  // happened. StageStep must not modify params or state.
  virtual absl::Status StageStep(const kernels::Context& ctx, absl::Span<float* const> params,
                                 absl::Span<const float* const> grads, float lr,
                                 float weight_decay) = 0;
  // Staging in parts: BeginParts drops what was staged and readies an empty step on ctx;
  // StagePartImpl stages the parameters with a gradient (validated, disjoint from the earlier
  // parts) and, on error, drops what it staged itself and nothing else.
  virtual void BeginParts(const kernels::Context& ctx) = 0;
  virtual absl::Status StagePartImpl(absl::Span<float* const> params,
                                     absl::Span<const float* const> grads, float lr,
                                     float weight_decay) = 0;
  virtual void CommitStagedParams(absl::Span<float* const> params) = 0;
  // CopyStagedParam's copy (p staged by a part of the open step: checked by the caller).
  virtual absl::Status CopyStagedParamImpl(size_t p, float* dst) const = 0;
  virtual void CommitStagedStateImpl() = 0;
  virtual void DiscardStaged() = 0;
  // Locates the float buffer of state `name` for parameter `param_index` (nullptr if unknown).
  virtual float* MutableStatePtr(size_t param_index, absl::string_view name) = 0;
  // Drops the state of released parameters (keep[i] == false); called once by ReleaseState.
  // May fail (RESOURCE_EXHAUSTED) before changing anything.
  virtual absl::Status ReleaseStateImpl(const kernels::Context& ctx,
                                        const std::vector<bool>& keep) = 0;
  // Called by SetState after state `name` of `param_index` took `values` (host mirrors).
  virtual void StateWritten(size_t param_index, absl::string_view name,
                            absl::Span<const float> values) {}
  // FAILED_PRECONDITION for a context-less call on an optimizer whose state is on a device.
  absl::Status NeedsContext(absl::string_view what) const;
  // INVALID_ARGUMENT unless ctx is on the state's device.
  absl::Status CheckContextDevice(const kernels::Context& ctx, absl::string_view what) const;
  // Sum of squared parameter changes; CommitStagedParams adds to it.
  double update_sq_ = 0;
  // WriteStagedParamsDeferringNorm: CommitStagedParams queues its read-back (defer_norm_), and
  // SumDeferredNorm adds the copied values to update_sq_ once the caller waited.
  bool defer_norm_ = false;
  bool norm_pending_ = false;
  float* defer_norm_to_ = nullptr;  // WriteStagedParamsDeferringNorm's norm_host (or null)
  virtual void SumDeferredNorm() {}
  // The device of the state and staging buffers; Step refuses a context on another device.
  kernels::Device state_device_;
  // StepOptions::capture of the step being staged (null when not capturing).
  StepCapture* capture_ = nullptr;
  // StepOptions::replica_average of the step being staged (null when not set).
  const std::function<absl::Status(absl::Span<float>)>* replica_average_ = nullptr;
  bool replica_average_on_device_ = false;
  // The step number of the step being staged (StepOptions::step or steps_taken() + 1).
  int64_t step_number_ = 1;
  // StepOptions::in_place of the step being staged.
  bool in_place_ = false;

 private:
  GroupConfig config_;
  std::vector<ParamShape> shapes_;
  // INVALID_ARGUMENT / FAILED_PRECONDITION for the arguments Stage and StagePart refuse.
  absl::Status CheckStepArgs(absl::Span<float* const> params,
                             absl::Span<const float* const> grads) const;
  // Ends the step in parts, if one is open: its capture and replica average go.
  void CloseParts();
  // The checks of Stage and BeginStagedStep on the options and the context's device.
  absl::Status CheckStepOptions(const kernels::Context& ctx, const StepOptions& options) const;

  int64_t steps_taken_ = 0;
  double last_update_norm_ = 0;
  // The step being staged in parts: open from BeginStagedStep to WriteStagedParams, its scalars,
  // and per parameter whether a part gave it a gradient.
  bool parts_open_ = false;
  float parts_lr_ = 0, parts_weight_decay_ = 0;
  std::function<absl::Status(absl::Span<float>)> parts_replica_average_;  // replica_average_'s
  std::vector<bool> in_part_;
  std::vector<bool> released_;  // empty until ReleaseState
};

// Validates `config` and `shapes` (ValidateGroup in validation.h) and builds the optimizer with
// the reference's initial state: zeros everywhere except Dion's Q, drawn i.i.d. N(0, 1) from
// config.seed (deterministic across platforms). INVALID_ARGUMENT naming the bad value.
//
// State and staging buffers are kernels::Buffers from `ctx`'s allocator (counted by
// ctx.allocation_count()): the state at creation, the staging at each bucket's first step,
// sized for all of the bucket's parameters and reused afterwards, so steps after the first
// allocate nothing through the Context. Step must then be given a context on ctx's device.
// The overload without a context uses a process-wide CPU context's allocator.
absl::StatusOr<std::unique_ptr<GroupOptimizer>> CreateGroupOptimizer(
    const kernels::Context& ctx, const GroupConfig& config, std::vector<ParamShape> shapes);
absl::StatusOr<std::unique_ptr<GroupOptimizer>> CreateGroupOptimizer(
    const GroupConfig& config, std::vector<ParamShape> shapes);

// ---- compact updates (StepCapture) --------------------------------------------------------------
// Floats in the compact form of one step's update of a parameter of `shape`, or 0 when it has
// none smaller than the parameter itself (then exchange the parameter):
//   Dion, when r(m+n) < mn: P (a×r) then Q_new (b×r), row-major (§9.4; a = max(m,n)), so that
//     X ← (1−ηλ)·X − s·P·Q_newᵀ (transposed: Q_new·Pᵀ);
//   Dion2/NorDion2, when smaller: per trailing matrix (per head with num_heads), the k selected
//     slice indices (as floats, exact) then those k slices of X after the step (k×n rows or m×k
//     columns, as the rule's selection axis).
//   Other algorithms: 0.
int64_t CapturedUpdateSize(const GroupConfig& config, const ParamShape& shape);

// Reproduces the owner's step on `x` (the parameter as it was before the step, identical to the
// owner's copy) from the owner's payload: Dion runs the rule's own final update code on P and
// Q_new; Dion2/NorDion2 decay every entry as the rule does, then take the owner's selected
// slices. The result is bit-identical to the owner's. lr and weight decay are resolved from
// `options` exactly as Step resolves them. INVALID_ARGUMENT for a payload of the wrong size or
// with out-of-range or repeated indices (nothing is written then).
absl::Status ApplyCapturedUpdate(const kernels::Context& ctx, const GroupConfig& config,
                                 const ParamShape& shape, const StepOptions& options,
                                 absl::Span<const float> payload, float* x);

}  // namespace diond::optim

#endif  // DIOND_KERNELS_OPTIM_GROUP_OPTIMIZER_H_
