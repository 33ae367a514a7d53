// One training job's session: its parameters, optimizer state (one GroupOptimizer per group),
// the arenas the trainer shares with the daemon, and the record of the last step.
//
// Arenas: each role (PARAMETERS, GRADIENTS) is bound either to a registered shm region (no
// serialization and no copy: Step computes on the trainer's memory in place, converting only
// non-f32 dtypes and master weights through fp32 buffers) or, in remote mode, to a host buffer
// the daemon allocates on the first SetState/PushGradients that needs it.
//
// Trainer memory can shrink under the daemon (ftruncate): ShmRegion's SIGBUS guard makes such an
// access harmless, and every method that touches a region checks it afterwards and fails with
// FAILED_PRECONDITION ("... shrank ..."). Step stages every group's update before it writes
// anything and commits the optimizer state last, so a failed Step leaves the state, the master
// weights and the step index unchanged (docs/ARCHITECTURE.md §2, "What a failed Step changes").
//
// Every mutating method validates its whole request first and changes nothing on failure.
//
// The implementation is split by concern: session.cc (creation, hyperparameters, info),
// session_regions.cc (arenas, regions), session_step.cc (the step skeleton), step_memory.h (where
// a step's tensors lie: host memory, or a device session's staging in session_device.cc),
// session_world.cc and world_exchange.h (the world's phases), step_queue.h (the asynchronous
// step), session_state.cc (state and parameter transfer, snapshots).
//
// Thread-safety: all public methods are thread-safe; one session's calls are serialized by its
// mutex. Every pass of compute runs on the compute thread given to Create (one per daemon:
// the CPU backend's thread pools are process-wide, and libgomp's are per calling thread;
// kernels/context.h threading policy, compute_thread.h).
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
#include "server/memory/shm_region.h"
#include "server/session/compute_thread.h"
#include "server/session/shard_plan.h"
#include "server/session/step_queue.h"
#include "server/session/types.h"
#include "server/session/world_link.h"

namespace diond::comm {
class Communicator;
class World;
}  // namespace diond::comm

