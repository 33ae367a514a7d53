// The chunk checks of the PushGradients and SetState streams, apart from the gRPC reactor
// (optimizer_service.cc's ChunkReader) so that tests/fuzz/session_fuzz.cc runs the same code.
//
// Nothing is buffered that could not be applied, so that a flood of chunks cannot grow the daemon's
// memory before it is refused: the first chunk must name an existing session, every chunk must name
// one of its tensors and lie inside it (Session::CheckStreamChunk), and the bytes buffered are
// bounded by the tensors the session can take in this stream and by --max_stream_bytes. The first
// violation ends the stream.
#ifndef DIOND_SERVER_RPC_CHUNK_COLLECTOR_H_
#define DIOND_SERVER_RPC_CHUNK_COLLECTOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "diond/v1/optimizer.pb.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"

namespace diond::rpc {

class ChunkCollector {
 public:
  // `check` runs on the first chunk's session id (authentication and ownership) before anything
  // is buffered. `max_stream_bytes` 0 = no limit beyond the session's tensors.
  using Check = std::function<absl::Status(const std::string& session)>;
  ChunkCollector(session::SessionManager* manager, session::StreamKind kind,
                 int64_t max_chunk_bytes, int64_t max_stream_bytes, Check check);

  // Checks one chunk and buffers it (its data is moved out). A non-OK status ends the stream:
  // the caller finishes it with that status and applies nothing.
  absl::Status Add(v1::TensorChunk* chunk);

  const std::string& session() const { return session_; }
  std::vector<session::TensorWrite> TakeWrites() { return std::move(writes_); }
  int64_t bytes() const { return bytes_; }
  int64_t chunks() const { return chunks_; }

 private:
  session::SessionManager* manager_;
  session::StreamKind kind_;
  int64_t max_chunk_bytes_;
  int64_t max_stream_bytes_;
  Check check_;
  std::string session_;
  std::shared_ptr<session::Session> target_;
  int64_t limit_ = 0;
  std::vector<session::TensorWrite> writes_;
  int64_t bytes_ = 0;
  int64_t chunks_ = 0;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_CHUNK_COLLECTOR_H_
