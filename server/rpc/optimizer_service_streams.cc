// The streaming RPCs of the Optimizer service: PushGradients and SetState read chunks
// (ChunkReader), PullParameters and GetState write them (ChunkWriter).
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bounded.h"
#include "server/rpc/access.h"
#include "server/rpc/chunk_collector.h"
#include "server/rpc/convert.h"
#include "server/rpc/optimizer_service.h"
#include "server/rpc/status_conversion.h"

namespace diond::rpc {
namespace {

// Collects the chunks of a client stream (ChunkCollector: each is checked before it is buffered),
// then hands them to `apply` once the client has finished. A cancelled (truncated) stream
// applies nothing: OnReadDone(false) means either a half-close or a cancellation, so the
// context is asked which (without the check, a client that cancelled after sending complete
// tensors saw CANCELLED while its writes were applied).
class ChunkReader : public grpc::ServerReadReactor<v1::TensorChunk> {
 public:
  using Apply = std::function<absl::Status(const std::string& session,
                                           std::vector<session::TensorWrite> writes, int64_t bytes,
                                           int64_t chunks)>;
  ChunkReader(grpc::CallbackServerContext* ctx, HandlerPool* pool, session::SessionManager* manager,
              session::StreamKind kind, const OptimizerServiceOptions& options,
              ChunkCollector::Check check, Apply apply)
      : ctx_(ctx),
        pool_(pool),
        collector_(manager, kind, options.max_chunk_bytes, options.max_stream_bytes,
                   std::move(check)),
        apply_(std::move(apply)) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (ctx_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled; nothing applied"));
        return;
      }
      // The client half-closed: the stream is complete. Applying it takes the session's lock,
      // which a step may hold: on the handler pool.
      pool_->Run([this] {
        Finish(ToGrpcStatus(apply_(collector_.session(), collector_.TakeWrites(),
                                   collector_.bytes(), collector_.chunks())));
      });
      return;
    }
    if (absl::Status c = collector_.Add(&chunk_); !c.ok()) {
      Finish(ToGrpcStatus(c));
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  grpc::CallbackServerContext* ctx_;
  HandlerPool* pool_;
  ChunkCollector collector_;
  Apply apply_;
  v1::TensorChunk chunk_;
};

// Writes a sequence of chunks, one at a time (flow-controlled by gRPC). `next` produces the next
// chunk or returns false at the end; an error status ends the stream. With a pool, `next` runs
// there (it reads the session under its lock, which a step may hold); without, inline.
class ChunkWriter : public grpc::ServerWriteReactor<v1::TensorChunk> {
 public:
  using Next = std::function<absl::StatusOr<bool>(v1::TensorChunk* chunk)>;
  ChunkWriter(HandlerPool* pool, Next next) : pool_(pool), next_(std::move(next)) { Schedule(); }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    Schedule();
  }
  void OnDone() override { delete this; }

 private:
  void Schedule() {
    if (pool_ == nullptr) {
      WriteNext();
    } else {
      pool_->Run([this] { WriteNext(); });
    }
  }
  void WriteNext() {
    chunk_.Clear();
    absl::StatusOr<bool> more = next_(&chunk_);
    if (!more.ok()) {
      Finish(ToGrpcStatus(more.status()));
    } else if (!*more) {
      Finish(grpc::Status::OK);
    } else {
      StartWrite(&chunk_);
    }
  }
  HandlerPool* pool_;
  Next next_;
  v1::TensorChunk chunk_;
};

grpc::ServerWriteReactor<v1::TensorChunk>* FailWrite(const absl::Status& s) {
  return new ChunkWriter(nullptr, [s](v1::TensorChunk*) -> absl::StatusOr<bool> { return s; });
}

}  // namespace

grpc::ServerReadReactor<v1::TensorChunk>* OptimizerService::PushGradients(
    grpc::CallbackServerContext* ctx, v1::PushGradientsResponse* resp) {
  session::SessionManager* manager = manager_;
  return new ChunkReader(
      ctx, pool_.get(), manager_, session::StreamKind::kGradients, options_, OwnerCheck(ctx),
      [manager, resp](const std::string& id, const std::vector<session::TensorWrite>& writes,
                      int64_t bytes, int64_t chunks) -> absl::Status {
        auto s = manager->Get(id);
        if (!s.ok()) return s.status();
        absl::Status st = (*s)->ApplyGradientWrites(writes);
        if (!st.ok()) return st;
        resp->set_bytes_received(bytes);
        resp->set_chunks(chunks);
        return absl::OkStatus();
      });
}