namespace diond::session {

class StepDeviceComm;

enum class Role { kParameters, kGradients };
absl::string_view RoleName(Role r);

// What a client stream writes: gradients (PushGradients) or parameters and state (SetState).
enum class StreamKind { kGradients, kState };

// One write into an arena or the state, from a stream chunk.
struct TensorWrite {
  std::string name;  // parameter name (its values or gradient) or "<param>/state.<name>"
  int64_t offset_bytes = 0;
  std::string data;
};

struct SessionInfo {
  std::string id;
  std::string client_name;
  std::string owner;  // SessionSpec::owner
  std::string session_name;
  int64_t parameters = 0;
  int64_t last_step_index = 0;
  int64_t state_bytes = 0;
  // What --max_session_bytes / --memory_budget_bytes count (Session::BudgetBytes): state_bytes
  // for a host session; a device session's device pool bytes plus its host-side state.
  int64_t budget_bytes = 0;
  int64_t host_bytes = 0;  // daemon-owned arenas and Step's fp32 conversion buffers
  absl::Time last_used;
  // Operator view (ListSessions, metrics).
  struct Group {
    std::string name;
    optim::AlgorithmKind algorithm = optim::AlgorithmKind::kMuon;
    int64_t parameters = 0;
  };
  std::vector<Group> groups;
  std::string world_key;
  absl::Time last_step_time = absl::InfinitePast();  // InfinitePast = no step yet
  int64_t last_checkpoint_step = 0;                  // 0 = none
  std::string last_checkpoint_path;
  absl::Time last_checkpoint_time = absl::InfinitePast();
};

// What a checkpoint holds: the spec, the step record and every tensor (fp32).
struct SessionSnapshot {
  std::string session_id;  // ReadCheckpoint: the id the checkpoint was written under
  SessionSpec spec;
  int64_t last_step_index = 0;
  // The answer of step last_step_index, so that a retried Step is replayed after a restore.
  std::optional<StepResult> last_result;
  std::vector<NamedTensor> tensors;  // "<param>" and "<param>/state.<name>"
};

class Session {
 public:
  // Validates the spec completely (names unique and non-empty, groups exist, every group's
  // options and shapes) and builds the optimizers. INVALID_ARGUMENT naming the bad field.
  // `ctx`: the context the session's steps will run with (SessionManager's, on the daemon's
  // compute device); the optimizer state is allocated on its device. Null: a process-wide CPU
  // context's allocator.
  //
  // A device session (ctx on a device other than the CPU; a world session too): the session
  // gets its own stream (runtime->create_stream), a Context on ctx's device with that stream, and
  // device staging for every parameter and gradient as fp32 (plus one tensor's worth in the
  // trainer's dtype for the conversions), allocated here once. RESOURCE_EXHAUSTED naming the
  // bytes and the pool's numbers when they do not fit. A world session on a device daemon keeps
  // its state and staging on the device as well, and its world phases exchange in device
  // buffers (DeviceWorldBuffer) through the step's StepDeviceComm: NCCL queued on the session's
  // stream where the world has a device communicator, else Gloo staged through host buffers
  // (--world_device_collectives=gloo, a plugin without NCCL, the TEST backend; docs/GPU.md
  // "World sessions", ARCHITECTURE.md §6). `runtime` (kernels/device_runtime.h; may be null, and
  // any entry may be null: that object is then not made) makes the stream, pins host memory and
  // captures graphs; its rules_on_device says where the state lives.
  // `compute` (may be null: every pass then runs on the calling thread) runs every pass of
  // compute of the session, Create's own included, and must outlive the session.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      std::string id, SessionSpec spec, const kernels::Context* ctx = nullptr,
      const kernels::DeviceRuntime* runtime = nullptr, ComputeThread* compute = nullptr);
  // The device session's numbers (streams made, staging bytes); false for a host session.
  bool is_device_session() const { return device_ != nullptr; }
  int64_t DeviceStagingBytes() const;
  // Of DeviceBytes: a world device session's exchange buffers (made by AttachWorld; 0 for a host
  // session or outside a world).
  int64_t DeviceWorldBytes() const;
  // The bytes a device session's staging takes from the device pool for `layout` (fp32
  // parameters and gradients, one tensor's conversion buffer, each rounded as Context::Allocate
  // rounds): what Create allocates first, so SessionManager checks it before anything exists.
  static int64_t DeviceStagingBytesFor(const Layout& layout);
  // What --max_session_bytes and --memory_budget_bytes count for this session now. A host
  // session: StateBytes(). A device session: everything its Context holds in the device pool
  // (staging, the state when the rules run on the device, the scratch blocks its steps grew;
  // the Context's own counters, which are the pool's) plus what it keeps on the host (fp32
  // master weights; the state when the rules run on the host).
  int64_t BudgetBytes() const;
  // The device pool bytes this session's Context holds now (0 for a host session).
  int64_t DeviceBytes() const;

  ~Session();  // waits for a queued asynchronous step (never call it on that step's thread)

  const std::string& id() const { return id_; }
  const SessionSpec& spec() const { return spec_; }
  const Layout& layout() const { return layout_; }
  // Bytes of optimizer state and fp32 master weights (what the budgets count for a host
  // session; BudgetBytes is what they count).
  int64_t StateBytes() const { return state_bytes_.load(); }

