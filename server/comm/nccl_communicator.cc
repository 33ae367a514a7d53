#include "server/comm/nccl_communicator.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace diond::comm {
namespace {

constexpr size_t kErr = 512;

}  // namespace

NcclCommunicator::NcclCommunicator(const NcclOptions& options, const DiondNcclApiV1* api)
    : Communicator(options.rank, options.size, options.observer), options_(options), api_(api) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock lock(&mu_);
  // The comm first: its abort ends any kernel still using the buffers below.
  if (comm_ != nullptr) api_->comm_destroy(comm_);
  if (scratch_ != nullptr) api_->device_free(options_.device, scratch_);
  if (barrier_ != nullptr) api_->device_free(options_.device, barrier_);
}

void NcclCommunicator::DestroyCommIfAborted() {
  if (comm_ == nullptr || status().ok()) return;
  api_->comm_destroy(comm_);  // ncclCommAbort: queued collectives end
  comm_ = nullptr;
}

void NcclCommunicator::OnAbort() {
  // A call in progress holds the lock: it destroys the comm when it sees the abort.
  if (mu_.TryLock()) {
    DestroyCommIfAborted();
    mu_.Unlock();
  }
}

void NcclCommunicator::BeginQueuedWait() {
  absl::MutexLock lock(&wait_mu_);
  wait_deadlines_.insert(absl::Now() + options_.timeout);
}

void NcclCommunicator::EndQueuedWait() {
  absl::MutexLock lock(&wait_mu_);
  // The earliest: whichever wait ends, every one still open keeps a deadline no later than its
  // own Begin's (an overlapping wait ending first must not unbound an older one).
  if (!wait_deadlines_.empty()) wait_deadlines_.erase(wait_deadlines_.begin());
}

absl::Status NcclCommunicator::Poll() {
  absl::Status error;
  {
    absl::MutexLock lock(&wait_mu_);
    if (!wait_deadlines_.empty() && absl::Now() > *wait_deadlines_.begin() && status().ok()) {
      error = absl::DeadlineExceededError(absl::StrCat(
          "nccl on rank ", rank(), " of ", size(),
          ": the queued collectives did not complete "
          "within ",
          absl::FormatDuration(options_.timeout),
          " (--peer_timeout): a peer is up but has not joined them (its trainer is late?)"));
    }
  }
  if (!error.ok()) {
    Abort(error);  // OnAbort destroys the comm (ncclCommAbort): the waiting kernels end
    return status();
  }
  {
    if (!mu_.TryLock()) return status();  // a call in progress watches NCCL itself
    if (status().ok() && api_->version >= 2 && comm_ != nullptr) {
      char err[kErr] = {0};
      if (api_->async_error(comm_, err, sizeof(err)) != 0) {
        error = absl::UnavailableError(
            absl::StrCat("nccl on rank ", rank(), " of ", size(), ": ", err));
      }
    }
    DestroyCommIfAborted();  // aborted earlier while a call held the lock
    mu_.Unlock();
  }
  if (!error.ok()) Abort(error);  // outside the lock: OnAbort takes it and destroys the comm
  return status();
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const DiondCudaPluginV1* plugin, KeyValueStore* kv, const NcclOptions& options) {
  if (plugin == nullptr || plugin->nccl == nullptr) {
    return absl::FailedPreconditionError("the CUDA plugin has no NCCL communicators");
  }
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " outside world of size ", options.size));
  }
  const DiondNcclApiV1* api = plugin->nccl;
  const std::string key = absl::StrCat(options.prefix, "nccl/unique_id");
  std::string id(DIOND_NCCL_UNIQUE_ID_BYTES, '\0');
  char err[kErr] = {0};
  if (options.rank == 0) {
    if (api->get_unique_id(reinterpret_cast<uint8_t*>(id.data()), err, sizeof(err)) != 0) {
      return absl::UnavailableError(err);
    }
    DIOND_RETURN_IF_ERROR(kv->Set(key, id));
  } else {
    absl::Status s = kv->Wait({key}, options.timeout);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("NCCL unique id: ", s.message()));
    DIOND_ASSIGN_OR_RETURN(id, kv->Get(key));
    if (id.size() != DIOND_NCCL_UNIQUE_ID_BYTES) {
      return absl::InternalError(
          absl::StrCat("NCCL unique id under '", key, "' has ", id.size(), " bytes"));
    }
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(options, api));
  if (api->comm_create(reinterpret_cast<const uint8_t*>(id.data()), options.size, options.rank,
                       options.device, absl::ToInt64Milliseconds(options.timeout), &c->comm_, err,
                       sizeof(err)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("NCCL communicator of rank ", options.rank, " of ", options.size, ": ", err));
  }
  return c;
}

