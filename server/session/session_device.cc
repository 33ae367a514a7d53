// Device sessions (docs/GPU.md, "Device sessions"): a session of a daemon whose compute device
// is not the CPU keeps its own stream, a Context on the device with that stream, and device
// staging for every parameter and gradient (fp32), allocated once at creation. A step copies the
// trainer's gradients and weights host -> device on the session stream, widens / scales / scans
// them there (ops on the device copy), runs the update on the device staging, then narrows the
// new weights on the device and copies them device -> host into the trainer's arena.
//
// The step stays transactional (ARCHITECTURE.md §2): the trainer's memory is written only after
// every group staged its update and the regions were found intact, and the optimizer state is
// committed last, exactly where the host session writes and commits.
//
// The step's host <-> device copies are stream-ordered (docs/GPU.md "Sync points"): every
// gradient and parameter copy host -> device is queued on the session stream, the finiteness of
// every gradient is OR-ed into one device flag, and the flag's read-back into the session's
// pinned host words is queued last and waited for once (which completes the copies) before the
// rules run; the new weights device -> host are queued too and waited for once before the
// answer. From the second step these three phases (read, update, write) run as captured graphs
// where they can (DecideStepGraphs, RunPhaseGraph; docs/GPU.md "CUDA graphs"). The synchronous
// helpers (CopyToDevice / CopyToHost) stay for the copies outside a step (SetState,
// PullParameters, the probe).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/graph.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"
#include "server/session/session_manager.h"
#include "server/session/step_memory.h"

namespace diond::session {

struct Session::DeviceSide final : Session::StepMemory {
  kernels::Device device;
  kernels::DeviceRuntime runtime;
  kernels::StreamHandle stream = nullptr;
  // On `device`, with `stream`: the session's copies, conversions and scans (and the update when
  // the rules run on the device).
  std::unique_ptr<kernels::Context> ctx;
  // Only when the rules do not run on the device (DeviceRuntime::rules_on_device false, which the
  // daemon allows only for host-addressable device memory): a CPU context that steps the device
  // staging.
  std::unique_ptr<kernels::Context> host;
  // fp32 staging of every parameter and every gradient (offset[i] elements in), and one
  // tensor's worth of trainer-dtype bytes for the widening and narrowing.
  kernels::Buffer grads, params, raw;
  // One f32 on the device: 1 when a gradient of this step was found non-finite (AllFiniteFlag),
  // read back once per step into words[0].
  kernels::Buffer nonfinite;
  // The step's host words, in one page-aligned block of the session's, pinned with host_register
  // where the backend has it (words_pinned), so that the copies into them can be part of a
  // captured graph: [0] the non-finite flag's read-back, [1 + ...] the groups' Σ(Δx)² read-backs
  // in a local session (WriteStagedParamsDeferringNorm), group after group.
  float* words = nullptr;
  size_t words_bytes = 0;
  bool words_pinned = false;
  // The master weights (Session::InitDeviceMaster): fp32, master_offset[i] elements in for a
  // parameter that has them (else -1); made once at creation, updated at each commit.
  kernels::Buffer master;
  std::vector<int64_t> master_offset;
  // The world phases' device buffers (Session::DeviceWorldBuffer), made on first use.
  kernels::Buffer world[static_cast<size_t>(WorldBuffer::kCount)];
  // The step's parameter reads were queued with its gradient reads (ReadGradientsToDevice), so
  // ReadParametersToDevice has nothing left to copy.
  bool params_queued = false;
  std::vector<int64_t> offset;
  int64_t staging_bytes = 0;
  // The step's phases as captured graphs (kernels/graph.h, docs/GPU.md "CUDA graphs"): kRead
  // (the uploads, widenings and scans, and the flag's read-back), kUpdate (the rules; in a local
  // session also the new weights into the staging and the norms' read-back) and kWrite (the new
  // weights back into the trainer's memory). Each decided by DecideStepGraphs at the second step.
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
  // The host memory the read and write graphs copy (regions and their registrations), as of
  // their decision: a different key drops those graphs and decides them again.
  std::string host_key;
  // The trainer's interprocess events of the last Step that named them (PrepareEventsLocked):
  // the handle and the event opened from it; destroyed with the session or when the trainer
  // names another.
  struct IpcEvent {
    std::string handle;
    void* event = nullptr;
  };
  IpcEvent ready, done;
  void DestroyEvents();

  const kernels::Context& update_ctx() const { return runtime.rules_on_device ? *ctx : *host; }
  // Queues every parameter's read into the staging (host -> device, or device to device from a
  // CUDA region, widened there) on the session stream; the host memory is read only when the
  // stream gets there, so the caller waits for the stream before the regions are checked.
  static absl::Status QueueParameterReads(Session& s, StepRun& run);
  float* grad(size_t i) { return grads.As<float>() + offset[i]; }
  float* param(size_t i) { return params.As<float>() + offset[i]; }

