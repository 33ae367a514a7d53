// One training job's session: its spec, optimizer state (a GroupOptimizer per group), the
// trainer's arenas (arenas.h) and the record of the last step. Every mutating method validates
// its whole request first and changes nothing on failure; a failed Step leaves the state, the
// master weights and the step index unchanged (docs/ARCHITECTURE.md §2). The step reads
// top-down in session_step.cc; docs/ARCHITECTURE.md §2 lists the other files.
//
// Thread-safety: all public methods are thread-safe, serialized by the session's mutex; compute
// runs on the compute thread given to Create (compute_thread.h).
#ifndef DIOND_SERVER_SESSION_SESSION_H_
#define DIOND_SERVER_SESSION_SESSION_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/context.h"
#include "kernels/device_runtime.h"
#include "kernels/optim/group_optimizer.h"
#include "server/fdchannel/unique_fd.h"
#include "server/memory/cuda_region.h"
#include "server/session/arenas.h"
#include "server/session/compute_thread.h"
#include "server/session/shard_plan.h"
#include "server/session/step_queue.h"
#include "server/session/types.h"
#include "server/session/world_link.h"

namespace diond::comm {
class Communicator;
}  // namespace diond::comm

namespace diond::session {

class StepDeviceComm;

class Session {
 public:
  // Validates the spec (INVALID_ARGUMENT naming the field) and builds the optimizers on `ctx`'s
  // device (null: the CPU). Off the CPU it is a device session (docs/GPU.md "Device sessions"),
  // its stream and staging made through `runtime`; RESOURCE_EXHAUSTED when they do not fit.
  // `compute` (null: the calling thread) runs all compute and must outlive the session.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      std::string id, SessionSpec spec, const kernels::Context* ctx = nullptr,
      const kernels::DeviceRuntime* runtime = nullptr, ComputeThread* compute = nullptr);
  ~Session();  // waits for a queued asynchronous step (never call it on that step's thread)

  bool is_device_session() const { return device_ != nullptr; }
  int64_t DeviceStagingBytes() const;  // a device session's staging (0 for a host session)
  int64_t DeviceWorldBytes() const;    // and its world exchange buffers
  // What Create allocates first for `layout`'s staging, so SessionManager can check it before.
  static int64_t DeviceStagingBytesFor(const Layout& layout);
  // What the memory budgets count: StateBytes(), or a device session's pool and host bytes.
  int64_t BudgetBytes() const;
  int64_t DeviceBytes() const;  // the pool bytes its Context holds (0 for a host session)

  const std::string& id() const { return id_; }
  const SessionSpec& spec() const { return spec_; }
  const Layout& layout() const { return layout_; }
  int64_t StateBytes() const { return state_bytes_.load(); }  // state and master weights

  // Maps a shm region (or a sealed memfd, ownership taken) for `role`; returns its id.
  // INVALID_ARGUMENT for a bad name, an offset not a multiple of 256, a region smaller than the
  // arena or overlapping the other role's; FAILED_PRECONDITION if the role is bound.
  absl::StatusOr<std::string> RegisterShmRegion(Role role, const std::string& name, int64_t offset,
                                                int64_t size);
  absl::StatusOr<std::string> RegisterMemfdRegion(Role role, fdchannel::UniqueFd fd, int64_t offset,
                                                  int64_t size);
  // Binds trainer GPU memory to `role` (docs/DATA_PLANE.md "CUDA regions"): a device session on
  // the region's device only, never over host data. Held weights are copied in.
  absl::StatusOr<std::string> RegisterCudaRegion(Role role,
                                                 std::unique_ptr<memory::CudaRegion> region);
  // `open` opens the trainer's memory on the session's device, then RegisterCudaRegion binds it;
  // FAILED_PRECONDITION (nothing opened) for a host session.
  absl::StatusOr<std::string> OpenCudaRegion(
      Role role,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::CudaRegion>>(kernels::Device)> open);
  absl::Status UnregisterRegion(const std::string& region_id);  // NOT_FOUND for an unknown id
  // A doorbell page (docs/DATA_PLANE.md "Overlapped step") and its buckets, each parameter in
  // one; INVALID_ARGUMENT naming what is wrong, FAILED_PRECONDITION where not built.
  absl::StatusOr<std::string> RegisterShmDoorbells(const std::string& name, int64_t offset,
                                                   int64_t size,
                                                   const std::vector<DoorbellBucket>& buckets);
  absl::StatusOr<std::string> RegisterMemfdDoorbells(fdchannel::UniqueFd fd, int64_t offset,
                                                     int64_t size,
                                                     const std::vector<DoorbellBucket>& buckets);