template <typename F>
absl::Status NcclCommunicator::Run(CollectiveOp op, int64_t bytes, const char* form, F&& f) {
  DIOND_RETURN_IF_ERROR(status());
  absl::MutexLock lock(&mu_);
  absl::Status s = status();  // aborted while waiting for the lock
  const absl::Time t0 = absl::Now();
  char err[kErr] = {0};
  if (s.ok() && comm_ == nullptr) s = absl::UnavailableError("the NCCL communicator is gone");
  if (s.ok() && f(err) != 0) {
    s = absl::UnavailableError(absl::StrCat(CollectiveOpName(op), " failed on rank ", rank(),
                                            " of ", size(), " (", form, "): ", err));
    Abort(s);
  }
  DestroyCommIfAborted();
  Record(op, s.ok() ? bytes : 0, absl::ToDoubleSeconds(absl::Now() - t0), s);
  return s;
}

template <typename F>
absl::Status NcclCommunicator::Call(CollectiveOp op, int64_t bytes, F&& f) {
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options_.timeout);
  return Run(op, bytes, "nccl", [&](char* e) { return f(timeout_ms, e); });
}

template <typename F>
absl::Status NcclCommunicator::Queue(CollectiveOp op, int64_t bytes, F&& f) {
  // The timeout bounds the enqueue only; the time recorded is the enqueue's: the collective
  // runs later on the caller's stream.
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options_.timeout);
  return Run(op, bytes, "nccl, queued", [&](char* e) { return f(timeout_ms, e); });
}

// The stream-ordered face of a NcclCommunicator: the same comm, the caller's stream.
class NcclCommunicator::StreamView final : public Communicator {
 public:
  StreamView(NcclCommunicator* parent, void* stream)
      : Communicator(parent->rank(), parent->size(), nullptr), p_(parent), stream_(stream) {}

  MemorySpace memory() const override { return MemorySpace::kDevice; }
  absl::string_view backend() const override { return "nccl"; }
  absl::Status Poll() override { return p_->Poll(); }
  void BeginQueuedWait() override { p_->BeginQueuedWait(); }
  void EndQueuedWait() override { p_->EndQueuedWait(); }

