#include "server/rpc/peer_service.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/rpc/auth.h"
#include "server/rpc/peer_requests.h"
#include "server/rpc/status_conversion.h"

namespace diond::rpc {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

}  // namespace

void ToProto(const comm::MembershipView& v, v1::Membership* out) {
  out->set_generation(v.generation);
  out->set_world_size(v.world_size);
  out->set_complete(v.complete);
  out->set_broken_reason(v.broken_reason);
  out->set_coordinator_incarnation(v.coordinator_incarnation);
  for (const auto& m : v.members) {
    auto* p = out->add_members();
    p->set_rank(m.rank);
    p->set_address(m.address);
    p->set_incarnation(m.incarnation);
    p->set_live(m.live);
  }
}

comm::MembershipView FromProto(const v1::Membership& m) {
  comm::MembershipView v;
  v.generation = m.generation();
  v.world_size = m.world_size();
  v.complete = m.complete();
  v.broken_reason = m.broken_reason();
  v.coordinator_incarnation = m.coordinator_incarnation();
  for (const auto& p : m.members()) {
    v.members.push_back(comm::MemberInfo{p.rank(), p.address(), p.incarnation(), p.live()});
  }
  return v;
}

grpc::ServerUnaryReactor* PeerService::Set(grpc::CallbackServerContext* ctx,
                                           const v1::PeerSetRequest* req, v1::PeerSetResponse*) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  if (absl::Status c = CheckPeerSet(*req); !c.ok()) return Finish(ctx, c);
  return Finish(ctx, coordinator_->store()->Set(req->key(), req->value()));
}

grpc::ServerUnaryReactor* PeerService::Get(grpc::CallbackServerContext* ctx,
                                           const v1::PeerGetRequest* req,
                                           v1::PeerGetResponse* resp) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  auto v = coordinator_->store()->Get(req->key());
  if (v.ok()) resp->set_value(std::move(*v));
  return Finish(ctx, v.status());
}

grpc::ServerUnaryReactor* PeerService::Wait(grpc::CallbackServerContext* ctx,
                                            const v1::PeerWaitRequest* req, v1::PeerWaitResponse*) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  auto keys = PeerWaitKeys(*req, coordinator_->store()->limits());
  if (!keys.ok()) return Finish(ctx, keys.status());
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  coordinator_->store()->WaitAsync(*std::move(keys), absl::Milliseconds(req->timeout_ms()),
                                   [r](const absl::Status& s) { r->Finish(ToGrpcStatus(s)); });
  return r;
}

grpc::ServerUnaryReactor* PeerService::Join(grpc::CallbackServerContext* ctx,
                                            const v1::JoinRequest* req, v1::JoinResponse* resp) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  auto v = coordinator_->Join(JoinArgsFromProto(*req));
  if (v.ok()) ToProto(*v, resp->mutable_membership());
  return Finish(ctx, v.status());
}

grpc::ServerUnaryReactor* PeerService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                 const v1::HeartbeatRequest* req,
                                                 v1::HeartbeatResponse* resp) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  auto v = coordinator_->Heartbeat(req->rank(), req->incarnation(), req->proof());
  if (v.ok()) ToProto(*v, resp->mutable_membership());
  return Finish(ctx, v.status());
}

grpc::ServerUnaryReactor* PeerService::GetMembership(grpc::CallbackServerContext* ctx,
                                                     const v1::GetMembershipRequest*,
                                                     v1::GetMembershipResponse* resp) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  auto v = coordinator_->GetMembership();
  if (v.ok()) ToProto(*v, resp->mutable_membership());
  return Finish(ctx, v.status());
}

}  // namespace diond::rpc