  // One optimizer step, idempotent on step_index (see the proto); compute on the compute thread,
  // collectives on the calling thread. request.asynchronous (docs/DATA_PLANE.md "Asynchronous
  // Step"): validated here, run on the session's thread, answered {queued}; `after_async` runs
  // there once it succeeded, before its result can be collected. `ctx` outlives a queued step.
  absl::StatusOr<StepResult> Step(const StepRequest& request, const kernels::Context& ctx,
                                  std::function<void(const StepResult&)> after_async = nullptr);
  // Waits for a queued asynchronous step, drops its outcome, returns its index (0: none).
  // `closing`: later Steps are refused; CUDA regions and events are released at once.
  int64_t DrainQueuedStep(bool closing = false);
  // An overlapped step waiting for a bucket gives up now (nothing committed; true: one waited).
  bool CancelDoorbellWaits();

  // Stream writes (PushGradients; SetState chunks), every one validated first: names exist,
  // ranges inside the tensor and aligned, every named tensor covered exactly once.
  absl::Status ApplyGradientWrites(const std::vector<TensorWrite>& writes);
  absl::Status ApplyStateWrites(const std::vector<TensorWrite>& writes);
  // One chunk checked as it arrives; the bytes one stream of `kind` may buffer.
  absl::Status CheckStreamChunk(StreamKind kind, const std::string& name, int64_t offset,
                                int64_t len);
  int64_t StreamBytesLimit(StreamKind kind);
  // `len` bytes at `offset` of parameter `name`; FAILED_PRECONDITION when none are held.
  absl::Status ReadParameterBytes(const std::string& name, int64_t offset, int64_t len,
                                  std::string* out);

  // The state (and parameters) as fp32 named tensors; SetState validates all first.
  absl::StatusOr<std::vector<NamedTensor>> GetState(bool include_parameters);
  absl::Status SetState(const std::vector<NamedTensor>& tensors);
  // A group's lr / weight decay for future steps (INVALID_ARGUMENT as CreateSession checks).
  absl::Status SetGroupHyperparameters(const std::string& group, std::optional<double> lr,
                                       std::optional<double> weight_decay);

  absl::StatusOr<SessionSnapshot> Snapshot();
  // Restores into this fresh session (the parameters wait for the next PARAMETERS arena).
  // DATA_LOSS naming the tensor unless the snapshot holds exactly what the spec implies.
  absl::Status Restore(const SessionSnapshot& snapshot);
  void DetachTrainer();  // a new trainer takes over (Arenas::DetachTrainer)

  SessionInfo Info();
  absl::Time last_used();
  void RecordStepTime(absl::Time when);  // operator bookkeeping (SessionManager)
  void RecordCheckpoint(int64_t step, std::string path, absl::Time when);
  int64_t last_step_index();
  bool HoldsParameters();  // weights are held, which a checkpoint needs

  // Makes this a world session before its first Step (docs/DISTRIBUTED.md): `world` null is a
  // world of one; a broken world fails every later Step with UNAVAILABLE. `verdict_wait`: how
  // long a failed collective waits to name the lost rank; `checksum_every`: N steps (0 = never).
  // On failure (RESOURCE_EXHAUSTED sharding a device state) the session must be dropped.
  absl::Status AttachWorld(std::shared_ptr<WorldLink> world, ShardPlan plan, uint64_t epoch,
                           absl::Duration verdict_wait = absl::ZeroDuration(),
                           int64_t checksum_every = 0);
  // DION_COMPRESSED: every Dion momentum averaged over the ranks, so a checkpoint holds the
  // synchronous one. A collective; OK and nothing done for other sessions.
  absl::Status SynchronizeForCheckpoint();
  bool is_world_session() const { return !spec_.world_key.empty(); }

 private:
  friend class WorldExchange;  // phase 9 of a world step (world_exchange.h)
  class StepMemory;            // where a step's tensors lie (step_memory.h)
  struct HostMemory;
  struct DeviceSide;  // session_device.h
  struct DeviceSideDeleter {
    void operator()(DeviceSide* d) const;
  };
  struct StepRun;    // one Step's working set (session_internal.h)
  struct WorldPart;  // session_internal.h
  struct Overlap;    // the overlapped step's phases (session_overlap.h)
  struct StateIo;    // state transfer's helpers (session_state.cc)
  struct Clip;       // the global-norm gradient clip (grad_clip.h)
  struct Group;      // a parameter group and its optimizer (session_internal.h)

