// Internal interface between GroupOptimizer (bucketing, staging, commit, state access) and the
// per-algorithm update rules. Not part of the public API.
//
// A rule sees one shape bucket at a time: the N parameters of one shape that have a gradient
// this step. It reads the step's inputs where they are and writes its results into contiguous
// staging stacks [N, ...shape], committed by GroupOptimizer only when every bucket succeeded:
//   x_in      per parameter, the caller's parameter (read only)
//   g         per parameter, its gradient: the caller's buffer, read only, never staged
//   state_in  per state name, per parameter: its persistent state (read only)
//   x         the staged parameters, [N, ...shape]
//   state     one staged stack per state name, [N, ...state shape]
// The staged stacks start with unspecified contents: the rule writes every element of them,
// reading x_in / state_in once (its first op on each, e.g. M ← M_in + G, is out of place). So
// the step copies nothing in; the commit copies x back (with the update norm) and swaps in the
// staged state when every parameter of the bucket took part.
// In-place rules (UpdateRule::InPlace) get x == x_in[0] and state[k] == state_in[k][0] instead.
// Deferred-write rules (UpdateRule::DefersParamWrite) leave their parameter update in x in a
// compact form of their own, and GroupOptimizer's commit calls CommitParams, which applies it to
// the caller's parameters in place: the parameters are neither staged nor copied back.
// Rules are stateless objects; everything persistent is in the state stacks.
#ifndef DIOND_KERNELS_OPTIM_INTERNAL_RULE_H_
#define DIOND_KERNELS_OPTIM_INTERNAL_RULE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim::internal {

struct StateSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t NumElements() const;
};

// Scalars of one step, already rounded to float32 (P1).
struct StepScalars {
  float lr = 0;
  float weight_decay = 0;
};

struct BucketArgs {
  const GroupConfig* config = nullptr;
  const ParamShape* shape = nullptr;
  int64_t count = 0;  // N
  float* x = nullptr;
  std::vector<const float*> x_in;                   // count entries
  std::vector<const float*> g;                      // count entries, each ...shape floats
  std::vector<float*> state;                        // in the order of Specs()
  std::vector<std::vector<const float*>> state_in;  // [spec][parameter]
  StepScalars scalars;
  // The 1-based step number (StepOptions::step, or steps_taken() + 1).
  int64_t step = 1;
  // StepOptions::capture: per parameter of the bucket, where the rule writes the compact form
  // of its update (group_optimizer.h CapturedUpdateSize). Empty when not capturing.
  std::vector<std::vector<float>*> capture;
  // StepOptions::replica_average (Dion's compressed sync), or null.
  const std::function<absl::Status(absl::Span<float>)>* replica_average = nullptr;
  // StepOptions::replica_average_on_device.
  bool replica_average_on_device = false;
  // In-place rules only (UpdateRule::InPlace): per parameter of the bucket, one f32 element (on
  // the context's device) where the rule writes Σ(x_after − x_before)², or null.
  float* update_sq = nullptr;
  // Per parameter of the bucket: HOST memory holding its AdamW step_dev (the host mirror of the
  // device state; the rule reads it and writes the advanced value). Set by GroupOptimizer.
  std::vector<float*> step_count;
  // Deferred-write rules only (UpdateRule::DefersParamWrite): host memory that Apply fills and
  // CommitParams reads (Dion2: the selected indices), kept with the bucket's staging (sized once,
  // so later steps allocate nothing). Null when the rule is to write args.x in full.
  std::vector<int64_t>* keep = nullptr;
  // CommitParams only: per parameter of the bucket, the caller's parameter (updated in place) and
  // one f32 element (on the context's device) for its Σ(x_after − x_before)².
  std::vector<float*> commit_x;
  std::vector<float*> commit_sq;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  // State tensors of one parameter of `shape`, in the reference's order.
  virtual std::vector<StateSpec> Specs(const GroupConfig& config,
                                       const ParamShape& shape) const = 0;
  // Initial value of state `spec_index` for the `count` parameters of a bucket: false for zeros
  // (the default; GroupOptimizer fills them on the device), or true after writing the values
  // into `host_data` (HOST memory of count·NumElements() floats, which GroupOptimizer then
  // uploads to the state's device; Dion draws Q).
  virtual bool InitState(const GroupConfig& config, const ParamShape& shape, size_t spec_index,
                         int64_t count, uint64_t stream, float* host_data) const;
  // Applies one step to the bucket in place. Must only write through args.x / args.state.
  // Every pointer of `args` (x, x_in, g, state, state_in, update_sq) is memory of ctx.device():
  // the rule reaches it only through ops on views made with ctx.device() and explicit copies
  // (Upload / Download of util.h), never by dereferencing it on the host.
  virtual absl::Status Apply(const kernels::Context& ctx, const BucketArgs& args) const = 0;
  // True for a rule whose Apply runs only ops that cannot fail once GroupOptimizer::Step has
  // validated its arguments (no scratch memory, no factorization): GroupOptimizer then runs it
  // directly on the caller's parameters and the persistent state, one parameter at a time
  // (count 1), with args.update_sq set, and stages nothing. AdamW and Lion.
  virtual bool InPlace() const { return false; }
  // True for a rule that can defer its parameter write to the commit (Dion2, NorDion2): given
  // args.keep, Apply writes only the compact update (into args.x and *args.keep) and the state,
  // and CommitParams later applies that update to args.commit_x in place, with ops that cannot
  // fail on valid views (the promise that a failed step changes nothing holds: every fallible
  // phase ran in Apply). CommitParams gets the Apply's args.x, keep, count, shape and scalars.
  // GroupOptimizer defers only when the step captures no compact update.
  virtual bool DefersParamWrite() const { return false; }
  virtual absl::Status CommitParams(const kernels::Context& ctx, const BucketArgs& args) const;
};

std::unique_ptr<UpdateRule> MakeMuonRule();    // Muon and NorMuon (muon_rules.cc)
std::unique_ptr<UpdateRule> MakeDion2Rule();   // Dion2 and NorDion2 (dion2_rules.cc)
std::unique_ptr<UpdateRule> MakeDionRule();    // dion_rule.cc
std::unique_ptr<UpdateRule> MakeScalarRule();  // AdamW and Lion (scalar_rules.cc)

// Compact updates (group_optimizer.h): sizes (0 = none) and application by a non-owner.
int64_t DionCaptureSize(const GroupConfig& config, const ParamShape& shape);
absl::Status DionApplyCaptured(const kernels::Context& ctx, const GroupConfig& config,
                               const ParamShape& shape, const StepScalars& scalars,
                               const float* payload, float* x);
int64_t Dion2CaptureSize(const GroupConfig& config, const ParamShape& shape);
absl::Status Dion2ApplyCaptured(const kernels::Context& ctx, const GroupConfig& config,
                                const ParamShape& shape, const StepScalars& scalars,
                                const float* payload, float* x);

}  // namespace diond::optim::internal

#endif  // DIOND_KERNELS_OPTIM_INTERNAL_RULE_H_
