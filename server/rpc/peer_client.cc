#include "server/rpc/peer_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "server/rpc/auth.h"
#include "server/rpc/peer_service.h"
#include "server/rpc/status_conversion.h"

namespace diond::rpc {
namespace {}  // namespace

PeerClient::PeerClient(std::string target, absl::Duration call_timeout, PeerCredentials credentials)
    : target_(std::move(target)),
      call_timeout_(call_timeout),
      world_secret_(std::move(credentials.world_secret)) {
  grpc::ChannelArguments args;
  // Reconnect quickly after the coordinator restarts (default backoff grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!credentials.tls_ca.empty()) {
    grpc::SslCredentialsOptions so;
    so.pem_root_certs = credentials.tls_ca;
    so.pem_cert_chain = credentials.tls_cert;
    so.pem_private_key = credentials.tls_key;
    creds = grpc::SslCredentials(so);
  }
  stub_ = v1::Peer::NewStub(grpc::CreateCustomChannel(target_, creds, args));
}

void PeerClient::Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!world_secret_.empty()) ctx->AddMetadata(kWorldSecretMetadata, world_secret_);
}

absl::Status PeerClient::Done(const grpc::Status& s, const char* what) const {
  if (s.ok()) return absl::OkStatus();
  absl::Status a = FromGrpcStatus(s);
  if (absl::IsUnavailable(a) || absl::IsDeadlineExceeded(a)) {
    // Transport trouble: say where we tried to go.
    return absl::Status(a.code(),
                        absl::StrCat("coordinator ", target_, " ", what, ": ", a.message()));
  }
  return a;
}

absl::Status PeerClient::Set(absl::string_view key, absl::string_view value) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call_timeout_);
  v1::PeerSetRequest req;
  req.set_key(std::string(key));
  req.set_value(std::string(value));
  v1::PeerSetResponse resp;
  return Done(stub_->Set(&ctx, req, &resp), "Set");
}

absl::StatusOr<std::string> PeerClient::Get(absl::string_view key) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call_timeout_);
  v1::PeerGetRequest req;
  req.set_key(std::string(key));
  v1::PeerGetResponse resp;
  absl::Status s = Done(stub_->Get(&ctx, req, &resp), "Get");
  if (!s.ok()) return s;
  return std::move(*resp.mutable_value());
}

absl::Status PeerClient::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(&ctx, timeout + call_timeout_);
  v1::PeerWaitRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::PeerWaitResponse resp;
  return Done(stub_->Wait(&ctx, req, &resp), "Wait");
}

absl::StatusOr<comm::MembershipView> PeerClient::Join(const comm::JoinArgs& a) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call_timeout_);
  v1::JoinRequest req;
  req.set_rank(a.rank);
  req.set_world_size(a.world_size);
  req.set_address(a.address);
  req.set_incarnation(a.incarnation);
  req.set_rebuild(a.rebuild);
  req.set_proof(a.proof);
  v1::JoinResponse resp;
  absl::Status s = Done(stub_->Join(&ctx, req, &resp), "Join");
  if (!s.ok()) return s;
  return FromProto(resp.membership());
}

absl::StatusOr<comm::MembershipView> PeerClient::Heartbeat(int rank, uint64_t incarnation,
                                                           const std::string& proof) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call_timeout_);
  v1::HeartbeatRequest req;
  req.set_rank(rank);
  req.set_incarnation(incarnation);
  req.set_proof(proof);
  v1::HeartbeatResponse resp;
  absl::Status s = Done(stub_->Heartbeat(&ctx, req, &resp), "Heartbeat");
  if (!s.ok()) return s;
  return FromProto(resp.membership());
}

absl::StatusOr<comm::MembershipView> PeerClient::GetMembership() {
  grpc::ClientContext ctx;
  Prepare(&ctx, call_timeout_);
  v1::GetMembershipRequest req;
  v1::GetMembershipResponse resp;
  absl::Status s = Done(stub_->GetMembership(&ctx, req, &resp), "GetMembership");
  if (!s.ok()) return s;
  return FromProto(resp.membership());
}

}  // namespace diond::rpc