  Session();
  // `open` maps segment `name` once the request is valid.
  absl::StatusOr<std::string> RegisterMappedRegion(
      Role role, const std::string& name, int64_t offset, int64_t size,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::ShmRegion>>()> open);
  std::string DeviceAllocationError() const;  // the pool's numbers ("" for a host session)
  const kernels::Context& StateContext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // the state's

  // ---- the step (session_step.cc; the world's phases in session_world.cc) ----
  absl::StatusOr<StepResult> StepLocked(const StepRequest& request, const kernels::Context& ctx,
                                        absl::Time start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 1: the request against the session; *replay set when it repeats the last step.
  absl::Status ValidateStepLocked(const StepRequest& request, std::optional<StepResult>* replay)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The world's phases (a world of one: nothing): 2, its communicator; 3b, the ranks agree on
  // the parameters without a gradient; 4 (AVERAGE), the gradients reduce-scattered to owners.
  absl::Status JoinWorldPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AgreeGradientsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReduceGradientsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phases 7 to 9 once the groups are staged: regions checked, weights written, state committed.
  absl::StatusOr<StepResult> FinishStepLocked(StepRun& run, const kernels::Context& update_ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step with non-finite gradients under SKIP: recorded, nothing else changes.
  absl::StatusOr<StepResult> SkipStepLocked(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each group's options for this step (lr, weight decay, group step).
  void InitGroupRuns(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 6: every group's update staged; nothing changes yet. StageGroups is re-runnable.
  absl::Status StageUpdatesPhase(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StageGroups(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 7: the staged weights into the step's parameters; the state is still unchanged.
  void WriteWeightsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 8 (world): the owners' updates exchanged, checksums compared.
  absl::Status ExchangeUpdatesPhase(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 9: the staged state becomes current, master weights swapped in, the step recorded.
  StepResult CommitStepPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DiscardStep(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // drops what was staged
  // A world step's failure breaks the world session for good (a reduce-scatter's, named).
  absl::Status BreakWorld(StepRun& run, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReduceFailed(StepRun& run, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "<why>" plus the ranks the coordinator declares lost (waiting up to verdict_wait).
  std::string DescribeWorldFailure(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checksums of `params` against the owner's; a differing copy is healed. Returns how many.
  absl::StatusOr<int64_t> CheckReplicas(const kernels::Context& ctx, comm::Communicator* comm,
                                        StepDeviceComm* dcomm, int64_t step,
                                        const std::vector<float*>& params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t TakeWorldBytes(StepRun& run);  // sent by the world's communicators since the join

  std::string id_;
  SessionSpec spec_;
  Layout layout_;
  // Set once by Create; declared before what uses its buffers, so destroyed after them.
  std::unique_ptr<DeviceSide, DeviceSideDeleter> device_;
  std::unique_ptr<HostMemory> host_memory_;  // or this; memory_ is the one set
  StepMemory* memory_ = nullptr;
  std::atomic<int64_t> state_bytes_{0};  // shrinks when a world session shards its state
  int64_t master_bytes_ = 0;             // of state_bytes_: the fp32 master weights
  std::vector<size_t> group_of_param_;   // index into groups_
  std::vector<size_t> slot_in_group_;    // position of the param inside its group
  ComputeThread* compute_ = nullptr;     // null: compute on the calling thread

  absl::Mutex mu_;
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  Arenas arenas_ ABSL_GUARDED_BY(mu_);
  int64_t last_step_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<StepResult> last_result_ ABSL_GUARDED_BY(mu_);
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
  absl::Time last_step_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t last_checkpoint_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_checkpoint_path_ ABSL_GUARDED_BY(mu_);
  absl::Time last_checkpoint_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::unique_ptr<WorldPart> world_ ABSL_GUARDED_BY(mu_);  // null: not a world session
  StepQueue queue_ ABSL_GUARDED_BY(mu_){&mu_, &id_};
  // Bumped by DrainQueuedStep: an overlapped step's wait for a doorbell (without mu_) gives up.
  std::atomic<int64_t> cancel_waits_{0};
  std::atomic<bool> in_doorbell_wait_{false};           // an overlapped step waits for a doorbell
  int64_t queued_cancel_gen_ ABSL_GUARDED_BY(mu_) = 0;  // cancel_waits_ when the step was queued
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_H_