  // The step's passes (step_memory.h), on the device staging.
  const kernels::Context& UpdateContext(Session& s, const kernels::Context& c) override {
    return update_ctx();
  }
  void PrepareStep(Session& s, StepRun& run) override {
    if (s.last_step_index_ >= 1) s.DecideStepGraphs(run);
  }
  absl::Status ReadGradients(Session& s, StepRun& run) override {
    return s.ReadGradientsToDevice(run);
  }
  absl::Status ReadParameters(Session& s, StepRun& run) override {
    return s.ReadParametersToDevice(run);
  }
  absl::Status Stage(Session& s, StepRun& run, const kernels::Context& c) override {
    return s.StagePhase(run, c);
  }
  bool StageWritesWeights(const Session& s) const override { return !s.world_.has_value(); }
  absl::Status WriteWeights(Session& s, StepRun& run) override {
    return s.WriteWeightsFromDevice(run);
  }
  void CommitMaster(Session& s, size_t i) override { s.QueueMasterCommit(i); }
  void FallbacksReported() override {
    for (auto& p : phases) p.reported = true;
  }
};

// Every opened event destroyed (a failure logged) and forgotten.
void Session::DeviceSide::DestroyEvents() {
  for (IpcEvent* e : {&ready, &done}) {
    if (e->event == nullptr) continue;
    if (absl::Status s = kernels::DeviceRuntimeFor(device.type).destroy_event(device, e->event);
        !s.ok()) {
      DIOND_LOG(WARNING) << "destroying a trainer's event failed: " << s.message();
    }
    *e = {};
  }
}

void Session::ReleaseTrainerEvents() {
  if (device_ != nullptr) device_->DestroyEvents();
}

void Session::DeviceSideDeleter::operator()(DeviceSide* d) const {
  if (d == nullptr) return;
  for (auto& p : d->phases) p.graph.reset();  // graphs and scalar blocks, before the stream
  d->grads.Reset();
  d->params.Reset();
  d->raw.Reset();
  d->nonfinite.Reset();
  d->master.Reset();
  for (kernels::Buffer& b : d->world) b.Reset();
  d->ctx.reset();  // its scratch blocks go back to the pool
  d->DestroyEvents();
  if (d->stream != nullptr && d->runtime.destroy_stream)
    d->runtime.destroy_stream(d->device, d->stream);
  if (d->words != nullptr) {
    if (d->words_pinned && d->runtime.host_unregister) {
      if (absl::Status s = d->runtime.host_unregister(d->device, d->words); !s.ok()) {
        DIOND_LOG(WARNING) << "host_unregister of a session's host words failed: " << s.message();
      }
    }
    std::free(d->words);
  }
  delete d;
}

int64_t Session::DeviceStagingBytes() const {
  return device_ != nullptr ? device_->staging_bytes : 0;
}

int64_t Session::DeviceStagingBytesFor(const Layout& layout) {
  // Context::Allocate hands out whole 64-byte lines (kernels/api/context.cc).
  auto rounded = [](int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 63) / 64 * 64; };
  int64_t total = 0, largest = 0;
  for (const TensorPlacement& t : layout.tensors) {
    total += t.numel;
    largest = std::max(largest, t.numel);
  }
  return 2 * rounded(4 * total) + rounded(4 * largest) + rounded(4);  // + the non-finite flag
}

int64_t Session::DeviceBytes() const {
  // The session's Context counts every byte it took from the pool and still holds: staging,
  // scratch blocks, and (rules on the device) the state, whose Allocator shares the counters.
  return device_ != nullptr ? device_->ctx->bytes_in_use() : 0;
}

int64_t Session::BudgetBytes() const {
  if (device_ == nullptr) return StateBytes();
  // The master weights are in the device pool (InitDeviceMaster), with the staging; the state
  // too when the rules run on the device.
  return DeviceBytes() + (device_->runtime.rules_on_device ? 0 : StateBytes() - master_bytes_);
}

const kernels::Context* Session::DeviceUpdateContext() const {
  return device_ != nullptr ? &device_->update_ctx() : nullptr;
}

std::string Session::DeviceAllocationError() const {
  if (device_ == nullptr || !device_->runtime.last_allocation_error) return "";
  return device_->runtime.last_allocation_error();
}

std::string Session::HostGraphKey() const {
  // A binding's identity: its region id (new at every registration), where it is mapped, its
  // DMA registration, and a CUDA region's device memory.
  auto one = [](const Binding& b) {
    return absl::StrCat(b.region_id, "@", reinterpret_cast<uintptr_t>(b.data), "/",
                        reinterpret_cast<uintptr_t>(b.dma.get()), "/",
                        b.cuda != nullptr ? reinterpret_cast<uintptr_t>(b.cuda->data()) : 0);
  };
  return absl::StrCat(one(params_), ";", one(grads_));
}

