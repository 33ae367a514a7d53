// A device session's passes of the overlapped step (session_overlap.cc; docs/DATA_PLANE.md
// "Overlapped step"), and the doorbell page's events.
//
// The doorbell page stays in host memory: word k says "bucket k of step N is rung". Over CUDA
// regions the trainer also records bucket k's ready event on its stream before it rings, so the
// session stream waits on that event before it queues the bucket's reads; the daemon records
// bucket k's done event after the bucket's new weights, before it rings the weights word. Each
// bucket's reads end with the non-finite flag read back (a host wait), so that a bucket with a
// non-finite value stages nothing, exactly as on the host.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/session_device.h"
#include "server/session/session_overlap.h"

namespace diond::session {

absl::Status Session::Overlap::CheckBucketEvents(const Session& self,
                                                 const std::vector<DoorbellBucket>& buckets) {
  constexpr size_t kHandleBytes = 64;  // cudaIpcEventHandle_t
  auto count = [](const DoorbellBucket& b) {
    return int{!b.ready_event.empty()} + int{!b.done_event.empty()};
  };
  const int first = buckets.empty() ? 0 : count(buckets[0]);
  const bool events = first > 0;
  for (size_t k = 0; k < buckets.size(); ++k) {
    const DoorbellBucket& b = buckets[k];
    if (const int c = count(b); c != first || c == 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DOORBELLS: buckets[", k, "] has ", c, " of its 2 events (ready_event, done_event)",
          k > 0 ? absl::StrCat(" and buckets[0] ", first) : "",
          "; every bucket has both or none does"));
    }
    for (const std::string* h : {&b.ready_event, &b.done_event}) {
      if (events && h->size() != kHandleBytes) {
        return absl::InvalidArgumentError(absl::StrCat("DOORBELLS: buckets[", k,
                                                       "]: an event must be the 64 bytes of a "
                                                       "cudaIpcEventHandle_t; got ",
                                                       h->size(), " bytes"));
      }
    }
  }
  if (events && (self.device_ == nullptr || self.device_->stream == nullptr)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "DOORBELLS: the buckets' events order a device session's stream, and session ", self.id_,
        self.device_ == nullptr ? " steps on the host" : " has no stream of its own",
        "; send them only with CUDA regions on a GPU daemon"));
  }
  return absl::OkStatus();
}

absl::Status Session::Overlap::OpenBucketEvents(Session& self,
                                                const std::vector<DoorbellBucket>& buckets) {
  return self.device_ != nullptr ? self.device_->OpenBucketEvents(self, buckets) : absl::OkStatus();
}

absl::Status Session::DeviceSide::OpenBucketEvents(const Session& s,
                                                   const std::vector<DoorbellBucket>& buckets) {
  const kernels::DeviceRuntime& rt = kernels::DeviceRuntimeFor(device.type);
  std::vector<BucketEvents> opened;
  auto close_opened = [&] {
    for (const BucketEvents& e : opened) {
      for (void* ev : {e.ready, e.done}) {
        if (ev == nullptr) continue;
        if (absl::Status st = rt.destroy_event(device, ev); !st.ok()) {
          DIOND_LOG(WARNING) << "session " << s.id_
                             << ": destroying a bucket's event failed: " << st.message();
        }
      }
    }
  };
  for (size_t k = 0; k < buckets.size() && !buckets[k].ready_event.empty(); ++k) {
    opened.emplace_back();
    const std::pair<const char*, const std::string*> handles[] = {
        {"ready_event", &buckets[k].ready_event}, {"done_event", &buckets[k].done_event}};
    void** into[] = {&opened.back().ready, &opened.back().done};
    for (int j = 0; j < 2; ++j) {
      const std::string& h = *handles[j].second;
      absl::StatusOr<void*> e = rt.open_ipc_event(
          device, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(h.data()), h.size()));
      if (!e.ok()) {
        close_opened();
        return absl::FailedPreconditionError(absl::StrCat(
            "DOORBELLS: buckets[", k, "].", handles[j].first, " cannot be opened on device ",
            device.index, ": ", e.status().message(), "; nothing was registered"));
      }
      *into[j] = *e;
    }
  }
  DestroyBucketEvents();
  bucket_events = std::move(opened);
  return absl::OkStatus();
}

void Session::DeviceSide::DestroyBucketEvents() {
  const kernels::DeviceRuntime& rt = kernels::DeviceRuntimeFor(device.type);
  for (const BucketEvents& e : bucket_events) {
    for (void* ev : {e.ready, e.done}) {
      if (absl::Status st = rt.destroy_event(device, ev); !st.ok()) {
        DIOND_LOG(WARNING) << "destroying a bucket's event failed: " << st.message();
      }
    }
  }
  bucket_events.clear();
}

void Session::DeviceSide::BeginBuckets(Session& s, StepRun& run) {
  run.grads.assign(s.layout_.tensors.size(), nullptr);
  run.finite = true;
  params_queued = false;  // ReadParameters queues and waits for the weights' reads
}

absl::Status Session::DeviceSide::ReadGradientsOf(Session& s, StepRun& run, size_t k,
                                                  const std::vector<size_t>& params) {
  const kernels::Context& dc = *ctx;
  // The doorbell says the trainer recorded the bucket's ready event: what the stream runs from
  // here on is ordered after the trainer's writes of these gradients.
  if (!bucket_events.empty()) {
    DIOND_RETURN_IF_ERROR(kernels::DeviceRuntimeFor(device.type)
                              .stream_wait_event(device, stream, bucket_events[k].ready));
  }
  const kernels::TensorView flag = internal::DeviceView(device, DType::kF32, nonfinite.data(), 1);
  DIOND_RETURN_IF_ERROR(kernels::Fill(dc, 0.0f, flag));
  for (size_t i : params) {
    if (!run.no_grad[i]) DIOND_RETURN_IF_ERROR(QueueGradientRead(s, run, i, flag));
  }
  DIOND_RETURN_IF_ERROR(kernels::CopyBytesToHostAsync(dc, nonfinite.data(), words, sizeof(float)));
  // The bucket's host copies are complete, and its flag back, before anything stages it.
  DIOND_RETURN_IF_ERROR(kernels::Synchronize(dc));
  run.finite = run.finite && words[0] == 0.0f;
  return s.arenas_.CheckRegions(run.when, Role::kGradients);
}

absl::Status Session::DeviceSide::WriteWeightsOf(Session& s, StepRun& run, size_t k,
                                                 const std::vector<size_t>& params) {
  for (size_t i : params) DIOND_RETURN_IF_ERROR(QueueWeightCopy(s, i));
  if (!bucket_events.empty()) {
    DIOND_RETURN_IF_ERROR(
        kernels::DeviceRuntimeFor(device.type).record_event(device, stream, bucket_events[k].done));
  }
  // The bucket's weights are in the trainer's memory before its word is rung.
  return kernels::Synchronize(*ctx);
}

absl::Status Session::DeviceSide::RecordBucketsDone(Session& s) {
  for (const BucketEvents& e : bucket_events) {
    DIOND_RETURN_IF_ERROR(
        kernels::DeviceRuntimeFor(device.type).record_event(device, stream, e.done));
  }
  return absl::OkStatus();
}

}  // namespace diond::session