grpc::ServerWriteReactor<v1::TensorChunk>* OptimizerService::PullParameters(
    grpc::CallbackServerContext* ctx, const v1::PullParametersRequest* req) {
  auto p = auth_->Authenticate(*ctx);
  if (!p.ok()) return FailWrite(p.status());
  auto s = OwnedSession(manager_, *p, req->session_id());
  if (!s.ok()) return FailWrite(s.status());
  int64_t chunk = req->chunk_bytes() == 0 ? options_.max_chunk_bytes : req->chunk_bytes();
  if (chunk < 0 || chunk > options_.max_chunk_bytes) {
    return FailWrite(absl::InvalidArgumentError(absl::StrCat(
        "chunk_bytes ", req->chunk_bytes(), " must be in 0..", options_.max_chunk_bytes)));
  }
  std::vector<session::TensorPlacement> tensors;
  const auto& all = (*s)->layout().tensors;
  if (req->names().empty()) {
    tensors = all;
  } else {
    for (const std::string& n : req->names()) {
      bool found = false;
      for (const auto& t : all) {
        if (t.name == n) {
          tensors.push_back(t);
          found = true;
        }
      }
      if (!found) {
        return FailWrite(
            absl::InvalidArgumentError(absl::StrCat("unknown parameter '", Bounded(n), "'")));
      }
    }
  }
  // Elements never straddle chunks: round the chunk down to a multiple of 4 bytes.
  chunk = std::max<int64_t>(4, chunk / 4 * 4);
  std::shared_ptr<session::Session> sess = *s;
  size_t index = 0;
  int64_t offset = 0;
  return new ChunkWriter(
      pool_.get(),
      [sess, tensors, chunk, index, offset](v1::TensorChunk* out) mutable -> absl::StatusOr<bool> {
        if (index >= tensors.size()) return false;
        const session::TensorPlacement& t = tensors[index];
        int64_t len = std::min(chunk, t.size_bytes - offset);
        std::string bytes;
        absl::Status st = sess->ReadParameterBytes(t.name, offset, len, &bytes);
        if (!st.ok()) return st;
        out->set_name(t.name);
        out->set_offset_bytes(offset);
        out->set_data(std::move(bytes));
        if (offset == 0) {
          for (int64_t d : t.shape) out->add_shape(d);
          out->set_dtype(DTypeToProto(t.dtype));
          out->set_total_bytes(t.size_bytes);
        }
        offset += len;
        if (offset >= t.size_bytes) {
          ++index;
          offset = 0;
        }
        return true;
      });
}

grpc::ServerWriteReactor<v1::TensorChunk>* OptimizerService::GetState(
    grpc::CallbackServerContext* ctx, const v1::GetStateRequest* req) {
  auto p = auth_->Authenticate(*ctx);
  if (!p.ok()) return FailWrite(p.status());
  auto s = OwnedSession(manager_, *p, req->session_id());
  if (!s.ok()) return FailWrite(s.status());
  std::shared_ptr<session::Session> sess = *s;
  const bool include_parameters = req->include_parameters();
  std::shared_ptr<std::vector<session::NamedTensor>> tensors;  // read at the first chunk
  const int64_t chunk = options_.max_chunk_bytes / 4 * 4;
  size_t index = 0;
  int64_t offset = 0;
  return new ChunkWriter(
      pool_.get(),
      [sess, include_parameters, tensors, chunk, index,
       offset](v1::TensorChunk* out) mutable -> absl::StatusOr<bool> {
        if (tensors == nullptr) {
          auto state = sess->GetState(include_parameters);
          if (!state.ok()) return state.status();
          tensors = std::make_shared<std::vector<session::NamedTensor>>(*std::move(state));
        }
        if (index >= tensors->size()) return false;
        const session::NamedTensor& t = (*tensors)[index];
        const int64_t total = static_cast<int64_t>(t.data.size()) * 4;
        const int64_t len = std::min(chunk, total - offset);
        out->set_name(t.name);
        out->set_offset_bytes(offset);
        out->set_data(reinterpret_cast<const char*>(t.data.data()) + offset,
                      static_cast<size_t>(len));
        if (offset == 0) {
          for (int64_t d : t.shape) out->add_shape(d);
          out->set_dtype(v1::DTYPE_F32);
          out->set_total_bytes(total);
        }
        offset += len;
        if (offset >= total) {
          ++index;
          offset = 0;
        }
        return true;
      });
}

grpc::ServerReadReactor<v1::TensorChunk>* OptimizerService::SetState(
    grpc::CallbackServerContext* ctx, v1::SetStateResponse* resp) {
  session::SessionManager* manager = manager_;
  return new ChunkReader(
      ctx, pool_.get(), manager_, session::StreamKind::kState, options_, OwnerCheck(ctx),
      [manager, resp](const std::string& id, const std::vector<session::TensorWrite>& writes,
                      int64_t, int64_t) -> absl::Status {
        auto s = manager->Get(id);
        if (!s.ok()) return s.status();
        absl::Status st = (*s)->ApplyStateWrites(writes);
        if (!st.ok()) return st;
        std::set<std::string> names;
        for (const auto& w : writes) names.insert(w.name);
        resp->set_tensors(static_cast<int64_t>(names.size()));
        return absl::OkStatus();
      });
}

}  // namespace diond::rpc