std::string Session::UnpinnedHostMemory() const {
  const DeviceSide& d = *device_;
  if (!d.words_pinned) return "the session's host words are not registered for DMA";
  for (Role r : {Role::kParameters, Role::kGradients}) {
    const Binding& b = r == Role::kParameters ? params_ : grads_;
    if (b.cuda != nullptr || b.data == nullptr || b.dma != nullptr) continue;
    return absl::StrCat(
        "the ", RoleName(r), " ",
        b.region != nullptr ? b.region->Describe() : std::string("host arena of the streamed path"),
        " is not registered for DMA (pinned)");
  }
  return "";
}

void Session::DecideStepGraphs(StepRun& run) {
  DeviceSide& d = *device_;
  if (std::string key = HostGraphKey(); key != d.host_key) {
    // The regions changed since the phases that copy host memory were decided: their graphs
    // hold the old addresses. Decided again below.
    for (GraphPhase p : {GraphPhase::kRead, GraphPhase::kWrite}) {
      DeviceSide::PhaseGraph& pg = d.phase(p);
      pg.graph.reset();
      pg.decided = false;
      pg.reason.clear();
      pg.reported = false;
    }
    d.host_key = std::move(key);
  }
  const bool capture = d.runtime.begin_capture && d.runtime.end_capture && d.runtime.launch_graph &&
                       d.stream != nullptr;
  for (GraphPhase p : {GraphPhase::kRead, GraphPhase::kUpdate, GraphPhase::kWrite}) {
    DeviceSide::PhaseGraph& pg = d.phase(p);
    if (!pg.decided) {
      pg.decided = true;
      std::string reason, why;
      if (!capture) {
        reason = "unsupported";
        why = "the device backend has no stream capture (or --step_graphs=false)";
      } else if (p == GraphPhase::kUpdate && !d.runtime.rules_on_device) {
        reason = "unsupported";
        why = "the update rules do not run on the device context";
      } else if (p == GraphPhase::kUpdate && world_.has_value() &&
                 std::find(world_->replicated.begin(), world_->replicated.end(), true) !=
                     world_->replicated.end()) {
        reason = "world";
        why =
            "compressed Dion averages P and R with the other ranks inside its update, which a "
            "captured graph of one daemon cannot hold";
      } else if (p != GraphPhase::kUpdate) {
        why = UnpinnedHostMemory();
        if (!why.empty()) reason = "pageable";
      }
      if (reason.empty()) {
        // (A world session's collectives run between the phases, outside the graphs.) The
        // phase's first Run (this step) captures, or says why it cannot.
        kernels::GraphHooks gh;
        gh.begin_capture = d.runtime.begin_capture;
        gh.end_capture = d.runtime.end_capture;
        gh.launch = d.runtime.launch_graph;
        gh.destroy = d.runtime.destroy_graph;
        kernels::StepGraph::Options o;
        // The read and write phases copy the trainer's (pinned) memory; a local session's update
        // reads its norms back into the pinned host words.
        o.host_copies = p != GraphPhase::kUpdate || !world_.has_value();
        pg.graph = std::make_unique<kernels::StepGraph>(d.ctx.get(), std::move(gh), o);
      } else {
        DIOND_LOG(INFO) << "session " << id_ << ": the " << pg.name << " phase of its steps runs "
                        << "eagerly, not as a captured graph (reason " << reason << ": " << why
                        << ")";
        pg.reason = reason;
        pg.reported = false;
      }
    }
    if (!pg.reason.empty() && !pg.reported) {
      run.result.graph_fallbacks.emplace_back(pg.name, pg.reason);
    }
  }
}

absl::Status Session::RunPhaseGraph(StepRun& run, GraphPhase which,
                                    const std::function<absl::Status()>& body,
                                    const std::function<void()>& undo) {
  if (device_ == nullptr || device_->phase(which).graph == nullptr) return body();
  DeviceSide::PhaseGraph& pg = device_->phase(which);
  absl::StatusOr<kernels::StepGraph::Outcome> out = pg.graph->Run(body);
  if (!out.ok()) {
    // The graph was chosen, and its upload or launch failed: what it queued is not trusted (the
    // caller fails the step; nothing is committed).
    return absl::Status(out.status().code(),
                        absl::StrCat(run.when, ": launching the ", pg.name,
                                     " phase's graph failed: ", out.status().message(),
                                     "; the step was not applied"));
  }
  if (out->mode != kernels::StepGraph::Mode::kEager) {
    const bool captured = out->mode == kernels::StepGraph::Mode::kCaptured;
    run.result.graph_steps.emplace_back(pg.name, captured ? "captured" : "replayed");
    if (captured) {
      DIOND_LOG(INFO) << "session " << id_ << ": " << run.when << ": the " << pg.name
                      << " phase was captured as a graph (" << out->ops << " ops, " << out->records
                      << " scalar records; " << pg.graph->graphs() << " graph(s) held)";
    }
    return absl::OkStatus();
  }
  if (out->reason != "phase_failed") {
    // A lasting reason: this phase runs eagerly from now on.
    DIOND_LOG(INFO) << "session " << id_ << ": the " << pg.name << " phase of its steps runs "
                    << "eagerly, not as a captured graph (reason " << out->reason << ": "
                    << out->detail << ")";
    pg.graph.reset();
    pg.reason = out->reason;
    pg.reported = false;
    run.result.graph_fallbacks.emplace_back(pg.name, pg.reason);
  }
  // Nothing of the phase ran (a recording or a failed capture executes nothing): undo what the
  // passes set up on the host, and run it now.
  if (undo) undo();
  return body();
}