  // Maps a shm region for `role`. INVALID_ARGUMENT for a bad name, an offset not a multiple of
  // 256, a region smaller than the arena, or a region overlapping the other role's region in
  // the same segment; FAILED_PRECONDITION if the role is bound already; NOT_FOUND /
  // OUT_OF_RANGE from ShmRegion::Open. Returns the region id.
  absl::StatusOr<std::string> RegisterShmRegion(Role role, const std::string& name, int64_t offset,
                                                int64_t size);
  // Maps a sealed memfd (from the fd channel; ownership taken) for `role`, with the checks of
  // RegisterShmRegion and CheckMemfd's (server/memory/memfd_region.h). Returns the region id.
  absl::StatusOr<std::string> RegisterMemfdRegion(Role role, fdchannel::UniqueFd fd, int64_t offset,
                                                  int64_t size);
  // Binds trainer GPU memory opened by CudaRegion (cuda_region.h) to `role`: INVALID_ARGUMENT
  // for a region smaller than the role's arena; FAILED_PRECONDITION for a host session, for a
  // region on another device, if the role is bound, or
  // holds data in host memory (remote-mode uploads) that has no place on the GPU; weights
  // restored from a checkpoint (or kept from a previous trainer) are copied into a device
  // session's PARAMETERS region. The region is released on UnregisterRegion and with the
  // session. A device session steps on it on its stream, device to device (docs/DATA_PLANE.md
  // "CUDA regions"); no host path ever dereferences the region. Returns the id.
  absl::StatusOr<std::string> RegisterCudaRegion(Role role,
                                                 std::unique_ptr<memory::CudaRegion> region);
  // RegisterRegion's CUDA kinds: `open` opens the trainer's memory on the session's compute
  // device (CudaRegion::OpenIpc / OpenVmm), then RegisterCudaRegion binds it. FAILED_PRECONDITION
  // (nothing opened) for a host session (a CPU daemon's). A world session on a device daemon is
  // a device session and takes CUDA regions as a local one does (docs/DATA_PLANE.md "CUDA
  // regions").
  absl::StatusOr<std::string> OpenCudaRegion(
      Role role,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::CudaRegion>>(kernels::Device)> open);
  // NOT_FOUND for an unknown region id.
  absl::Status UnregisterRegion(const std::string& region_id);

  // One optimizer step (idempotent on step_index; see the proto). Its passes of compute run on
  // the compute thread given to Create (shared by the daemon's sessions), its collectives on the
  // calling thread.
  //
  // Asynchronous steps (request.asynchronous; docs/DATA_PLANE.md "Asynchronous Step"): the
  // request is validated here, the step runs on a thread of the session's, and the answer is
  // {queued, step_index}. `after_async` (may be empty) runs on that thread once the step
  // succeeded, before its result can be collected (SessionManager records the step and takes
  // the automatic checkpoint there; Snapshot works meanwhile). The next Step waits for the
  // queued one and collects its result (StepResult::previous) or fails with its error; a Step
  // with `wait` only collects. `ctx` must outlive the queued step.
  absl::StatusOr<StepResult> Step(const StepRequest& request, const kernels::Context& ctx,
                                  std::function<void(const StepResult&)> after_async = nullptr);
  // Waits until no asynchronous step of this session runs, then drops its uncollected outcome
  // (a failure is logged): CloseSession, AttachSession and daemon shutdown. `closing`: the
  // session is being closed, and every later Step is refused (so that none is queued after),
  // and its CUDA regions are released at once.
  // Returns the index of the step it waited for (0: none was queued).
  int64_t DrainQueuedStep(bool closing = false);

  // Applies stream writes (PushGradients: role kGradients; SetState chunks: parameters and state)
  // after validating every one: names exist, [offset, offset+len) inside the tensor, every
  // named tensor covered completely (a truncated stream is INVALID_ARGUMENT), byte counts a
  // multiple of the element size. Nothing is written unless all are valid.
  absl::Status ApplyGradientWrites(const std::vector<TensorWrite>& writes);
  absl::Status ApplyStateWrites(const std::vector<TensorWrite>& writes);
  // One chunk of a stream, checked as it arrives (before it is buffered): the name is one the
  // stream may write, [offset, offset + len) lies inside it, aligned to its elements.
  // INVALID_ARGUMENT as ApplyGradientWrites / ApplyStateWrites would answer.
  absl::Status CheckStreamChunk(StreamKind kind, const std::string& name, int64_t offset,
                                int64_t len);
  // The bytes of every tensor a stream of `kind` can write (each at most once): the bound on
  // what one stream may buffer.
  int64_t StreamBytesLimit(StreamKind kind);

  // Copies `len` bytes at `offset` of parameter `name` (trainer dtype) into `out`.
  // FAILED_PRECONDITION when no parameters are bound yet.
  absl::Status ReadParameterBytes(const std::string& name, int64_t offset, int64_t len,
                                  std::string* out);

  // The state (and optionally the parameters, as fp32) as named tensors.
  absl::StatusOr<std::vector<NamedTensor>> GetState(bool include_parameters);
  // Sets named fp32 tensors (as GetState returns them); all validated first.
  absl::Status SetState(const std::vector<NamedTensor>& tensors);

