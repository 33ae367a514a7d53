#include "server/comm/communicator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace diond::comm {

absl::string_view CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kAllGatherV:
      return "all_gather_v";
    case CollectiveOp::kAllToAll:
      return "all_to_all";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "unknown";
}

void Communicator::Abort(const absl::Status& why) {
  {
    absl::MutexLock lock(&abort_mu_);
    if (!aborted_.ok()) return;
    aborted_ = why.ok() ? absl::UnavailableError("communicator aborted") : why;
  }
  OnAbort();
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::OnStream(void*) {
  return absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator cannot queue on a device stream"));
}

absl::Status Communicator::status() const {
  absl::MutexLock lock(&abort_mu_);
  return aborted_;
}

void Communicator::Record(CollectiveOp op, int64_t bytes, double seconds,
                          const absl::Status& result) {
  bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
  if (observer_) observer_(op, bytes, seconds, result);
}

int64_t RingAllReduceBytes(int64_t x, int w) { return w <= 1 ? 0 : int64_t{2} * (w - 1) * x / w; }
int64_t RingAllGatherBytes(int64_t x, int w) { return w <= 1 ? 0 : (w - 1) * x / w; }

absl::Status Communicator::CheckAllGatherV(absl::Span<const float> input,
                                           absl::Span<const int64_t> counts,
                                           absl::Span<float> output, int64_t* largest) const {
  if (static_cast<int>(counts.size()) != size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather_v: ", counts.size(), " counts for ", size(), " ranks"));
  }
  int64_t total = 0;
  *largest = 0;
  for (int64_t c : counts) {
    if (c < 0) return absl::InvalidArgumentError("all_gather_v: negative count");
    total += c;
    *largest = std::max(*largest, c);
  }
  if (static_cast<int64_t>(input.size()) != counts[rank()] ||
      static_cast<int64_t>(output.size()) != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all_gather_v: input has ", input.size(), " elements (counts[", rank(),
        "] = ", counts[rank()], "), output ", output.size(), " (sum of counts = ", total, ")"));
  }
  return absl::OkStatus();
}

}  // namespace diond::comm
