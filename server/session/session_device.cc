// A device session's making and its numbers, the trainer's events, DMA registration and the
// world phases' device buffers (session_device.h). The step's passes are in
// session_device_step.cc, the graphs in session_graph.cc.
#include "server/session/session_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace diond::session {

void Session::DeviceSide::DestroyEvents() {
  DestroyBucketEvents();
  for (IpcEvent* e : {&ready, &done}) {
    if (e->event == nullptr) continue;
    if (absl::Status s = kernels::DeviceRuntimeFor(device.type).destroy_event(device, e->event);
        !s.ok()) {
      DIOND_LOG(WARNING) << "destroying a trainer's event failed: " << s.message();
    }
    *e = {};
  }
}

void Session::DeviceSideDeleter::operator()(DeviceSide* d) const {
  if (d == nullptr) return;
  for (auto& p : d->phases) p.graph.reset();  // graphs and scalar blocks, before the stream
  d->grads.Reset();
  d->params.Reset();
  d->raw.Reset();
  d->nonfinite.Reset();
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
  // The master weights are in the device pool, with the staging; the state too when the rules
  // run on the device.
  return DeviceBytes() + (device_->runtime.rules_on_device ? 0 : StateBytes() - master_bytes_);
}

int64_t Session::DeviceWorldBytes() const {
  if (device_ == nullptr) return 0;
  int64_t bytes = 0;
  for (const kernels::Buffer& b : device_->world) bytes += static_cast<int64_t>(b.bytes());
  return bytes;
}

std::string Session::DeviceSide::AllocationError() const {
  return runtime.last_allocation_error ? runtime.last_allocation_error() : "";
}

std::string Session::DeviceAllocationError() const {
  return device_ != nullptr ? device_->AllocationError() : "";
}