absl::Status Session::StagePhase(StepRun& run, const kernels::Context& ctx) {
  // A local device session also writes the new weights into the staging here, with the norms'
  // read-back (WriteWeightsPhase leaves them): one graph from the rules to the new weights.
  const bool local_device = device_ != nullptr && !world_.has_value();
  auto body = [&]() -> absl::Status {
    DIOND_RETURN_IF_ERROR(StageGroups(run, ctx));
    if (local_device) QueueStagedWeights(run);
    return absl::OkStatus();
  };
  return RunPhaseGraph(run, GraphPhase::kUpdate, body, [&] { DiscardStep(run); });
}

void Session::QueueStagedWeights(StepRun& run) {
  DeviceSide& d = *device_;
  // A local device session: the norms' read-back is queued with the new weights' copies and
  // summed after the step's final wait (WriteWeightsFromDevice), one host wait less per group
  // (docs/GPU.md "Sync points"), into the pinned host words (group after group).
  size_t word = 1;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!run.staged[gi]) continue;
    const size_t n = run.group_params[gi].size();
    assert(word + n <= d.words_bytes / sizeof(float));
    groups_[gi].optimizer->WriteStagedParamsDeferringNorm(run.group_params[gi], d.words + word);
    word += n;
  }
}

namespace {

kernels::ConstTensorView DeviceView(kernels::Device device, DType dtype, const void* p, int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(dtype, {n}), device);
}
kernels::TensorView DeviceView(kernels::Device device, DType dtype, void* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(dtype, {n}), device);
}

absl::Status CopyToDevice(const kernels::Context& ctx, const void* host, void* device,
                          size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesFromHost(ctx, host, device, bytes);
}
absl::Status CopyToHost(const kernels::Context& ctx, const void* device, void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesToHost(ctx, device, host, bytes);
}
// Queued on the context's stream (kernels::CopyFromHostAsync / CopyToHostAsync): `host` stays
// valid and untouched by the host until SyncStream (or a synchronous copy) of the same context.
absl::Status CopyToDeviceAsync(const kernels::Context& ctx, const void* host, void* device,
                               size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesFromHostAsync(ctx, host, device, bytes);
}
absl::Status CopyToHostAsync(const kernels::Context& ctx, const void* device, void* host,
                             size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesToHostAsync(ctx, device, host, bytes);
}
absl::Status SyncStream(const kernels::Context& ctx) { return kernels::Synchronize(ctx); }

}  // namespace