  absl::Status AllReduceSum(absl::Span<float> data) override {
    return AllReduce(data, DIOND_NCCL_SUM);
  }
  absl::Status AllReduceAverage(absl::Span<float> data) override {
    return AllReduce(data, DIOND_NCCL_AVG);
  }
  absl::Status ReduceScatterSum(absl::Span<const float> input, absl::Span<float> output) override {
    if (input.size() != output.size() * size()) {
      return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: input has ", input.size(),
                                                     " elements, expected ", size(), " x ",
                                                     output.size()));
    }
    const int64_t x = static_cast<int64_t>(input.size()) * 4;
    return p_->Queue(
        CollectiveOp::kReduceScatter, RingAllGatherBytes(x, size()), [&](int64_t t, char* e) {
          return p_->api_->reduce_scatter_on(p_->comm_, input.data(), output.data(), output.size(),
                                             DIOND_NCCL_F32, DIOND_NCCL_SUM, t, stream_, e, kErr);
        });
  }
  absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output) override {
    if (output.size() != input.size() * size()) {
      return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.size(),
                                                     " elements, expected ", size(), " x ",
                                                     input.size()));
    }
    return Gather(input.data(), output.data(), input.size(), DIOND_NCCL_F32,
                  static_cast<int64_t>(output.size()) * 4);
  }
  absl::Status AllGatherBytes(absl::Span<const uint8_t> input,
                              absl::Span<uint8_t> output) override {
    if (output.size() != input.size() * size()) {
      return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.size(),
                                                     " bytes, expected ", size(), " x ",
                                                     input.size()));
    }
    return Gather(input.data(), output.data(), input.size(), DIOND_NCCL_U8,
                  static_cast<int64_t>(output.size()));
  }
  absl::Status AllGatherV(absl::Span<const float> input, absl::Span<const int64_t> counts,
                          absl::Span<float> output) override {
    int64_t largest = 0;
    DIOND_RETURN_IF_ERROR(CheckAllGatherV(input, counts, output, &largest));
    // Each rank sends its block to the W - 1 others (one broadcast per rank).
    const int64_t bytes = static_cast<int64_t>(input.size()) * 4 * (size() - 1);
    return p_->Queue(CollectiveOp::kAllGatherV, bytes, [&](int64_t t, char* e) {
      return p_->api_->all_gather_v_on(p_->comm_, input.data(), output.data(), counts.data(),
                                       DIOND_NCCL_F32, t, stream_, e, kErr);
    });
  }
  absl::Status AllToAll(absl::Span<const float> input, absl::Span<float> output) override {
    const int w = size();
    if (input.size() != output.size() || input.size() % w != 0) {
      return absl::InvalidArgumentError(absl::StrCat("all_to_all: input has ", input.size(),
                                                     " elements, output ", output.size(),
                                                     "; both must be equal and divisible by ", w));
    }
    const int64_t x = static_cast<int64_t>(input.size()) * 4;
    return p_->Queue(CollectiveOp::kAllToAll, RingAllGatherBytes(x, w), [&](int64_t t, char* e) {
      return p_->api_->all_to_all_on(p_->comm_, input.data(), output.data(), input.size() / w,
                                     DIOND_NCCL_F32, t, stream_, e, kErr);
    });
  }
  absl::Status Broadcast(absl::Span<float> data, int root) override {
    return BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(data.data()), data.size() * 4),
                          root);
  }
  absl::Status BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    if (root < 0 || root >= size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast: root ", root, " outside [0, ", size(), ")"));
    }
    const int64_t bytes =
        rank() == (root + size() - 1) % size() ? 0 : static_cast<int64_t>(data.size());
    return p_->Queue(CollectiveOp::kBroadcast, size() > 1 ? bytes : 0, [&](int64_t t, char* e) {
      return p_->api_->broadcast_on(p_->comm_, data.data(), data.data(), data.size(), DIOND_NCCL_U8,
                                    root, t, stream_, e, kErr);
    });
  }
  absl::Status Barrier() override {
    // A one-element all-reduce queued on the stream (NCCL's barrier).
    return p_->Queue(CollectiveOp::kBarrier, 0, [&](int64_t t, char* e) -> int {
      p_->mu_.AssertHeld();
      if (p_->barrier_ == nullptr &&
          p_->api_->device_malloc(p_->options_.device, 4, &p_->barrier_, e, kErr) != 0) {
        return -1;
      }
      return p_->api_->all_reduce_on(p_->comm_, p_->barrier_, p_->barrier_, 1, DIOND_NCCL_F32,
                                     DIOND_NCCL_SUM, t, stream_, e, kErr);
    });
  }

 private:
  absl::Status AllReduce(absl::Span<float> data, int op) {
    const int64_t x = static_cast<int64_t>(data.size()) * 4;
    return p_->Queue(
        CollectiveOp::kAllReduce, RingAllReduceBytes(x, size()), [&](int64_t t, char* e) {
          return p_->api_->all_reduce_on(p_->comm_, data.data(), data.data(), data.size(),
                                         DIOND_NCCL_F32, op, t, stream_, e, kErr);
        });
  }
  absl::Status Gather(const void* in, void* out, size_t count, int dtype, int64_t x) {
    return p_->Queue(
        CollectiveOp::kAllGather, RingAllGatherBytes(x, size()), [&](int64_t t, char* e) {
          return p_->api_->all_gather_on(p_->comm_, in, out, count, dtype, t, stream_, e, kErr);
        });
  }

  NcclCommunicator* p_;
  void* stream_;
};

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::OnStream(void* stream) {
  if (api_->version < 2) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA plugin's NCCL table is version ", api_->version,
                     ": no stream-ordered collectives (the plugin predates ABI 2.1)"));
  }
  DIOND_RETURN_IF_ERROR(status());
  return std::unique_ptr<Communicator>(new StreamView(this, stream));
}