  // Replaces a group's lr / weight decay for future steps (lr schedules). INVALID_ARGUMENT for
  // an unknown group or a negative or non-finite value.
  absl::Status SetGroupHyperparameters(const std::string& group, std::optional<double> lr,
                                       std::optional<double> weight_decay);

  absl::StatusOr<SessionSnapshot> Snapshot();
  // Restores a snapshot into this (fresh) session; parameters go to the next PARAMETERS region
  // registered (or the host arena in remote mode).
  // DATA_LOSS naming the tensor unless the snapshot holds exactly the tensors the spec implies
  // (every parameter, every state tensor of the owned parameters), each with its exact shape.
  absl::Status Restore(const SessionSnapshot& snapshot);

  // A new trainer takes the session over (SessionManager::Attach): the shared-memory regions of
  // the previous one are unmapped, the current weights kept (exactly, as fp32 or master
  // weights) for the next PARAMETERS region registered. Remote-mode arenas stay as they are.
  void DetachTrainer();

  SessionInfo Info();
  absl::Time last_used();
  // Operator bookkeeping, recorded by SessionManager (shown by Info()).
  void RecordStepTime(absl::Time when);
  void RecordCheckpoint(int64_t step, std::string path, absl::Time when);
  int64_t last_step_index();
  // Whether the session holds weights (a PARAMETERS region, a daemon-owned arena, or the weights
  // kept across an AttachSession): what a checkpoint needs. False for a session whose trainer
  // never registered or sent them.
  bool HoldsParameters();

  // Makes this a world session (docs/DISTRIBUTED.md), before its first Step: `world` links to the
  // daemon world (null = a world of one), `plan` the shard plan the ranks agreed on, `epoch`
  // the world's generation at creation. Steps then run the owned parameters' updates and
  // exchange the results; a broken world (a later epoch, an aborted communicator, a failed
  // collective) fails this and every later Step with UNAVAILABLE naming the cause.
  // `verdict_wait`: how long a failed collective waits for the coordinator to name the lost rank
  // (about --peer_timeout plus a heartbeat), so the error can say which rank it was.
  // `checksum_every`: compare parameter checksums every N-th step (0 = never).
  // The state of the parameters other ranks own is released; on a device session that
  // reallocates the kept state in the device pool, which can fail (RESOURCE_EXHAUSTED naming the
  // group and the pool's numbers): the session must then be dropped.
  absl::Status AttachWorld(std::shared_ptr<WorldLink> world, ShardPlan plan, uint64_t epoch,
                           absl::Duration verdict_wait = absl::ZeroDuration(),
                           int64_t checksum_every = 0);
  // DION_COMPRESSED world sessions: replaces every Dion momentum by its average over the ranks
  // (between checkpoints each rank keeps its own, ALGORITHMS.md §9.7), so that a checkpoint holds
  // the synchronous momentum. A collective: every rank calls it at the same point
  // (SessionManager::SaveCheckpoint does). OK and nothing done for other sessions.
  absl::Status SynchronizeForCheckpoint();
  bool is_world_session() const { return !spec_.world_key.empty(); }

