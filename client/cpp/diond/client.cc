#include "diond/client.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "diond/internal/chunking.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace diond::client {
namespace {

using internal::kMaxChunkBytes;

// Adds "authorization: Bearer <token>" to every call of a channel (call credentials would need a
// secure channel; loopback TCP without TLS is a supported setup).
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->insert({"authorization", *value_});
    }
    m->Proceed();
  }

 private:
  const std::string* value_;
};

class BearerFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(&value_);
  }

 private:
  std::string value_;
};

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
}

// Runs a unary stub method with the given deadline, mapping the status.
template <typename Req, typename Resp, typename Method>
absl::StatusOr<Resp> Unary(v1::Optimizer::Stub* stub, Method method, const Req& req,
                           absl::Duration deadline) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  Resp resp;
  grpc::Status s = (stub->*method)(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

// Reads a server stream of chunks into `r`. On a chunk the Reassembler rejects, the call is
// cancelled and that error returned (the daemon's status is then CANCELLED, not interesting).
template <typename Reader>
absl::Status ReadChunks(grpc::ClientContext* ctx, Reader* reader, internal::Reassembler* r) {
  v1::TensorChunk chunk;
  absl::Status local;
  while (reader->Read(&chunk)) {
    if (!local.ok()) continue;  // drain after cancelling
    local = r->Add(chunk);
    if (!local.ok()) ctx->TryCancel();
  }
  grpc::Status s = reader->Finish();
  if (!local.ok()) return local;
  if (!s.ok()) return FromGrpcStatus(s);
  return r->Finish();
}

// Sends `tensors` as one client stream and returns the final response.
template <typename Resp, typename Method>
absl::StatusOr<Resp> WriteChunks(v1::Optimizer::Stub* stub, Method method,
                                 const std::string& session_id,
                                 const std::vector<ConstTensorRef>& tensors,
                                 const ClientOptions& options) {
  // Validate before opening the stream, so a bad argument sends nothing.
  absl::Status valid = internal::ChunkTensors(session_id, tensors, options.chunk_bytes,
                                              [](const v1::TensorChunk&) { return true; });
  if (!valid.ok()) return valid;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options.stream_deadline);
  Resp resp;
  auto writer = (stub->*method)(&ctx, &resp);
  absl::Status sent =
      internal::ChunkTensors(session_id, tensors, options.chunk_bytes,
                             [&writer](const v1::TensorChunk& c) { return writer->Write(c); });
  // The arguments were valid, so a failed write means the daemon ended the call early; its
  // status (from Finish) says why.
  if (sent.ok()) writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  if (!sent.ok()) return sent;
  return resp;
}

