// A device session's side of the session (docs/GPU.md "Device sessions"): its stream, a Context
// on the device with that stream, and fp32 staging for every parameter and gradient, made once
// at creation. It is the device StepMemory (step_memory.h): a step copies the trainer's memory
// into the staging on the session stream, widens, scales and scans it there, runs the update,
// and narrows and copies the new weights back, with one host wait before the update and one
// after. From the second step the read, update and write phases run as captured graphs where
// they can (session_graph.cc).
//
// The files: session_device.cc (making it, its numbers, events, DMA, world buffers),
// session_device_step.cc (the step's passes), session_graph.cc (graph capture and replay),
// session_overlap_device.cc (the overlapped step's passes and the buckets' events).
// Internal to the session's implementation; every method runs under the session's mutex.
#ifndef DIOND_SERVER_SESSION_SESSION_DEVICE_H_
#define DIOND_SERVER_SESSION_SESSION_DEVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/device_runtime.h"
#include "kernels/graph.h"
#include "kernels/tensor.h"
#include "server/session/session.h"
#include "server/session/step_memory.h"

namespace diond::session {

namespace internal {

inline kernels::ConstTensorView DeviceView(kernels::Device device, DType dtype, const void* p,
                                           int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(dtype, {n}), device);
}
inline kernels::TensorView DeviceView(kernels::Device device, DType dtype, void* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(dtype, {n}), device);
}

}  // namespace internal

struct Session::DeviceSide final : Session::StepMemory {
  // The phases of a device step that can run as captured graphs (session_graph.cc).
  enum class GraphPhase { kRead, kUpdate, kWrite };
  // The world phases' buffers, made by AttachWorld at their final sizes (a world's sizes are
  // fixed by its shard plan, so no step allocates). kWire is the reduce-scatter's input, then
  // the exchange's output (never live at once).
  enum class WorldBuffer { kWire, kReduceOut, kDivisor, kExchangeMine, kCount };

  // Makes the stream, the context and the staging for `s`'s layout; RESOURCE_EXHAUSTED naming
  // the bytes and the pool's numbers when the staging does not fit.
  static absl::StatusOr<std::unique_ptr<DeviceSide, DeviceSideDeleter>> Make(
      const Session& s, const kernels::Context& ctx, const kernels::DeviceRuntime& runtime);

  kernels::Device device;
  kernels::DeviceRuntime runtime;
  kernels::StreamHandle stream = nullptr;
  // On `device`, with `stream`: the session's copies, conversions and scans (and the update when
  // the rules run on the device).
  std::unique_ptr<kernels::Context> ctx;
  // Only when the rules do not run on the device (DeviceRuntime::rules_on_device false, which the
  // daemon allows only for host-addressable device memory): a CPU context over the staging.
  std::unique_ptr<kernels::Context> host;
  // fp32 staging of every parameter and every gradient (offset[i] elements in), and one
  // tensor's worth of trainer-dtype bytes for the widening and narrowing.
  kernels::Buffer grads, params, raw;
  // On the device: [0] 1 when a gradient of this step was found non-finite, read back once per
  // step into words[0]; [1 + i] parameter i's gradient norm for a clip (grad_clip.h).
  kernels::Buffer nonfinite;
  // The step's host words, one page-aligned block pinned with host_register where the backend
  // has it (words_pinned), so the copies into them can be part of a captured graph: [0] the
  // non-finite flag, [1 + ...] the groups' Σ(Δx)² read-backs of a local session.
  float* words = nullptr;
  size_t words_bytes = 0;
  bool words_pinned = false;
  // The world phases' device buffers (WorldBuffer), made by AttachWorld.
  kernels::Buffer world[static_cast<size_t>(WorldBuffer::kCount)];
  // The step's parameter reads were queued with its gradient reads, so ReadParameters has
  // nothing left to copy.
  bool params_queued = false;
  std::vector<int64_t> offset;
  int64_t staging_bytes = 0;
  // The step's phases as captured graphs (kernels/graph.h): kRead (the uploads, widenings, scans
  // and the flag's read-back), kUpdate (the rules; a local session's new weights and norms too)
  // and kWrite (the new weights into the trainer's memory). Decided at the second step.
  struct PhaseGraph {
    explicit PhaseGraph(const char* n) : name(n) {}
    const char* name;
    std::unique_ptr<kernels::StepGraph> graph;  // null: the phase runs eagerly
    bool decided = false;
    std::string reason;     // why the phase runs eagerly for good ("" while it may be a graph)
    bool reported = false;  // a successful step's result carried `reason` (counted once)
  };
  PhaseGraph phases[3] = {PhaseGraph("read"), PhaseGraph("update"), PhaseGraph("write")};
  PhaseGraph& phase(GraphPhase p) { return phases[static_cast<int>(p)]; }
  // The host memory the read and write graphs copy, as of their decision: a different key drops
  // those graphs and decides them again.
  std::string host_key;
  // The trainer's interprocess events of the last Step that named them: the handle and the event
  // opened from it; destroyed with the session or when the trainer names another.
  struct IpcEvent {
    std::string handle;
    void* event = nullptr;
  };
  IpcEvent ready, done;
  // The doorbell page's, one pair per bucket or none, opened when the page is registered and
  // destroyed with it (unregistered, a new trainer, the session closed).
  struct BucketEvents {
    void* ready = nullptr;
    void* done = nullptr;
  };
  std::vector<BucketEvents> bucket_events;

  const kernels::Context& update_ctx() const { return runtime.rules_on_device ? *ctx : *host; }
  float* grad(size_t i) { return grads.As<float>() + offset[i]; }
  float* param(size_t i) { return params.As<float>() + offset[i]; }

