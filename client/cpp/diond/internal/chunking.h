// Internal to the C++ client: splitting named tensors into diond.v1.TensorChunk messages of at
// most kMaxChunkBytes, and reassembling a stream of chunks into tensors. Kept apart from the
// gRPC calls so both directions are unit-tested without a daemon. Not installed.
//
// Thread-safety: ChunkTensors is pure; a Reassembler is used by one thread at a time.
#ifndef DIOND_CLIENT_CPP_DIOND_INTERNAL_CHUNKING_H_
#define DIOND_CLIENT_CPP_DIOND_INTERNAL_CHUNKING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "diond/types.h"
#include "diond/v1/optimizer.pb.h"

namespace diond::client::internal {

// The proto's limit on one chunk's data (TensorChunk: "At most 4 MiB").
inline constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;

// Calls `write` once per chunk, tensor after tensor, each tensor's chunks in increasing offset
// order, every chunk's data at most `chunk_bytes`. The first chunk of the stream carries
// `session_id`; the first chunk of each tensor (offset 0) carries total_bytes and, when known,
// the dtype. A tensor of zero bytes is sent as one empty chunk. If `write` returns false (the
// stream broke) it stops and returns UNAVAILABLE. INVALID_ARGUMENT if chunk_bytes is not in
// [1, kMaxChunkBytes], a name is empty or repeated; nothing is written then.
absl::Status ChunkTensors(const std::string& session_id, const std::vector<ConstTensorRef>& tensors,
                          int64_t chunk_bytes,
                          const std::function<bool(const v1::TensorChunk&)>& write);

// Reassembles chunks. Two modes:
//  - into caller buffers: only the named tensors are accepted, each must arrive complete, and
//    the daemon's total_bytes must equal the buffer's size;
//  - into a TensorMap: every tensor is accepted and allocated from its first chunk.
// A chunk with offset 0 must come before the others of its tensor (it carries total_bytes).
// Chunks may arrive in any order after it but must not overlap or pass the end.
// Add() returns INVALID_ARGUMENT (unknown name, size mismatch, overlap, out of bounds) or
// leaves the state unchanged on error; Finish() returns DATA_LOSS naming the first incomplete
// or missing tensor.
class Reassembler {
 public:
  explicit Reassembler(std::vector<MutableTensorRef> destinations);
  Reassembler();  // map mode

  absl::Status Add(const v1::TensorChunk& chunk);
  absl::Status Finish();

  // Map mode: the tensors received; valid after Finish() returned OK.
  TensorMap TakeTensors() { return std::move(tensors_); }
  int64_t chunks() const { return chunks_; }

 private:
  struct Progress {
    int64_t total_bytes = -1;           // -1 until the offset-0 chunk arrived
    std::map<int64_t, int64_t> ranges;  // received [offset, end) ranges by offset
    int64_t received = 0;
    uint8_t* data = nullptr;
  };

  bool map_mode_;
  std::map<std::string, MutableTensorRef> destinations_;
  std::map<std::string, Progress> progress_;
  TensorMap tensors_;
  int64_t chunks_ = 0;
};

}  // namespace diond::client::internal

#endif  // DIOND_CLIENT_CPP_DIOND_INTERNAL_CHUNKING_H_