std::vector<SessionInfo> FromProto(const v1::ListSessionsResponse& resp) {
  std::vector<SessionInfo> out;
  for (const v1::SessionInfo& s : resp.sessions()) {
    out.push_back({s.session_id(), s.client_name(), s.session_name(), s.parameters(),
                   s.last_step_index(), s.state_bytes(), s.owner()});
  }
  return out;
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : channel_(std::move(channel)), stub_(v1::Optimizer::NewStub(channel_)), options_(options) {}

absl::StatusOr<std::unique_ptr<Client>> Client::FromChannel(std::shared_ptr<grpc::Channel> channel,
                                                            const ClientOptions& options) {
  if (channel == nullptr) return absl::InvalidArgumentError("null channel");
  if (options.chunk_bytes < 1 || options.chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.chunk_bytes ", options.chunk_bytes, " not in [1, ", kMaxChunkBytes, "]"));
  }
  if (options.deadline <= absl::ZeroDuration() || options.stream_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ClientOptions deadlines must be positive");
  }
  return std::unique_ptr<Client>(new Client(std::move(channel), options));
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ClientOptions& options) {
  if (target.empty() || target == "unix:") {
    return absl::InvalidArgumentError(
        absl::StrCat("bad daemon target '", target, "': want unix:/path or host:port"));
  }
  grpc::ChannelArguments args;
  // Parameters and state can be large; the daemon's chunks are at most 4 MiB plus framing.
  args.SetMaxReceiveMessageSize(16 << 20);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (options.tls.enabled) {
    if (options.tls.cert_pem.empty() != options.tls.key_pem.empty()) {
      return absl::InvalidArgumentError("TlsOptions.cert_pem and key_pem go together");
    }
    grpc::SslCredentialsOptions so;
    so.pem_root_certs = options.tls.ca_pem;
    so.pem_cert_chain = options.tls.cert_pem;
    so.pem_private_key = options.tls.key_pem;
    creds = grpc::SslCredentials(so);
    if (!options.tls.server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls.server_name);
    }
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> icpt;
  if (!options.token.empty() && !absl::StartsWith(target, "unix")) {
    icpt.push_back(std::make_unique<BearerFactory>("Bearer " + options.token));
  }
  auto channel =
      grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(icpt));
  if (options.connect_timeout > absl::ZeroDuration() &&
      !channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to diond at '", target, "' within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return FromChannel(std::move(channel), options);
}

absl::StatusOr<ServingStatus> Client::Health(const std::string& service) const {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.deadline);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  switch (resp.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return ServingStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return ServingStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

// ---- sessions -----------------------------------------------------------------------------------

absl::StatusOr<v1::CreateSessionResponse> Client::CreateSession(
    const v1::CreateSessionRequest& request) const {
  return Unary<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      stub_.get(), &v1::Optimizer::Stub::CreateSession, request, options_.deadline);
}

absl::StatusOr<Layout> Client::CreateSession(const std::vector<ParamSpec>& params,
                                             const std::vector<GroupSpec>& groups,
                                             const SessionOptions& options) const {
  auto resp = CreateSession(ToProto(params, groups, options));
  if (!resp.ok()) return resp.status();
  return LayoutFromProto(*resp);
}

absl::StatusOr<v1::CloseSessionResponse> Client::CloseSession(
    const v1::CloseSessionRequest& request) const {
  return Unary<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      stub_.get(), &v1::Optimizer::Stub::CloseSession, request, options_.deadline);
}

absl::Status Client::CloseSession(const std::string& session_id) const {
  v1::CloseSessionRequest req;
  req.set_session_id(session_id);
  return CloseSession(req).status();
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions(
    const v1::ListSessionsRequest& request) const {
  return Unary<v1::ListSessionsRequest, v1::ListSessionsResponse>(
      stub_.get(), &v1::Optimizer::Stub::ListSessions, request, options_.deadline);
}

absl::StatusOr<std::vector<SessionInfo>> Client::ListSessions() const {
  auto resp = ListSessions(v1::ListSessionsRequest());
  if (!resp.ok()) return resp.status();
  return FromProto(*resp);
}

absl::StatusOr<v1::DescribeOptionsResponse> Client::DescribeOptions() const {
  return Unary<v1::DescribeOptionsRequest, v1::DescribeOptionsResponse>(
      stub_.get(), &v1::Optimizer::Stub::DescribeOptions, v1::DescribeOptionsRequest(),
      options_.deadline);
}

// ---- regions ------------------------------------------------------------------------------------

absl::StatusOr<v1::RegisterRegionResponse> Client::RegisterRegion(
    const v1::RegisterRegionRequest& request) const {
  return Unary<v1::RegisterRegionRequest, v1::RegisterRegionResponse>(
      stub_.get(), &v1::Optimizer::Stub::RegisterRegion, request, options_.deadline);
}

absl::StatusOr<std::string> Client::RegisterMemfdRegion(const std::string& session_id,
                                                        v1::RegionRole role,
                                                        const std::string& fd_token,
                                                        int64_t offset_bytes,
                                                        int64_t size_bytes) const {
  v1::RegisterRegionRequest req;
  req.set_session_id(session_id);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_MEMFD);
  v1::MemfdRegion* m = req.mutable_memfd();
  m->set_fd_token(fd_token);
  m->set_offset_bytes(offset_bytes);
  m->set_size_bytes(size_bytes);
  auto resp = RegisterRegion(req);
  if (!resp.ok()) return resp.status();
  return resp->region_id();
}

absl::StatusOr<std::string> Client::RegisterShmRegion(const std::string& session_id,
                                                      v1::RegionRole role,
                                                      const std::string& shm_name,
                                                      int64_t offset_bytes,
                                                      int64_t size_bytes) const {
  v1::RegisterRegionRequest req;
  req.set_session_id(session_id);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_SYSTEM_SHM);
  v1::SystemShmRegion* shm = req.mutable_system_shm();
  shm->set_name(shm_name);
  shm->set_offset_bytes(offset_bytes);
  shm->set_size_bytes(size_bytes);
  auto resp = RegisterRegion(req);
  if (!resp.ok()) return resp.status();
  return resp->region_id();
}