absl::Status Session::InitDeviceSide(const kernels::Context& ctx,
                                     const kernels::DeviceRuntime& runtime) {
  std::unique_ptr<DeviceSide, DeviceSideDeleter> d(new DeviceSide);
  d->device = ctx.device();
  d->runtime = runtime;
  if (runtime.create_stream) {
    DIOND_ASSIGN_OR_RETURN(d->stream, runtime.create_stream(d->device));
  }
  kernels::ContextOptions co;
  co.device = d->device;
  co.num_threads = ctx.num_threads();
  co.stream = d->stream;
  DIOND_ASSIGN_OR_RETURN(d->ctx, kernels::Context::Create(co));
  if (!runtime.rules_on_device) d->host = kernels::Context::CpuDefault(ctx.num_threads());
  int64_t total = 0, largest = 0;
  for (const TensorPlacement& t : layout_.tensors) {
    d->offset.push_back(total);
    total += t.numel;
    largest = std::max(largest, t.numel);
  }
  auto fail = [&](const absl::Status& s) {
    const std::string pool = runtime.last_allocation_error ? runtime.last_allocation_error() : "";
    return absl::Status(
        s.code(), absl::StrCat("the session's device staging (", 8 * total + 4 * largest + 4,
                               " bytes: fp32 parameters and gradients, ", 8 * total,
                               "; one tensor's conversion buffer, ", 4 * largest,
                               "; the non-finite flag, 4) does not fit on the device: ",
                               s.message(), pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
  };
  for (kernels::Buffer* b : {&d->params, &d->grads}) {
    auto buf = d->ctx->Allocate(DType::kF32, {total});
    if (!buf.ok()) return fail(buf.status());
    *b = std::move(*buf);
  }
  auto raw = d->ctx->Allocate(DType::kF32, {largest});
  if (!raw.ok()) return fail(raw.status());
  d->raw = std::move(*raw);
  auto flag = d->ctx->Allocate(DType::kF32, {1});
  if (!flag.ok()) return fail(flag.status());
  d->nonfinite = std::move(*flag);
  // The host words: the flag and one Σ(Δx)² per parameter, whole pages.
  constexpr size_t kPage = 4096;
  d->words_bytes = ((1 + layout_.tensors.size()) * sizeof(float) + kPage - 1) / kPage * kPage;
  d->words = static_cast<float*>(std::aligned_alloc(kPage, d->words_bytes));
  if (d->words == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("the session's host words (", d->words_bytes,
                                                     " bytes) could not be allocated"));
  }
  std::memset(d->words, 0, d->words_bytes);
  if (runtime.host_register) {
    if (absl::Status s = runtime.host_register(d->device, d->words, d->words_bytes); s.ok()) {
      d->words_pinned = true;
    } else {
      DIOND_LOG(WARNING) << "session " << id_ << ": its host words could not be registered for "
                         << "DMA; its step phases run eagerly: " << s.message();
    }
  }
  d->staging_bytes = DeviceStagingBytesFor(layout_);
  device_ = std::move(d);
  memory_ = device_.get();
  return absl::OkStatus();
}

void Session::RegisterForDma(Role role, Binding& b) {
  if (device_ == nullptr || !device_->runtime.host_register || b.region == nullptr) return;
  void* p = b.region->data();
  const size_t bytes = static_cast<size_t>(b.region->size());
  const kernels::Device device = device_->device;
  if (absl::Status s = device_->runtime.host_register(device, p, bytes); !s.ok()) {
    DIOND_LOG(WARNING) << "session " << id_ << ": the " << RoleName(role) << " "
                       << b.region->Describe()
                       << " could not be registered for DMA; its copies go through pageable "
                          "memory: "
                       << s.message();
    return;
  }
  std::function<absl::Status(kernels::Device, void*)> unregister = device_->runtime.host_unregister;
  const std::string id = id_;
  b.dma = std::shared_ptr<void>(p, [unregister, device, id](void* q) {
    if (!unregister) return;
    if (absl::Status s = unregister(device, q); !s.ok()) {
      DIOND_LOG(WARNING) << "session " << id << ": host_unregister failed: " << s.message();
    }
  });
}

std::optional<kernels::Device> Session::DeviceOfSession() const {
  if (device_ == nullptr) return std::nullopt;
  return device_->device;
}

absl::Status Session::CudaParamToHost(size_t i, std::vector<uint8_t>* bytes) {
  const TensorPlacement& t = layout_.tensors[i];
  if (device_ == nullptr || params_.cuda == nullptr) {
    return absl::InternalError("CudaParamToHost without a device session's CUDA region");
  }
  bytes->resize(static_cast<size_t>(t.size_bytes));
  return CopyToHost(*device_->ctx, params_.cuda->data() + t.param_offset, bytes->data(),
                    bytes->size());
}

absl::Status Session::CudaParamFromHost(size_t i, const std::vector<uint8_t>& bytes) {
  const TensorPlacement& t = layout_.tensors[i];
  if (device_ == nullptr || params_.cuda == nullptr ||
      bytes.size() != static_cast<size_t>(t.size_bytes)) {
    return absl::InternalError("CudaParamFromHost without a device session's CUDA region");
  }
  return CopyToDevice(*device_->ctx, bytes.data(), params_.cuda->data() + t.param_offset,
                      bytes.size());
}

// ---- world device sessions: the context, staging, exchange buffers and host copies that the world
// phases use (session_world.cc) ----

const kernels::Context* Session::DeviceContext() const {
  return device_ != nullptr ? device_->ctx.get() : nullptr;
}

float* Session::DeviceGradStaging(size_t i) {
  return device_ != nullptr ? device_->grad(i) : nullptr;
}

// (Master weights: ReadMaster / WriteMaster for host and device sessions alike.)
absl::Status Session::ReadMaster(size_t i, float* out) {
  const int64_t n = layout_.tensors[i].numel;
  if (device_master_) {
    return CopyToHost(*DeviceContext(), DeviceMaster(i), out, static_cast<size_t>(n) * 4);
  }
  std::memcpy(out, master_[i].data(), static_cast<size_t>(n) * 4);
  return absl::OkStatus();
}

absl::Status Session::WriteMaster(size_t i, const float* in) {
  const int64_t n = layout_.tensors[i].numel;
  if (device_master_) {
    return CopyToDevice(*DeviceContext(), in, DeviceMaster(i), static_cast<size_t>(n) * 4);
  }
  std::memcpy(master_[i].data(), in, static_cast<size_t>(n) * 4);
  return absl::OkStatus();
}

float* Session::DeviceMaster(size_t i) {
  return device_->master.As<float>() + device_->master_offset[i];
}

void Session::QueueMasterCommit(size_t i) {
  DeviceSide& d = *device_;
  const int64_t n = layout_.tensors[i].numel;
  // Valid views of the session's own buffers: a failure would be a bug, and is logged.
  absl::Status s = kernels::Copy(
      *d.ctx, DeviceView(d.device, DType::kF32, static_cast<const void*>(d.param(i)), n),
      DeviceView(d.device, DType::kF32, DeviceMaster(i), n));
  if (!s.ok()) {
    DIOND_LOG(ERROR) << "session " << id_
                     << ": queuing the master weights' update failed: " << s.message();
  }
}

absl::Status Session::InitDeviceMaster() {
  DeviceSide& d = *device_;
  int64_t total = 0;
  d.master_offset.assign(layout_.tensors.size(), -1);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (!HasMaster(i)) continue;
    d.master_offset[i] = total;
    total += layout_.tensors[i].numel;
  }
  if (total == 0) return absl::OkStatus();
  auto buf = d.ctx->Allocate(DType::kF32, {total});
  if (!buf.ok()) {
    const std::string pool = DeviceAllocationError();
    return absl::Status(buf.status().code(),
                        absl::StrCat("the session's master weights (", 4 * total,
                                     " bytes) do not fit on the device: ", buf.status().message(),
                                     pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
  }
  d.master = std::move(*buf);
  // The host vectors are not used by a device session.
  for (std::vector<float>& m : master_) std::vector<float>().swap(m);
  device_master_ = true;
  return absl::OkStatus();
}

int64_t Session::DeviceWorldBytes() const {
  if (device_ == nullptr) return 0;
  int64_t bytes = 0;
  for (const kernels::Buffer& b : device_->world) bytes += static_cast<int64_t>(b.bytes());
  return bytes;
}

absl::StatusOr<float*> Session::DeviceWorldBuffer(WorldBuffer which, int64_t n) {
  if (device_ == nullptr) return absl::InternalError("DeviceWorldBuffer on a host session");
  kernels::Buffer& b = device_->world[static_cast<size_t>(which)];
  if (b.empty() || b.NumElements() < n) {
    b.Reset();
    // The pool's error is the compute thread's (thread-local): read it there.
    std::string pool;
    absl::Status made = CallOnCompute(compute_, [&]() -> absl::Status {
      absl::StatusOr<kernels::Buffer> z =
          device_->ctx->Zeros(DType::kF32, {std::max<int64_t>(n, 1)});
      if (!z.ok()) {
        pool = DeviceAllocationError();
        return z.status();
      }
      b = *std::move(z);
      return absl::OkStatus();
    });
    if (!made.ok()) {
      return absl::Status(
          made.code(),
          absl::StrCat("allocating ", n * 4,
                       " bytes on the device for the world "
                       "exchange failed: ",
                       made.message(), pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
    }
  }
  return b.As<float>();
}

absl::Status Session::PrepareEventsLocked(const StepRequest& request) {
  if (request.ready_event.empty() && request.done_event.empty()) return absl::OkStatus();
  constexpr size_t kHandleBytes = 64;  // cudaIpcEventHandle_t
  const std::pair<const char*, const std::string*> events[] = {
      {"ready_event", &request.ready_event}, {"done_event", &request.done_event}};
  for (const auto& [name, handle] : events) {
    if (!handle->empty() && handle->size() != kHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request.step_index, ": ", name,
                                                     " must be the 64 bytes of a "
                                                     "cudaIpcEventHandle_t; got ",
                                                     handle->size(), " bytes"));
    }
  }
  if (device_ == nullptr || device_->stream == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", request.step_index,
                     ": ready_event / done_event order a device session's "
                     "stream, and this session ",
                     device_ == nullptr ? "steps on the host" : "has no stream of its own",
                     "; send them only with CUDA regions on a GPU daemon"));
  }
  DeviceSide& d = *device_;
  DeviceSide::IpcEvent* cached[] = {&d.ready, &d.done};
  for (int k = 0; k < 2; ++k) {
    const std::string& handle = *events[k].second;
    DeviceSide::IpcEvent& e = *cached[k];
    if (handle.empty() || (e.event != nullptr && e.handle == handle)) continue;
    absl::StatusOr<void*> opened =
        kernels::DeviceRuntimeFor(d.device.type)
            .open_ipc_event(d.device,
                            absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(handle.data()),
                                                handle.size()));
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat("step ", request.step_index, ": ", events[k].first,
                                       " cannot be opened on device ", d.device.index, ": ",
                                       opened.status().message(), "; nothing was stepped"));
    }
    if (e.event != nullptr) {
      if (absl::Status s =
              kernels::DeviceRuntimeFor(d.device.type).destroy_event(d.device, e.event);
          !s.ok()) {
        DIOND_LOG(WARNING) << "session " << id_ << ": destroying the previous " << events[k].first
                           << " failed: " << s.message();
      }
    }
    e.event = *opened;
    e.handle = handle;
  }
  return absl::OkStatus();
}

