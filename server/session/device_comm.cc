// StepDeviceComm (device_comm.h): a device session's collectives on device memory, forwarded to
// the world's device communicator or staged through its host one.
#include "server/session/device_comm.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace diond::session {

StepDeviceComm::StepDeviceComm(const kernels::Context* ctx, ComputeThread* compute,
                               std::shared_ptr<comm::Communicator> host,
                               std::shared_ptr<comm::Communicator> device)
    : comm::Communicator(host->rank(), host->size(), nullptr),
      ctx_(ctx),
      compute_(compute),
      host_(std::move(host)),
      device_(std::move(device)) {
  if (device_ != nullptr && ctx_->stream() != nullptr) {
    // Queued on the session's stream when the device communicator can (NCCL, plugin ABI 2.1):
    // no wait for the stream before each collective.
    absl::StatusOr<std::unique_ptr<comm::Communicator>> q = device_->OnStream(ctx_->stream());
    if (q.ok()) queued_ = std::move(*q);
  }
  backend_name_ = device_ == nullptr   ? absl::StrCat(host_->backend(), "+staged")
                  : queued_ != nullptr ? absl::StrCat(device_->backend(), "+stream")
                                       : std::string(device_->backend());
}

comm::Communicator* StepDeviceComm::Direct() const {
  return queued_ != nullptr ? queued_.get() : device_.get();
}

absl::Status StepDeviceComm::BeforeDirect() {
  // Queued: the session's stream orders the collective after the work that produced its input.
  // Forwarded: the communicator runs on its own stream, so the session's must be done first.
  return queued_ != nullptr ? absl::OkStatus() : SyncSession();
}

absl::Status StepDeviceComm::DeviceStatus() {
  return device_ != nullptr ? device_->Poll() : absl::OkStatus();
}

absl::Status StepDeviceComm::ReadBackQueued(const std::function<absl::Status()>& f) {
  if (device_ == nullptr) return CallOnCompute(compute_, [&] { return f(); });
  return CallOnCompute(compute_, [&] {
    device_->BeginQueuedWait();
    absl::Status s = f();
    device_->EndQueuedWait();
    return s;
  });
}

absl::Status StepDeviceComm::WaitQueued() {
  if (queued_ == nullptr) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(ReadBackQueued([&] { return kernels::Synchronize(*ctx_); }));
  return DeviceStatus();
}

absl::Status StepDeviceComm::ReplicaAverage(absl::Span<float> data) {
  DIOND_RETURN_IF_ERROR(AllReduceAverage(data));
  return WaitQueued();
}

absl::Status StepDeviceComm::SyncSession() {
  return CallOnCompute(compute_, [&] { return kernels::Synchronize(*ctx_); });
}

absl::Status StepDeviceComm::ToHost(const void* device, void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CallOnCompute(compute_,
                       [&] { return kernels::CopyBytesToHost(*ctx_, device, host, bytes); });
}

absl::Status StepDeviceComm::ToDevice(const void* host, void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CallOnCompute(compute_,
                       [&] { return kernels::CopyBytesFromHost(*ctx_, host, device, bytes); });
}

template <typename F>
absl::Status StepDeviceComm::Staged(const void* in, size_t in_bytes, void* out, size_t out_bytes,
                                    F&& f) {
  // In place (in == out): one host buffer, the collective's result is read back from it.
  const bool in_place = in == out;
  if (in_.size() < in_bytes) in_.resize(in_bytes);
  if (!in_place && out_.size() < out_bytes) out_.resize(out_bytes);
  DIOND_RETURN_IF_ERROR(ToHost(in, in_.data(), in_bytes));
  DIOND_RETURN_IF_ERROR(f(in_.data(), in_place ? in_.data() : out_.data()));
  return ToDevice(in_place ? in_.data() : out_.data(), out, out_bytes);
}

namespace {
absl::Span<float> F(void* p, size_t n) { return absl::MakeSpan(static_cast<float*>(p), n); }
absl::Span<const float> CF(const void* p, size_t n) {
  return absl::MakeConstSpan(static_cast<const float*>(p), n);
}
}  // namespace

