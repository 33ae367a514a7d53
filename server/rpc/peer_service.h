// The diond.v1.Peer gRPC service (proto/diond/v1/peer.proto), served by rank 0 on its normal
// listeners when --world_size > 1. Thin: converts to the domain's comm::Coordinator and its
// MemoryKeyValueStore, whose Wait is parked with WaitAsync so a blocked Wait holds no thread.
// Also the proto <-> domain conversion of the membership view, which rpc::PeerClient shares.
#ifndef DIOND_SERVER_RPC_PEER_SERVICE_H_
#define DIOND_SERVER_RPC_PEER_SERVICE_H_

#include <string>
#include <utility>

#include "diond/v1/peer.grpc.pb.h"
#include "server/comm/membership.h"

namespace diond::rpc {

class PeerService final : public diond::v1::Peer::CallbackService {
 public:
  // `coordinator` must outlive the service. Every call must carry `world_secret` (metadata
  // kWorldSecretMetadata, server/rpc/auth.h) or, if `mtls`, come with a verified TLS client
  // certificate; UNAUTHENTICATED otherwise.
  PeerService(comm::Coordinator* coordinator, std::string world_secret, bool mtls)
      : coordinator_(coordinator), world_secret_(std::move(world_secret)), mtls_(mtls) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const v1::PeerSetRequest* req,
                                v1::PeerSetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::PeerGetRequest* req,
                                v1::PeerGetResponse* resp) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx, const v1::PeerWaitRequest* req,
                                 v1::PeerWaitResponse* resp) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* GetMembership(grpc::CallbackServerContext* ctx,
                                          const v1::GetMembershipRequest* req,
                                          v1::GetMembershipResponse* resp) override;

 private:
  comm::Coordinator* coordinator_;
  std::string world_secret_;
  bool mtls_;
};

void ToProto(const comm::MembershipView& v, v1::Membership* out);
comm::MembershipView FromProto(const v1::Membership& m);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_PEER_SERVICE_H_