absl::Status Session::WaitReadyEvent(const StepRequest& request) {
  if (device_ == nullptr || request.ready_event.empty()) return absl::OkStatus();
  return kernels::DeviceRuntimeFor(device_->device.type)
      .stream_wait_event(device_->device, device_->stream, device_->ready.event);
}

absl::Status Session::RecordDoneEvent(const StepRequest& request) {
  if (device_ == nullptr || request.done_event.empty()) return absl::OkStatus();
  return kernels::DeviceRuntimeFor(device_->device.type)
      .record_event(device_->device, device_->stream, device_->done.event);
}

absl::Status Session::ReadGradientsToDevice(StepRun& run) {
  DeviceSide& d = *device_;
  d.params_queued = false;
  // The trainer's gradients are ready once its ready_event completes: everything this step
  // runs on the session stream is ordered after it.
  DIOND_RETURN_IF_ERROR(WaitReadyEvent(*run.request));
  DIOND_RETURN_IF_ERROR(RunPhaseGraph(
      run, GraphPhase::kRead, [&] { return QueueStepReads(run); }, nullptr));
  d.params_queued = true;
  // The step's one host wait before the update: the flag is back, after every copy and scan
  // queued before it.
  DIOND_RETURN_IF_ERROR(SyncStream(*d.ctx));
  run.finite = d.words[0] == 0.0f;
  return CheckRegions(run.when, Role::kGradients);
}