absl::Status StepDeviceComm::AllReduceSum(absl::Span<float> data) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllReduceSum(data);
  }
  const size_t b = data.size() * 4;
  return Staged(data.data(), b, data.data(), b,
                [&](void* in, void*) { return host_->AllReduceSum(F(in, data.size())); });
}

absl::Status StepDeviceComm::AllReduceAverage(absl::Span<float> data) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllReduceAverage(data);
  }
  const size_t b = data.size() * 4;
  return Staged(data.data(), b, data.data(), b,
                [&](void* in, void*) { return host_->AllReduceAverage(F(in, data.size())); });
}

absl::Status StepDeviceComm::ReduceScatterSum(absl::Span<const float> input,
                                              absl::Span<float> output) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->ReduceScatterSum(input, output);
  }
  return Staged(input.data(), input.size() * 4, output.data(), output.size() * 4,
                [&](void* in, void* out) {
                  return host_->ReduceScatterSum(CF(in, input.size()), F(out, output.size()));
                });
}

absl::Status StepDeviceComm::AllGather(absl::Span<const float> input, absl::Span<float> output) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllGather(input, output);
  }
  return Staged(input.data(), input.size() * 4, output.data(), output.size() * 4,
                [&](void* in, void* out) {
                  return host_->AllGather(CF(in, input.size()), F(out, output.size()));
                });
}

absl::Status StepDeviceComm::AllGatherV(absl::Span<const float> input,
                                        absl::Span<const int64_t> counts,
                                        absl::Span<float> output) {
  int64_t largest = 0;
  DIOND_RETURN_IF_ERROR(CheckAllGatherV(input, counts, output, &largest));
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllGatherV(input, counts, output);
  }
  return Staged(input.data(), input.size() * 4, output.data(), output.size() * 4,
                [&](void* in, void* out) {
                  return host_->AllGatherV(CF(in, input.size()), counts, F(out, output.size()));
                });
}

absl::Status StepDeviceComm::AllToAll(absl::Span<const float> input, absl::Span<float> output) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllToAll(input, output);
  }
  return Staged(input.data(), input.size() * 4, output.data(), output.size() * 4,
                [&](void* in, void* out) {
                  return host_->AllToAll(CF(in, input.size()), F(out, output.size()));
                });
}

absl::Status StepDeviceComm::Broadcast(absl::Span<float> data, int root) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->Broadcast(data, root);
  }
  if (root < 0 || root >= size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " is not a rank of a world of ", size()));
  }
  // Only the root's bytes go down; every rank but the root takes the result up.
  const size_t b = data.size() * 4;
  if (in_.size() < b) in_.resize(b);
  if (rank() == root) DIOND_RETURN_IF_ERROR(ToHost(data.data(), in_.data(), b));
  DIOND_RETURN_IF_ERROR(host_->Broadcast(F(in_.data(), data.size()), root));
  if (rank() != root) return ToDevice(in_.data(), data.data(), b);
  return absl::OkStatus();
}

absl::Status StepDeviceComm::Barrier() {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->Barrier();
  }
  return host_->Barrier();
}

absl::Status StepDeviceComm::AllGatherBytes(absl::Span<const uint8_t> input,
                                            absl::Span<uint8_t> output) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->AllGatherBytes(input, output);
  }
  return Staged(input.data(), input.size(), output.data(), output.size(), [&](void* in, void* out) {
    return host_->AllGatherBytes(absl::MakeConstSpan(static_cast<const uint8_t*>(in), input.size()),
                                 absl::MakeSpan(static_cast<uint8_t*>(out), output.size()));
  });
}

absl::Status StepDeviceComm::BroadcastBytes(absl::Span<uint8_t> data, int root) {
  if (comm::Communicator* d = Direct()) {
    DIOND_RETURN_IF_ERROR(BeforeDirect());
    return d->BroadcastBytes(data, root);
  }
  const size_t b = data.size();
  return Staged(data.data(), b, data.data(), b, [&](void* in, void*) {
    return host_->BroadcastBytes(absl::MakeSpan(static_cast<uint8_t*>(in), b), root);
  });
}

}  // namespace diond::session
