#include "server/rpc/chunk_collector.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bounded.h"

namespace diond::rpc {

ChunkCollector::ChunkCollector(session::SessionManager* manager, session::StreamKind kind,
                               int64_t max_chunk_bytes, int64_t max_stream_bytes, Check check)
    : manager_(manager),
      kind_(kind),
      max_chunk_bytes_(max_chunk_bytes),
      max_stream_bytes_(max_stream_bytes),
      check_(std::move(check)) {}

absl::Status ChunkCollector::Add(v1::TensorChunk* chunk) {
  if (chunks_ == 0) {
    session_ = chunk->session_id();
    if (session_.empty()) {
      return absl::InvalidArgumentError("the first chunk must carry session_id");
    }
    if (absl::Status c = check_(session_); !c.ok()) return c;
    auto s = manager_->Get(session_);
    if (!s.ok()) return s.status();
    target_ = *std::move(s);
    limit_ = target_->StreamBytesLimit(kind_);
  } else if (!chunk->session_id().empty() && chunk->session_id() != session_) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunks_, " names session '", Bounded(chunk->session_id()),
                     "'; a stream writes into the session its first chunk names"));
  }
  const int64_t len = static_cast<int64_t>(chunk->data().size());
  if (len > max_chunk_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of '", Bounded(chunk->name()), "' has ",
                                                   len, " bytes; the limit is ", max_chunk_bytes_));
  }
  if (absl::Status c = target_->CheckStreamChunk(kind_, chunk->name(), chunk->offset_bytes(), len);
      !c.ok()) {
    return c;
  }
  if (bytes_ + len > limit_) {
    return absl::InvalidArgumentError(absl::StrCat("the stream carries more than the ", limit_,
                                                   " bytes of tensors session ", Bounded(session_),
                                                   " can take in it (a tensor is sent twice)"));
  }
  if (max_stream_bytes_ > 0 && bytes_ + len > max_stream_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the stream carries more than --max_stream_bytes=", max_stream_bytes_,
                     " bytes; send the tensors in several streams, or use shared memory"));
  }
  ++chunks_;
  bytes_ += len;
  writes_.push_back({chunk->name(), chunk->offset_bytes(), std::move(*chunk->mutable_data())});
  return absl::OkStatus();
}

}  // namespace diond::rpc