absl::Status Session::QueueStepReads(StepRun& run) {
  DeviceSide& d = *device_;
  const kernels::Context& dc = *d.ctx;
  const size_t n = layout_.tensors.size();
  run.grads.assign(n, nullptr);
  // A CUDA GRADIENTS region lies on this device: its f32 gradients are read in place (as a host
  // session reads a shm arena), the others widened / scaled straight from it into the staging,
  // all on the session stream: device to device, no host copy. From host memory: one queued
  // copy per gradient (into the staging, or into the conversion buffer that the widening reads
  // next: the stream orders the next tensor's copy after it). Every scan ORs into one device
  // flag, whose read-back is queued last.
  const memory::CudaRegion* cuda = grads_.cuda.get();
  const kernels::TensorView flag = DeviceView(d.device, DType::kF32, d.nonfinite.data(), 1);
  {
    DIOND_RETURN_IF_ERROR(kernels::Fill(dc, 0.0f, flag));
    for (size_t i = 0; i < n; ++i) {
      // No gradient in this step: never read (a step with another mask is another graph).
      if (run.no_grad[i]) continue;
      const TensorPlacement& t = layout_.tensors[i];
      float* dst = d.grad(i);
      if (cuda != nullptr) {
        const uint8_t* src = cuda->data() + t.grad_offset;
        if (t.dtype == DType::kF32 && !run.scaled) {
          DIOND_RETURN_IF_ERROR(
              kernels::AllFiniteFlag(dc, DeviceView(d.device, DType::kF32, src, t.numel), flag));
          run.grads[i] = reinterpret_cast<const float*>(src);
        } else {
          DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFiniteFlag(
              dc, DeviceView(d.device, t.dtype, static_cast<const void*>(src), t.numel), run.scale,
              DeviceView(d.device, DType::kF32, dst, t.numel), flag));
          run.grads[i] = dst;
        }
        continue;
      }
      const uint8_t* src = grads_.data + t.grad_offset;
      const size_t bytes = static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype);
      if (t.dtype == DType::kF32 && !run.scaled) {
        DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, src, dst, bytes));
        DIOND_RETURN_IF_ERROR(
            kernels::AllFiniteFlag(dc, DeviceView(d.device, DType::kF32, dst, t.numel), flag));
      } else {
        DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, src, d.raw.data(), bytes));
        DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFiniteFlag(
            dc, DeviceView(d.device, t.dtype, static_cast<const void*>(d.raw.data()), t.numel),
            run.scale, DeviceView(d.device, DType::kF32, dst, t.numel), flag));
      }
      run.grads[i] = dst;
    }
  }
  // The parameters' reads are queued behind the gradients' (a skipped step only wrote the
  // staging), so that the one wait that follows completes every host -> device copy of the step.
  DIOND_RETURN_IF_ERROR(DeviceSide::QueueParameterReads(*this, run));
  return CopyToHostAsync(dc, d.nonfinite.data(), d.words, sizeof(float));
}