absl::StatusOr<void*> NcclCommunicator::Scratch(size_t bytes) {
  if (scratch_bytes_ >= bytes) return scratch_;
  if (scratch_ != nullptr) api_->device_free(options_.device, scratch_);
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  char err[kErr] = {0};
  if (api_->device_malloc(options_.device, bytes, &scratch_, err, sizeof(err)) != 0) {
    return absl::ResourceExhaustedError(err);
  }
  scratch_bytes_ = bytes;
  return scratch_;
}

absl::Status NcclCommunicator::AllReduceSum(absl::Span<float> data) {
  const int64_t x = static_cast<int64_t>(data.size()) * 4;
  return Call(CollectiveOp::kAllReduce, RingAllReduceBytes(x, size()), [&](int64_t t, char* e) {
    return api_->all_reduce(comm_, data.data(), data.data(), data.size(), DIOND_NCCL_F32,
                            DIOND_NCCL_SUM, t, e, kErr);
  });
}

absl::Status NcclCommunicator::AllReduceAverage(absl::Span<float> data) {
  const int64_t x = static_cast<int64_t>(data.size()) * 4;
  return Call(CollectiveOp::kAllReduce, RingAllReduceBytes(x, size()), [&](int64_t t, char* e) {
    return api_->all_reduce(comm_, data.data(), data.data(), data.size(), DIOND_NCCL_F32,
                            DIOND_NCCL_AVG, t, e, kErr);
  });
}

absl::Status NcclCommunicator::ReduceScatterSum(absl::Span<const float> input,
                                                absl::Span<float> output) {
  if (input.size() != output.size() * size()) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: input has ", input.size(),
                                                   " elements, expected ", size(), " x ",
                                                   output.size()));
  }
  const int64_t x = static_cast<int64_t>(input.size()) * 4;
  return Call(CollectiveOp::kReduceScatter, RingAllGatherBytes(x, size()), [&](int64_t t, char* e) {
    return api_->reduce_scatter(comm_, input.data(), output.data(), output.size(), DIOND_NCCL_F32,
                                DIOND_NCCL_SUM, t, e, kErr);
  });
}

absl::Status NcclCommunicator::AllGather(absl::Span<const float> input, absl::Span<float> output) {
  if (output.size() != input.size() * size()) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.size(),
                                                   " elements, expected ", size(), " x ",
                                                   input.size()));
  }
  const int64_t x = static_cast<int64_t>(output.size()) * 4;
  return Call(CollectiveOp::kAllGather, RingAllGatherBytes(x, size()), [&](int64_t t, char* e) {
    return api_->all_gather(comm_, input.data(), output.data(), input.size(), DIOND_NCCL_F32, t, e,
                            kErr);
  });
}

absl::Status NcclCommunicator::AllGatherBytes(absl::Span<const uint8_t> input,
                                              absl::Span<uint8_t> output) {
  if (output.size() != input.size() * size()) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather: output has ", output.size(),
                                                   " bytes, expected ", size(), " x ",
                                                   input.size()));
  }
  const int64_t x = static_cast<int64_t>(output.size());
  return Call(CollectiveOp::kAllGather, RingAllGatherBytes(x, size()), [&](int64_t t, char* e) {
    return api_->all_gather(comm_, input.data(), output.data(), input.size(), DIOND_NCCL_U8, t, e,
                            kErr);
  });
}