absl::StatusOr<std::unique_ptr<Session::DeviceSide, Session::DeviceSideDeleter>>
Session::DeviceSide::Make(const Session& s, const kernels::Context& ctx,
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
  for (const TensorPlacement& t : s.layout_.tensors) {
    d->offset.push_back(total);
    total += t.numel;
    largest = std::max(largest, t.numel);
  }
  const int64_t words = 4 * (1 + static_cast<int64_t>(s.layout_.tensors.size()));
  auto fail = [&](const absl::Status& st) {
    const std::string pool = d->AllocationError();
    return absl::Status(
        st.code(), absl::StrCat("the session's device staging (", 8 * total + 4 * largest + words,
                                " bytes: fp32 parameters and gradients, ", 8 * total,
                                "; one tensor's conversion buffer, ", 4 * largest,
                                "; the non-finite flag and the clip's norms, ", words,
                                ") does not fit on the device: ", st.message(),
                                pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
  };
  for (kernels::Buffer* b : {&d->params, &d->grads}) {
    auto buf = d->ctx->Allocate(DType::kF32, {total});
    if (!buf.ok()) return fail(buf.status());
    *b = std::move(*buf);
  }
  auto raw = d->ctx->Allocate(DType::kF32, {largest});
  if (!raw.ok()) return fail(raw.status());
  d->raw = std::move(*raw);
  // The non-finite flag, then one norm per parameter for the clip (grad_clip.h).
  auto flag = d->ctx->Allocate(DType::kF32, {1 + static_cast<int64_t>(s.layout_.tensors.size())});
  if (!flag.ok()) return fail(flag.status());
  d->nonfinite = std::move(*flag);
  // The host words: the flag and one Σ(Δx)² per parameter, whole pages.
  constexpr size_t kPage = 4096;
  d->words_bytes = ((1 + s.layout_.tensors.size()) * sizeof(float) + kPage - 1) / kPage * kPage;
  d->words = static_cast<float*>(std::aligned_alloc(kPage, d->words_bytes));
  if (d->words == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("the session's host words (", d->words_bytes,
                                                     " bytes) could not be allocated"));
  }
  std::memset(d->words, 0, d->words_bytes);
  if (runtime.host_register) {
    if (absl::Status st = runtime.host_register(d->device, d->words, d->words_bytes); st.ok()) {
      d->words_pinned = true;
    } else {
      DIOND_LOG(WARNING) << "session " << s.id_ << ": its host words could not be registered for "
                         << "DMA; its step phases run eagerly: " << st.message();
    }
  }
  d->staging_bytes = DeviceStagingBytesFor(s.layout_);
  return d;
}

void Session::DeviceSide::RegisterForDma(const Session& s, Role role, Arenas::Binding& b) {
  if (!runtime.host_register || b.region == nullptr) return;
  void* p = b.region->data();
  const size_t bytes = static_cast<size_t>(b.region->size());
  const kernels::Device dev = device;
  if (absl::Status st = runtime.host_register(dev, p, bytes); !st.ok()) {
    DIOND_LOG(WARNING) << "session " << s.id_ << ": the " << RoleName(role) << " "
                       << b.region->Describe()
                       << " could not be registered for DMA; its copies go through pageable "
                          "memory: "
                       << st.message();
    return;
  }
  std::function<absl::Status(kernels::Device, void*)> unregister = runtime.host_unregister;
  const std::string id = s.id_;
  b.dma = std::shared_ptr<void>(p, [unregister, dev, id](void* q) {
    if (!unregister) return;
    if (absl::Status st = unregister(dev, q); !st.ok()) {
      DIOND_LOG(WARNING) << "session " << id << ": host_unregister failed: " << st.message();
    }
  });
}

absl::StatusOr<float*> Session::DeviceSide::WorldBufferOf(const Session& s, WorldBuffer which,
                                                          int64_t n) {
  kernels::Buffer& b = world[static_cast<size_t>(which)];
  if (b.empty() || b.NumElements() < n) {
    b.Reset();
    // The pool's error is the compute thread's (thread-local): read it there.
    std::string pool;
    absl::Status made = CallOnCompute(s.compute_, [&]() -> absl::Status {
      absl::StatusOr<kernels::Buffer> z = ctx->Zeros(DType::kF32, {std::max<int64_t>(n, 1)});
      if (!z.ok()) {
        pool = AllocationError();
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

absl::Status Session::DeviceSide::PrepareEvents(Session& s, const StepRequest& request) {
  if (request.ready_event.empty() && request.done_event.empty()) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(internal::CheckEventHandles(request));
  if (stream == nullptr) return internal::RefuseEvents(request, "has no stream of its own");
  const std::pair<const char*, const std::string*> events[] = {
      {"ready_event", &request.ready_event}, {"done_event", &request.done_event}};
  IpcEvent* cached[] = {&ready, &done};
  for (int k = 0; k < 2; ++k) {
    const std::string& handle = *events[k].second;
    IpcEvent& e = *cached[k];
    if (handle.empty() || (e.event != nullptr && e.handle == handle)) continue;
    absl::StatusOr<void*> opened =
        kernels::DeviceRuntimeFor(device.type)
            .open_ipc_event(device,
                            absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(handle.data()),
                                                handle.size()));
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat("step ", request.step_index, ": ", events[k].first,
                                       " cannot be opened on device ", device.index, ": ",
                                       opened.status().message(), "; nothing was stepped"));
    }
    if (e.event != nullptr) {
      if (absl::Status st = kernels::DeviceRuntimeFor(device.type).destroy_event(device, e.event);
          !st.ok()) {
        DIOND_LOG(WARNING) << "session " << s.id_ << ": destroying the previous " << events[k].first
                           << " failed: " << st.message();
      }
    }
    e.event = *opened;
    e.handle = handle;
  }
  return absl::OkStatus();
}

absl::Status Session::DeviceSide::RecordDoneEvent(Session& s, const StepRequest& request) {
  if (request.done_event.empty()) return absl::OkStatus();
  return kernels::DeviceRuntimeFor(device.type).record_event(device, stream, done.event);
}

}  // namespace diond::session