absl::StatusOr<v1::UnregisterRegionResponse> Client::UnregisterRegion(
    const v1::UnregisterRegionRequest& request) const {
  return Unary<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      stub_.get(), &v1::Optimizer::Stub::UnregisterRegion, request, options_.deadline);
}

absl::Status Client::UnregisterRegion(const std::string& session_id,
                                      const std::string& region_id) const {
  v1::UnregisterRegionRequest req;
  req.set_session_id(session_id);
  req.set_region_id(region_id);
  return UnregisterRegion(req).status();
}

// ---- steps and hyperparameters ------------------------------------------------------------------

absl::StatusOr<v1::StepResponse> Client::Step(const v1::StepRequest& request) const {
  return Unary<v1::StepRequest, v1::StepResponse>(stub_.get(), &v1::Optimizer::Stub::Step, request,
                                                  options_.deadline);
}

absl::StatusOr<StepResult> Client::Step(const std::string& session_id, int64_t step_index,
                                        const StepOptions& options) const {
  v1::StepRequest req;
  req.set_session_id(session_id);
  req.set_step_index(step_index);
  req.mutable_lr_override()->insert(options.lr_override.begin(), options.lr_override.end());
  req.mutable_group_step()->insert(options.group_step.begin(), options.group_step.end());
  req.set_gradient_scale(options.gradient_scale);
  req.set_asynchronous(options.asynchronous);
  req.mutable_params_without_grad()->Add(options.params_without_grad.begin(),
                                         options.params_without_grad.end());
  req.set_max_grad_norm(options.max_grad_norm);
  req.set_overlap(options.overlap);
  auto resp = Step(req);
  if (!resp.ok()) return resp.status();
  return diond::client::FromProto(*resp);
}

absl::StatusOr<StepResult> Client::WaitStep(const std::string& session_id,
                                            int64_t step_index) const {
  v1::StepRequest req;
  req.set_session_id(session_id);
  req.set_step_index(step_index);
  req.set_wait(true);
  auto resp = Step(req);
  if (!resp.ok()) return resp.status();
  return diond::client::FromProto(*resp);
}

absl::StatusOr<v1::SetHyperparametersResponse> Client::SetHyperparameters(
    const v1::SetHyperparametersRequest& request) const {
  return Unary<v1::SetHyperparametersRequest, v1::SetHyperparametersResponse>(
      stub_.get(), &v1::Optimizer::Stub::SetHyperparameters, request, options_.deadline);
}

absl::Status Client::SetHyperparameters(const std::string& session_id, const std::string& group,
                                        const Hyperparams& hyperparams) const {
  v1::SetHyperparametersRequest req;
  req.set_session_id(session_id);
  req.set_group(group);
  *req.mutable_hyperparameters() = ToProto(hyperparams);
  return SetHyperparameters(req).status();
}

// ---- remote data plane --------------------------------------------------------------------------

absl::StatusOr<v1::PushGradientsResponse> Client::PushGradients(
    const std::string& session_id, const std::vector<ConstTensorRef>& gradients) const {
  return WriteChunks<v1::PushGradientsResponse>(stub_.get(), &v1::Optimizer::Stub::PushGradients,
                                                session_id, gradients, options_);
}

absl::Status Client::PullParameters(const std::string& session_id,
                                    const std::vector<MutableTensorRef>& destinations) const {
  v1::PullParametersRequest req;
  req.set_session_id(session_id);
  req.set_chunk_bytes(options_.chunk_bytes);
  for (const MutableTensorRef& d : destinations) req.add_names(d.name);
  internal::Reassembler r(destinations);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.stream_deadline);
  auto reader = stub_->PullParameters(&ctx, req);
  return ReadChunks(&ctx, reader.get(), &r);
}

absl::StatusOr<TensorMap> Client::PullParameters(const v1::PullParametersRequest& request) const {
  internal::Reassembler r;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.stream_deadline);
  auto reader = stub_->PullParameters(&ctx, request);
  absl::Status s = ReadChunks(&ctx, reader.get(), &r);
  if (!s.ok()) return s;
  return r.TakeTensors();
}