absl::Status NcclCommunicator::AllGatherV(absl::Span<const float> input,
                                          absl::Span<const int64_t> counts,
                                          absl::Span<float> output) {
  const int w = size();
  int64_t largest = 0;
  DIOND_RETURN_IF_ERROR(CheckAllGatherV(input, counts, output, &largest));
  const int64_t total = static_cast<int64_t>(output.size());  // the sum of counts (checked)
  // Cold path (index lists, metadata): pad to the largest block in a device scratch buffer
  // [send block | W gathered blocks], gather, and compact through host memory.
  return Call(CollectiveOp::kAllGatherV, (w - 1) * largest * 4, [&](int64_t t, char* e) -> int {
    auto scratch = Scratch(static_cast<size_t>(largest) * (w + 1) * 4);
    if (!scratch.ok()) {
      std::snprintf(e, kErr, "%s", std::string(scratch.status().message()).c_str());
      return -1;
    }
    float* send = static_cast<float*>(*scratch);
    float* all = send + largest;
    std::vector<float> host(static_cast<size_t>(largest) * w);
    std::vector<float> in(static_cast<size_t>(largest), 0.0f);
    if (largest == 0) return 0;
    if (api_->copy_to_host(options_.device, in.data(), input.data(), input.size() * 4, e, kErr)) {
      return -1;
    }
    if (api_->copy_to_device(options_.device, send, in.data(), largest * 4, e, kErr)) return -1;
    if (api_->all_gather(comm_, send, all, largest, DIOND_NCCL_F32, t, e, kErr)) return -1;
    if (api_->copy_to_host(options_.device, host.data(), all, host.size() * 4, e, kErr)) return -1;
    std::vector<float> packed;
    packed.reserve(total);
    for (int j = 0; j < w; ++j) {
      packed.insert(packed.end(), host.begin() + j * largest,
                    host.begin() + j * largest + counts[j]);
    }
    return api_->copy_to_device(options_.device, output.data(), packed.data(), total * 4, e, kErr);
  });
}

absl::Status NcclCommunicator::AllToAll(absl::Span<const float> input, absl::Span<float> output) {
  const int w = size();
  if (input.size() != output.size() || input.size() % w != 0) {
    return absl::InvalidArgumentError(absl::StrCat("all_to_all: input has ", input.size(),
                                                   " elements, output ", output.size(),
                                                   "; both must be equal and divisible by ", w));
  }
  const int64_t x = static_cast<int64_t>(input.size()) * 4;
  return Call(CollectiveOp::kAllToAll, RingAllGatherBytes(x, w), [&](int64_t t, char* e) {
    return api_->all_to_all(comm_, input.data(), output.data(), input.size() / w, DIOND_NCCL_F32, t,
                            e, kErr);
  });
}

absl::Status NcclCommunicator::Broadcast(absl::Span<float> data, int root) {
  return BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(data.data()), data.size() * 4),
                        root);
}

absl::Status NcclCommunicator::BroadcastBytes(absl::Span<uint8_t> data, int root) {
  if (root < 0 || root >= size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " outside [0, ", size(), ")"));
  }
  // NCCL broadcasts along a ring/tree: about x per rank except the last.
  const int64_t bytes =
      rank() == (root + size() - 1) % size() ? 0 : static_cast<int64_t>(data.size());
  return Call(CollectiveOp::kBroadcast, size() > 1 ? bytes : 0, [&](int64_t t, char* e) {
    return api_->broadcast(comm_, data.data(), data.data(), data.size(), DIOND_NCCL_U8, root, t, e,
                           kErr);
  });
}

absl::Status NcclCommunicator::Barrier() {
  // A one-element all-reduce is NCCL's barrier.
  return Call(CollectiveOp::kBarrier, 0, [&](int64_t t, char* e) -> int {
    auto scratch = Scratch(4);
    if (!scratch.ok()) {
      std::snprintf(e, kErr, "%s", std::string(scratch.status().message()).c_str());
      return -1;
    }
    return api_->all_reduce(comm_, *scratch, *scratch, 1, DIOND_NCCL_F32, DIOND_NCCL_SUM, t, e,
                            kErr);
  });
}

}  // namespace diond::comm