absl::Status Session::DeviceSide::QueueParameterReads(Session& s, StepRun& run) {
  DeviceSide& d = *s.device_;
  const kernels::Context& dc = *d.ctx;
  const size_t n = s.layout_.tensors.size();
  run.params.assign(n, nullptr);
  run.via_scratch.assign(n, true);  // every parameter comes back from the device staging
  s.param_scratch_.resize(n);
  // A CUDA PARAMETERS region: copied (and widened) device to device into the staging, which
  // the update writes; the region itself is written only by WriteWeightsFromDevice.
  const memory::CudaRegion* cuda = s.params_.cuda.get();
  for (size_t i = 0; i < n; ++i) {
    const TensorPlacement& t = s.layout_.tensors[i];
    float* dst = d.param(i);
    if (s.HasMaster(i) && s.master_valid_) {
      // The master weights, on the device: copied into the staging the update writes (they
      // take its result at the commit).
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc,
          DeviceView(d.device, DType::kF32, static_cast<const void*>(s.DeviceMaster(i)), t.numel),
          DeviceView(d.device, DType::kF32, dst, t.numel)));
      run.params[i] = dst;
      continue;
    }
    if (cuda != nullptr) {
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc,
          DeviceView(d.device, t.dtype, static_cast<const void*>(cuda->data() + t.param_offset),
                     t.numel),
          DeviceView(d.device, DType::kF32, dst, t.numel)));
      run.params[i] = dst;
      continue;
    }
    const uint8_t* arena = s.params_.data + t.param_offset;
    if (t.dtype == DType::kF32) {
      DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, arena, dst, 4 * t.numel));
    } else {
      DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(
          dc, arena, d.raw.data(), static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype)));
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc, DeviceView(d.device, t.dtype, static_cast<const void*>(d.raw.data()), t.numel),
          DeviceView(d.device, DType::kF32, dst, t.numel)));
    }
    run.params[i] = dst;
  }
  return absl::OkStatus();
}

absl::Status Session::ReadParametersToDevice(StepRun& run) {
  DeviceSide& d = *device_;
  if (d.params_queued) {
    // Queued and completed with the gradients' reads (ReadGradientsToDevice).
    d.params_queued = false;
    return absl::OkStatus();
  }
  DIOND_RETURN_IF_ERROR(DeviceSide::QueueParameterReads(*this, run));
  // The host memory was read once the stream got there: wait, so that the regions' check that
  // follows covers these reads.
  return SyncStream(*d.ctx);
}

absl::Status Session::WriteWeightsFromDevice(StepRun& run) {
  DeviceSide& d = *device_;
  DIOND_RETURN_IF_ERROR(RunPhaseGraph(
      run, GraphPhase::kWrite, [&] { return QueueWeightCopies(); }, nullptr));
  // The step's one host wait after the update: the trainer's arena (and the next master
  // weights) hold the new bytes when the answer leaves. Over a CUDA PARAMETERS region too: a
  // trainer without a done_event takes the answer as "the weights are written". The groups'
  // Σ(Δx)² read-backs (queued by QueueStagedWeights) are complete with it.
  DIOND_RETURN_IF_ERROR(SyncStream(*d.ctx));
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (run.staged[gi]) groups_[gi].optimizer->FinishStagedNorm();
  }
  return absl::OkStatus();
}

absl::Status Session::QueueWeightCopies() {
  DeviceSide& d = *device_;
  const kernels::Context& dc = *d.ctx;
  memory::CudaRegion* cuda = params_.cuda.get();
  // Every copy device -> host is queued (narrowed first on the device where the trainer's dtype
  // is not f32: the conversion buffer is reused tensor after tensor in stream order); the
  // caller waits once.
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const TensorPlacement& t = layout_.tensors[i];
    const float* src = d.param(i);
    // (The next master weights stay in the staging: the commit copies them on the device.)
    if (cuda != nullptr) {
      // Device to device into the trainer's GPU memory, narrowed on the way.
      DIOND_RETURN_IF_ERROR(
          kernels::Copy(dc, DeviceView(d.device, DType::kF32, src, t.numel),
                        DeviceView(d.device, t.dtype,
                                   static_cast<void*>(cuda->data() + t.param_offset), t.numel)));
      continue;
    }
    uint8_t* arena = params_.data + t.param_offset;
    if (t.dtype == DType::kF32) {
      DIOND_RETURN_IF_ERROR(CopyToHostAsync(dc, src, arena, 4 * t.numel));
    } else {
      DIOND_RETURN_IF_ERROR(kernels::Copy(dc, DeviceView(d.device, DType::kF32, src, t.numel),
                                          DeviceView(d.device, t.dtype, d.raw.data(), t.numel)));
      DIOND_RETURN_IF_ERROR(CopyToHostAsync(
          dc, d.raw.data(), arena, static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype)));
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::session