absl::StatusOr<TensorMap> Client::PullParameters(const std::string& session_id,
                                                 const std::vector<std::string>& names) const {
  v1::PullParametersRequest req;
  req.set_session_id(session_id);
  req.set_chunk_bytes(options_.chunk_bytes);
  for (const std::string& n : names) req.add_names(n);
  auto tensors = PullParameters(req);
  if (!tensors.ok()) return tensors.status();
  for (const std::string& n : names) {
    if (tensors->find(n) == tensors->end()) {
      return absl::DataLossError(absl::StrCat("daemon did not send parameter '", n, "'"));
    }
  }
  return tensors;
}

absl::StatusOr<TensorMap> Client::GetState(const v1::GetStateRequest& request) const {
  internal::Reassembler r;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.stream_deadline);
  auto reader = stub_->GetState(&ctx, request);
  absl::Status s = ReadChunks(&ctx, reader.get(), &r);
  if (!s.ok()) return s;
  return r.TakeTensors();
}

absl::StatusOr<TensorMap> Client::GetState(const std::string& session_id,
                                           bool include_parameters) const {
  v1::GetStateRequest req;
  req.set_session_id(session_id);
  req.set_include_parameters(include_parameters);
  return GetState(req);
}

absl::StatusOr<int64_t> Client::SetState(const std::string& session_id,
                                         const std::vector<ConstTensorRef>& tensors) const {
  auto resp = WriteChunks<v1::SetStateResponse>(stub_.get(), &v1::Optimizer::Stub::SetState,
                                                session_id, tensors, options_);
  if (!resp.ok()) return resp.status();
  return resp->tensors();
}

absl::StatusOr<int64_t> Client::SetStateFromMap(const std::string& session_id,
                                                const TensorMap& tensors) const {
  std::vector<ConstTensorRef> refs;
  refs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    refs.push_back({name,
                    absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.bytes.data()),
                                              t.bytes.size()),
                    t.dtype});
  }
  return SetState(session_id, refs);
}

// ---- checkpoints --------------------------------------------------------------------------------

absl::StatusOr<v1::SaveCheckpointResponse> Client::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request) const {
  return Unary<v1::SaveCheckpointRequest, v1::SaveCheckpointResponse>(
      stub_.get(), &v1::Optimizer::Stub::SaveCheckpoint, request, options_.stream_deadline);
}

absl::StatusOr<CheckpointInfo> Client::SaveCheckpoint(const std::string& session_id,
                                                      const std::string& directory) const {
  v1::SaveCheckpointRequest req;
  req.set_session_id(session_id);
  req.set_directory(directory);
  auto resp = SaveCheckpoint(req);
  if (!resp.ok()) return resp.status();
  return CheckpointInfo{resp->path(), resp->step_index(), resp->bytes()};
}

absl::StatusOr<v1::LoadCheckpointResponse> Client::LoadCheckpoint(
    const v1::LoadCheckpointRequest& request) const {
  return Unary<v1::LoadCheckpointRequest, v1::LoadCheckpointResponse>(
      stub_.get(), &v1::Optimizer::Stub::LoadCheckpoint, request, options_.stream_deadline);
}

absl::StatusOr<LoadedCheckpoint> Client::LoadCheckpoint(const std::string& path) const {
  v1::LoadCheckpointRequest req;
  req.set_path(path);
  auto resp = LoadCheckpoint(req);
  if (!resp.ok()) return resp.status();
  auto layout = LayoutFromProto(resp->session());
  if (!layout.ok()) return layout.status();
  return LoadedCheckpoint{*std::move(layout), resp->step_index()};
}

absl::StatusOr<v1::AttachSessionResponse> Client::AttachSession(
    const v1::AttachSessionRequest& request) const {
  return Unary<v1::AttachSessionRequest, v1::AttachSessionResponse>(
      stub_.get(), &v1::Optimizer::Stub::AttachSession, request, options_.deadline);
}

absl::StatusOr<AttachedSession> Client::AttachSession(const std::string& session_name) const {
  v1::AttachSessionRequest req;
  req.set_session_name(session_name);
  auto resp = AttachSession(req);
  if (!resp.ok()) return resp.status();
  auto layout = LayoutFromProto(resp->session());
  if (!layout.ok()) return layout.status();
  return AttachedSession{*std::move(layout), resp->step_index()};
}

}  // namespace diond::client
