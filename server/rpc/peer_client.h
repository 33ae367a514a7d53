// Client of the coordinator's Peer service: implements the domain interfaces
// comm::KeyValueStore and comm::MembershipService over gRPC, so server/comm never sees grpcpp.
//
// Every call has a deadline (call_timeout; Wait adds its own timeout). An unreachable
// coordinator gives UNAVAILABLE naming its address; callers retry.
//
// Thread-safety: thread-safe (one shared channel).
#ifndef DIOND_SERVER_RPC_PEER_CLIENT_H_
#define DIOND_SERVER_RPC_PEER_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "diond/v1/peer.grpc.pb.h"
#include "server/comm/key_value_store.h"
#include "server/comm/membership.h"

namespace diond::rpc {

// How a daemon proves itself to the coordinator (docs/OPERATIONS.md "Security").
struct PeerCredentials {
  std::string world_secret;  // sent on every call (kWorldSecretMetadata); empty = none
  // TLS to the coordinator when tls_ca (PEM) is set: the coordinator's certificate must chain
  // to it; with tls_cert and tls_key (PEM) this daemon also presents its own (mTLS).
  std::string tls_ca, tls_cert, tls_key;
};

class PeerClient final : public comm::KeyValueStore, public comm::MembershipService {
 public:
  // `target` is "host:port" or any gRPC target ("unix:/path").
  explicit PeerClient(std::string target, absl::Duration call_timeout = absl::Seconds(5),
                      PeerCredentials credentials = {});

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

  absl::StatusOr<comm::MembershipView> Join(const comm::JoinArgs& args) override;
  absl::StatusOr<comm::MembershipView> Heartbeat(int rank, uint64_t incarnation,
                                                 const std::string& proof) override;
  absl::StatusOr<comm::MembershipView> GetMembership() override;

  const std::string& target() const { return target_; }

 private:
  absl::Status Done(const grpc::Status& s, const char* what) const;
  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const;
  std::string target_;
  absl::Duration call_timeout_;
  std::string world_secret_;
  std::unique_ptr<v1::Peer::Stub> stub_;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_PEER_CLIENT_H_