  // ---- outside a step (session_device.cc) ----
  // Every opened event destroyed (a failure logged) and forgotten.
  void DestroyEvents();
  // Pins a newly bound region for DMA (a failure is logged: the copies then go through pageable
  // memory).
  void RegisterForDma(const Session& s, Role role, Arenas::Binding& b);
  // A world buffer of at least n floats, zero-filled when made; RESOURCE_EXHAUSTED from the pool.
  absl::StatusOr<float*> WorldBufferOf(const Session& s, WorldBuffer which, int64_t n);
  std::string AllocationError() const;

  // ---- the step's passes (step_memory.h; session_device_step.cc) ----
  const kernels::Context& UpdateContext(Session& s, const kernels::Context& c) override {
    return update_ctx();
  }
  void PrepareStep(Session& s, StepRun& run) override {
    // An overlapped step runs its passes eagerly, bucket by bucket: no phase of it is a graph.
    if (s.last_step_index_ >= 1 && !run.request->overlap) DecideGraphs(s, run);
  }
  absl::Status PrepareEvents(Session& s, const StepRequest& request) override;
  absl::Status RecordDoneEvent(Session& s, const StepRequest& request) override;
  absl::Status ReadGradients(Session& s, StepRun& run) override;
  absl::Status ReduceGradients(Session& s, StepRun& run, const std::vector<std::vector<size_t>>& of,
                               int64_t block, const std::vector<float>& flags,
                               std::vector<float>* summed) override;
  // The step's device collectives (device_comm.h) over the world's device communicator, else
  // staged through the host one.
  void JoinWorld(Session& s, StepRun& run,
                 std::shared_ptr<comm::Communicator> device_comm) override;
  // This rank's block and the wire in the world buffers; the step's device collectives.
  absl::StatusOr<std::unique_ptr<ExchangeWire>> MakeExchangeWire(Session& s, StepRun& run,
                                                                 int64_t mine,
                                                                 int64_t total) override;
  absl::Status ReadParameters(Session& s, StepRun& run) override;
  // The rules (and, in a local session, the new weights into the staging with the norms'
  // read-back) through the update phase's graph: one graph from the rules to the new weights.
  absl::Status Stage(Session& s, StepRun& run, const kernels::Context& c) override;
  bool StageWritesWeights(const Session& s) const override { return s.world_ == nullptr; }
  absl::Status WriteWeights(Session& s, StepRun& run) override;
  // The new master weights copied from the staging, queued on the session stream.
  void CommitMaster(Session& s, size_t i) override;
  void FallbacksReported() override {
    for (auto& p : phases) p.reported = true;
  }

  // ---- an overlapped step's passes (session_overlap_device.cc) ----
  void BeginBuckets(Session& s, StepRun& run) override;
  // The stream waits on the bucket's ready event, then the bucket's reads, widenings and scans
  // queued as ReadGradients queues them, and the flag read back (one host wait per bucket).
  absl::Status ReadGradientsOf(Session& s, StepRun& run, size_t k,
                               const std::vector<size_t>& params) override;
  // The bucket's weights queued as WriteWeights queues them, its done event recorded after
  // them, and one host wait.
  absl::Status WriteWeightsOf(Session& s, StepRun& run, size_t k,
                              const std::vector<size_t>& params) override;
  absl::Status RecordBucketsDone(Session& s) override;
  // The doorbell page's events, opened from `buckets`' handles (none when they have none); on
  // failure FAILED_PRECONDITION naming the bucket, and nothing kept open.
  absl::Status OpenBucketEvents(const Session& s, const std::vector<DoorbellBucket>& buckets);
  // Every bucket's events destroyed (a failure logged): the page went.
  void DestroyBucketEvents();

  // The read phase's queued work: the gradients' and parameters' copies, widenings and scans,
  // and the flag's read-back into the host words.
  absl::Status QueueStepReads(Session& s, StepRun& run);
  // Gradient i's copy (from host memory), widening and scan into `flag`; run.grads[i] set.
  absl::Status QueueGradientRead(Session& s, StepRun& run, size_t i,
                                 const kernels::TensorView& flag);
  // Every parameter's read into the staging (host -> device, or device to device from a CUDA
  // region); the host memory is read when the stream gets there.
  absl::Status QueueParameterReads(Session& s, StepRun& run);
  // The write phase's: the new weights narrowed on the device and copied into the trainer's.
  absl::Status QueueWeightCopies(Session& s);
  absl::Status QueueWeightCopy(Session& s, size_t i);  // parameter i's
  // A local session: every staged group's new weights into the staging, the norms' read-back
  // queued into the host words (GroupOptimizer::WriteStagedParamsDeferringNorm).
  void QueueStagedWeights(Session& s, StepRun& run);

  // ---- graphs (session_graph.cc; docs/GPU.md "CUDA graphs") ----
  // At the second step, and when the regions changed since: which phases may be captured (a
  // StepGraph each) and why the others run eagerly ("unsupported", "world", "pageable"), one
  // log line each. A lasting fallback goes into run.result.graph_fallbacks until a successful
  // step carried it.
  void DecideGraphs(Session& s, StepRun& run);
  // Runs `body` (re-runnable: a recording runs it before the capture) through the phase's graph
  // when it has one: replayed or captured, else eagerly (for good, unless the recording itself
  // failed), after `undo` dropped what the passes set up. Without a graph: `body` eagerly.
  absl::Status RunPhaseGraph(Session& s, StepRun& run, GraphPhase which,
                             const std::function<absl::Status()>& body,
                             const std::function<void()>& undo);
  // The identity of the host memory the read and write phases copy, and why it cannot be in a
  // graph ("" when all of it is pinned and there are no master weights).
  static std::string HostGraphKey(const Arenas& a);
  std::string UnpinnedHostMemory(const Arenas& a) const;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_DEVICE_H_