 private:
  friend class WorldExchange;  // phase 9 of a world step (world_exchange.h)
  // RegisterShmRegion's and RegisterMemfdRegion's common part: `name` identifies the segment
  // (overlap check), `open` maps it once the request is valid.
  absl::StatusOr<std::string> RegisterMappedRegion(
      Role role, const std::string& name, int64_t offset, int64_t size,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::ShmRegion>>()> open);
  struct Binding {
    std::unique_ptr<memory::ShmRegion> region;
    // Trainer GPU memory (RegisterCudaRegion); `data` stays null: no host path may read it.
    std::unique_ptr<memory::CudaRegion> cuda;
    std::vector<uint8_t> host;  // remote mode
    uint8_t* data = nullptr;
    std::string region_id;
    // A device session: the region's host registration for DMA; its deleter unregisters. Reset
    // before the region is unmapped (ClearBinding; destroyed first, as it is declared last).
    std::shared_ptr<void> dma;
    // Host-addressable memory (a shm / memfd region or a host arena) is bound.
    bool bound() const { return data != nullptr; }
    // Any memory is bound (host, or a CUDA region).
    bool any() const { return data != nullptr || cuda != nullptr; }
  };
  // Drops a binding: its host registration first, then the mapping.
  static void ClearBinding(Binding& b) {
    b.dma.reset();
    b = Binding();
  }
  // Where one step's tensors lie, and the passes that depend on it (step_memory.h): host memory
  // (HostMemory) or a device session's device objects (DeviceSide, session_device.cc; destroyed
  // after everything that uses them: declared before the groups and the bindings).
  class StepMemory;
  struct HostMemory;
  struct DeviceSide;
  struct DeviceSideDeleter {
    void operator()(DeviceSide* d) const;
  };
  // ---- device sessions (session_device.cc) ----
  absl::Status InitDeviceSide(const kernels::Context& ctx, const kernels::DeviceRuntime& runtime);
  // Pins a newly bound region for DMA (a device session with host_register; a failure is
  // logged, and the copies then go through pageable memory).
  void RegisterForDma(Role role, Binding& b);
  // Step's events (StepRequest::ready_event / done_event, docs/DATA_PLANE.md "The event
  // protocol"): each handle checked (64 bytes: INVALID_ARGUMENT) and opened on a device
  // session's device, or the one opened for an earlier step reused; FAILED_PRECONDITION for a
  // host session or a handle the device refuses. Nothing else is touched.
  absl::Status PrepareEventsLocked(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session stream waits on the request's ready_event / records its done_event (no-ops
  // without one).
  absl::Status WaitReadyEvent(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RecordDoneEvent(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Destroys the trainer's opened events (a closing session: no Step follows).
  void ReleaseTrainerEvents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A device session's compute device (nullopt for a host session).
  std::optional<kernels::Device> DeviceOfSession() const;
  // The context the update rules of a device session run on (DeviceSide::update_ctx).
  const kernels::Context* DeviceUpdateContext() const;
  // The pool's numbers of the last failed device allocation ("" for a host session).
  std::string DeviceAllocationError() const;
  // One Step's working set, passed through its phases (docs/ARCHITECTURE.md §2;
  // session_internal.h).
  struct StepRun;
  // The phases of a device step that can run as captured graphs (docs/GPU.md "CUDA graphs").
  enum class GraphPhase { kRead, kUpdate, kWrite };
  // At a device session's second step, and when its regions changed since: which phases may be
  // captured and replayed as graphs (a kernels::StepGraph is made for each; RunPhaseGraph tries
  // it), and why the others run eagerly ("unsupported", "world": compressed Dion, "pageable":
  // the read and write phases copy host memory that is not pinned), one log line each. Every
  // lasting fallback (these, and those RunPhaseGraph finds: "sync_point", "capture_failed") goes
  // into run.result.graph_fallbacks until a successful step carried it.
  void DecideStepGraphs(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `body` (re-runnable: a recording runs it before the capture) through the phase's graph
  // when it has one: replayed or captured, else eagerly (for good, unless the recording itself
  // failed), after `undo` dropped what the passes set up. Without a graph: `body` eagerly.
  absl::Status RunPhaseGraph(StepRun& run, GraphPhase which,
                             const std::function<absl::Status()>& body,
                             const std::function<void()>& undo) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The identity of the host memory the read and write phases copy, and why it cannot be in a
  // graph ("" when all of it is pinned: CUDA regions, registered shm / memfd regions, the
  // session's host words; and no master weights).
  std::string HostGraphKey() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string UnpinnedHostMemory() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- world device sessions (session_device.cc; used by session_world.cc) ----
  // The world phases' collectives run on device buffers (DeviceWorldBuffer, through
  // StepDeviceComm).
  // A device session's Context (its device and stream); null for a host session.
  const kernels::Context* DeviceContext() const;
  // A device session's staging of gradient i (where a world's averaged gradient goes).
  float* DeviceGradStaging(size_t i);
  // A device session's buffers for the world phases (session_world.cc), on its device: made by
  // AttachWorld at their final sizes (a world's sizes are fixed by its shard plan, so no step
  // allocates), zero-filled, kept; a later call with a larger `n` would replace one. kWire is the
  // reduce-scatter's input and then the exchange's gathered output (never live at once): one
  // buffer of about the parameters' fp32 size. RESOURCE_EXHAUSTED from the device pool.
  enum class WorldBuffer { kWire, kReduceOut, kDivisor, kExchangeMine, kCount };
  absl::StatusOr<float*> DeviceWorldBuffer(WorldBuffer which, int64_t n);
  struct Group {
    std::string name;
    std::unique_ptr<optim::GroupOptimizer> optimizer;
    std::vector<size_t> params;  // indices into layout_.tensors
    std::optional<double> lr;    // SetHyperparameters overrides
    std::optional<double> weight_decay;
  };

  Session() = default;
  Binding& binding(Role r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r == Role::kParameters ? params_ : grads_;
  }
  absl::Status EnsureHostArena(Role r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION "<when>: the <ROLE> shm region ... shrank ...; nothing was changed" when
  // a bound region (of role `only`, or of either role) has a segment shorter than the region
  // (fstat) or the SIGBUS guard caught a fault in it.
  absl::Status CheckRegions(const std::string& when, std::optional<Role> only = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Parameter i as fp32 (master weights, or widened from the arena).
  absl::Status ReadParamF32(size_t i, float* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether parameter i has master weights, and their copy out of / into the session (host
  // vectors, or a device session's device buffer through synchronous copies).
  bool HasMaster(size_t i) const { return i < has_master_.size() && has_master_[i] != 0; }
  absl::Status ReadMaster(size_t i, float* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteMaster(size_t i, const float* in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The weights held while no PARAMETERS arena was bound (pending_params_) become the master
  // weights, once the new arena holds them too: pending_params_ is released and master_valid_
  // set. On error (WriteMaster's status) the held weights stay held for the next attempt.
  absl::Status AdoptHeldWeightsAsMaster() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A device session with master weights: they move into one device buffer (allocated once;
  // RESOURCE_EXHAUSTED from the pool), and the host vectors are released.
  absl::Status InitDeviceMaster();
  // A device session's master weights of parameter i, on its device, and the commit's update of
  // them: the new weights in the staging copied over, queued on the session stream (ordered
  // before the next step's reads).
  float* DeviceMaster(size_t i);
  void QueueMasterCommit(size_t i);
  // A device session's CUDA PARAMETERS region: parameter i's trainer-dtype bytes copied to /
  // from the host (explicit copies on the session's stream).
  absl::Status CudaParamToHost(size_t i, std::vector<uint8_t>* bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CudaParamFromHost(size_t i, const std::vector<uint8_t>& bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // host_ctx_, made at the first call with host_threads_ threads.
  const kernels::Context& HostContext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The context of the optimizers' state, for Get/SetState (checkpoints, GetState RPCs): a device
  // session's update context (its device once the rules run there), else HostContext().
  const kernels::Context& StateContext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A CUDA PARAMETERS region: through the device session's context (explicit copies of the
  // trainer-dtype bytes; the widening / narrowing on the host), never a host dereference.
  absl::Status WriteParamF32(size_t i, const float* in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The synchronous step (session_step.cc), once the queue has been dealt with.
  absl::StatusOr<StepResult> StepLocked(const StepRequest& request, const kernels::Context& ctx,
                                        absl::Time start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- the step (session_step.cc; the world's phases in session_world.cc) ----
  // (StepRun, one Step's working set passed through its phases, is declared above.)
  // Phase 1: the request against the session (order of step_index, gradient_scale, the
  // overrides, the bindings, the regions' size). Sets *replay when the request repeats the
  // recorded last step.
  absl::Status ValidateStepLocked(const StepRequest& request, std::optional<StepResult>* replay)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 2: the world's communicator for this step (a world of one: none).
  absl::Status JoinWorldPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 3b (world): the ranks agree on the parameters without a gradient
  // (StepRequest.params_without_grad) by one all-reduce of a count per parameter: under AVERAGE
  // a parameter is stepped when any rank has its gradient (the others add zeros); under
  // REPLICATED, and for compressed Dion's groups, every rank must name the same ones, else
  // FAILED_PRECONDITION on every rank with nothing changed. A world of one: nothing.
  absl::Status AgreeGradientsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 4 (world AVERAGE): reduce-scatter the gradients to their owners, with the ranks'
  // non-finite flags. A world of one: nothing.
  absl::Status ReduceGradientsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 6: every group's update staged (GroupOptimizer::Stage); nothing changes yet.
  // StageGroups (and, in a local device session, QueueStagedWeights) through the update phase's
  // graph when the session has one (RunPhaseGraph): replayed or captured, else (and from then
  // on, unless the step itself failed) run eagerly.
  absl::Status StagePhase(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every group's GroupOptimizer::Stage; the first failure, named. Re-runnable (a recording
  // runs it before the capture): it sets up the run's per-group fields itself and leaves the
  // failure's consequences (discard, the world's status) to StageUpdatesPhase.
  absl::Status StageGroups(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StageUpdatesPhase(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 7: the new weights into the arenas (GroupOptimizer::WriteStagedParams, then the
  // narrowing of non-f32 parameters); the state is still unchanged. (A local device session
  // wrote them into its staging in StagePhase, QueueStagedWeights.)
  void WriteWeightsPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (Reading the gradients and the weights, writing the weights back and the master weights'
  // commit are the StepMemory's: step_memory.h.)
  // Device sessions (DeviceSide, the device StepMemory): those passes through the device
  // staging.
  absl::Status ReadGradientsToDevice(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The read phase's queued work (the gradients' and parameters' copies, widenings and scans,
  // the flag's read-back into the host words), and the write phase's (the new weights' copies
  // into the trainer's memory, narrowed on the device).
  absl::Status QueueStepReads(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status QueueWeightCopies() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A local device session: every staged group's new weights into the staging, with the norms'
  // read-back queued into the host words (GroupOptimizer::WriteStagedParamsDeferringNorm).
  void QueueStagedWeights(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReadParametersToDevice(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The new weights device -> host: narrowed on the device into the trainer's dtype and copied
  // into its arena; master weights copied to param_scratch_ for the commit's swap.
  absl::Status WriteWeightsFromDevice(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 8 (world): exchange the owners' updates (all-gather-v), apply the others' compact
  // updates, compare checksums. A world of one: nothing.
  absl::Status ExchangeUpdatesPhase(StepRun& run, const kernels::Context& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Phase 9: the staged state becomes current, master weights swapped in, the step recorded.
  StepResult CommitStepPhase(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // On a failure after phase 6: every group's staged results dropped (state unchanged).
  void DiscardStep(StepRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A world step's failure: the world session is broken from now on (UNAVAILABLE or `code`).
  absl::Status BreakWorld(StepRun& run, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // One write's name, range and alignment; `tensor_bytes` = the named tensor's size.
  absl::Status CheckWriteLocked(const std::string& name, int64_t offset, int64_t len,
                                bool state_names, int64_t* tensor_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateWrites(const std::vector<TensorWrite>& writes, bool state_names,
                              std::vector<std::pair<int, std::string>>* resolved)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ResolveStateName(const std::string& name, size_t* param, size_t* group,
                                std::string* state, std::vector<int64_t>* shape)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SetStateLocked(const std::vector<NamedTensor>& tensors)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<NamedTensor>> GetStateLocked(bool include_parameters)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a failed collective: "<why>" plus the ranks the coordinator declares lost, waiting up
  // to verdict_wait for its verdict.
  std::string DescribeWorldFailure(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank's checksum of every parameter (fp32 values in `params`) compared with the owner's;
  // a differing copy is replaced by the owner's (broadcast). Returns how many this rank healed.
  // `ctx`: a CPU context for host `params`; a device session checksums its device staging on
  // its own context (only the checksums cross, on `comm`) and heals through `dcomm`, its step's
  // device collectives (null for a host session), then waits for the heals (WaitQueued).
  absl::StatusOr<int64_t> CheckReplicas(const kernels::Context& ctx, comm::Communicator* comm,
                                        StepDeviceComm* dcomm, int64_t step,
                                        const std::vector<float*>& params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bytes this step sent through the world's communicators (host and device), since
  // JoinWorldPhase; resets them.
  int64_t TakeWorldBytes(StepRun& run);
  // The device halves of the world phases (session_world.cc): block = floats per rank of the
  // reduce-scatter (its gradients, padded, and the non-finite flag).
  absl::Status ReduceGradientsOnDevice(StepRun& run, int64_t block)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct WorldPart {
    std::shared_ptr<WorldLink> world;  // null: a world of one
    ShardPlan plan;
    uint64_t epoch = 0;
    int rank = 0;
    std::vector<std::vector<size_t>> owned;  // per rank, parameter indices in order
    std::vector<int64_t> owned_elements;     // per rank
    // Per parameter: floats of its compact update (optim::CapturedUpdateSize; Dion P/Q_new,
    // Dion2 slices), 0 = the whole parameter is exchanged.
    std::vector<int64_t> compact;
    std::vector<int64_t> owned_payload;  // per rank: floats it sends in the exchange
    // Per parameter: computed by every rank on its own gradients (Dion under DION_COMPRESSED),
    // so neither reduce-scattered nor exchanged.
    std::vector<bool> replicated;
    absl::Status broken;  // set once a step failed in the world
    absl::Duration verdict_wait;
    int64_t checksum_every = 0;
  };

  std::string id_;
  SessionSpec spec_;
  Layout layout_;
  // Set once by Create for a device session; its buffers are used under mu_ by Step.
  std::unique_ptr<DeviceSide, DeviceSideDeleter> device_;
  // Where a step's tensors lie (step_memory.h), set once by Create: device_, or host_memory_.
  std::unique_ptr<HostMemory> host_memory_;
  StepMemory* memory_ = nullptr;
  std::atomic<int64_t> state_bytes_{0};  // shrinks when a world session shards its state
  // Of state_bytes_: the fp32 master weights (host memory); set by Create.
  int64_t master_bytes_ = 0;
  std::vector<size_t> group_of_param_;  // index into groups_
  std::vector<size_t> slot_in_group_;   // position of the param inside its group

  absl::Mutex mu_;
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  Binding params_ ABSL_GUARDED_BY(mu_);
  Binding grads_ ABSL_GUARDED_BY(mu_);
  int64_t next_region_ ABSL_GUARDED_BY(mu_) = 1;
  // fp32 master weights for non-f32 parameters when spec_.fp32_master_weights (has_master_):
  // host vectors, or, in a device session, the device buffer of its DeviceSide (device_master_:
  // the vectors are then empty). Reached through HasMaster / ReadMaster / WriteMaster outside the
  // step.
  std::vector<std::vector<float>> master_ ABSL_GUARDED_BY(mu_);
  std::vector<char> has_master_;
  bool device_master_ = false;
  bool master_valid_ ABSL_GUARDED_BY(mu_) = false;
  // Step's fp32 buffers for what cannot be used in place: gradients of another dtype or scaled,
  // parameters of another dtype, the next master weights. Kept between steps: allocating them
  // fresh every step cost more in page faults than the conversions themselves (a 214 MB arena:
  // ~1 s per step on 2 loaded cores, against ~0.1 s reused).
  std::vector<std::vector<float>> grad_scratch_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<float>> param_scratch_ ABSL_GUARDED_BY(mu_);
  // Parameters restored from a checkpoint, waiting for the first PARAMETERS binding.
  std::vector<std::vector<float>> pending_params_ ABSL_GUARDED_BY(mu_);
  int64_t last_step_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<StepResult> last_result_ ABSL_GUARDED_BY(mu_);
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
  absl::Time last_step_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t last_checkpoint_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_checkpoint_path_ ABSL_GUARDED_BY(mu_);
  absl::Time last_checkpoint_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::optional<WorldPart> world_ ABSL_GUARDED_BY(mu_);
  // A CPU context for the session's passes over host memory when the steps' context is on
  // another device (made at the first such step), and for the conversions outside a Step
  // (registration, SetState, restore): HostContext().
  std::unique_ptr<kernels::Context> host_ctx_ ABSL_GUARDED_BY(mu_);
  // The thread count of the context the session was created for (0: the CPU default): the host
  // context gets the same, so its ops leave OpenBLAS's process-wide pool size alone.
  int host_threads_ = 0;
  // Where the session's compute runs (compute_thread.h); null: on the calling thread.
  ComputeThread* compute_ = nullptr;
  // The asynchronous step queued and not yet collected (at most one), its thread, and the
  // session's closing flag (step_queue.h).
  StepQueue queue_ ABSL_GUARDED_BY(mu_){&mu_, &id_};
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_H_
