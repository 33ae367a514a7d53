#include "server/rpc/peer_service.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/rpc/auth.h"
#include "server/rpc/status_conversion.h"

namespace diond::rpc {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

// Longest a single Wait may park (clients loop for longer waits).
constexpr int64_t kMaxWaitMs = 10 * 60 * 1000;

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
  if (req->key().empty()) return Finish(ctx, absl::InvalidArgumentError("key is empty"));
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
  if (req->timeout_ms() < 0 || req->timeout_ms() > kMaxWaitMs) {
    return Finish(ctx, absl::InvalidArgumentError(absl::StrCat(
                           "timeout_ms ", req->timeout_ms(), " outside [0, ", kMaxWaitMs, "]")));
  }
  const comm::StoreLimits& limits = coordinator_->store()->limits();
  if (req->keys_size() > limits.max_keys) {
    return Finish(ctx, absl::ResourceExhaustedError(absl::StrCat(
                           "Wait for ", req->keys_size(), " keys; the limit is ", limits.max_keys,
                           " (--world_max_keys)")));
  }
  for (const std::string& k : req->keys()) {
    if (static_cast<int64_t>(k.size()) > limits.max_key_bytes) {
      return Finish(ctx, absl::ResourceExhaustedError(absl::StrCat(
                             "Wait for a key of ", k.size(), " bytes; the limit is ",
                             limits.max_key_bytes, " (--world_max_key_bytes)")));
    }
  }
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  std::vector<std::string> keys(req->keys().begin(), req->keys().end());
  coordinator_->store()->WaitAsync(std::move(keys), absl::Milliseconds(req->timeout_ms()),
                                   [r](absl::Status s) { r->Finish(ToGrpcStatus(s)); });
  return r;
}

grpc::ServerUnaryReactor* PeerService::Join(grpc::CallbackServerContext* ctx,
                                            const v1::JoinRequest* req, v1::JoinResponse* resp) {
  if (absl::Status a = CheckWorldCredential(*ctx, world_secret_, mtls_); !a.ok()) {
    return Finish(ctx, a);
  }
  comm::JoinArgs a{req->rank(),        req->world_size(), req->address(),
                   req->incarnation(), req->rebuild(),    req->proof()};
  auto v = coordinator_->Join(a);
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
