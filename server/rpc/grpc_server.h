// The daemon's gRPC server: the Optimizer service, grpc.health.v1 (gRPC's own implementation),
// server reflection and the metrics interceptor, on every listen address at once.
//
// Thread-safety: Start and Shutdown are called from the daemon's main thread only.
#ifndef DIOND_SERVER_RPC_GRPC_SERVER_H_
#define DIOND_SERVER_RPC_GRPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/rpc/auth.h"
#include "server/rpc/listen.h"
#include "server/rpc/optimizer_service.h"
#include "server/rpc/peer_service.h"
#include "server/rpc/rpc_observer.h"
#include "server/session/session_manager.h"

namespace grpc {
class Server;
}

namespace diond::rpc {

struct RpcServerOptions {
  std::vector<ListenAddress> listen;
  session::SessionManager* manager = nullptr;  // required; must outlive the server
  OptimizerServiceOptions service;
  int64_t max_message_bytes = 64 << 20;
  // Rank 0 of a daemon world (--world_size > 1): also serve diond.v1.Peer from this coordinator,
  // which must outlive the server. Null otherwise.
  comm::Coordinator* coordinator = nullptr;
  // HOST:PORT serving only grpc.health.v1 (for Kubernetes gRPC probes); empty = none.
  std::string health_address;
  // Who may call (server/rpc/auth.h).
  AuthOptions auth;
  // TLS on every TCP listener when cert and key (PEM text) are set. With client_ca, client
  // certificates are requested and, when sent, verified against it (mTLS); a verified one is a
  // credential.
  std::string tls_cert, tls_key, tls_client_ca;
  // Peer service: the world's shared secret; empty = only mTLS client certificates are accepted.
  std::string world_secret;
};

class RpcServer {
 public:
  // Binds every address or none: ALREADY_EXISTS / UNAVAILABLE with the address when a port or
  // socket is taken. Unix sockets are created with mode 0600 and accepted by UnixListener (the
  // peer's uid is its principal). `observer` (told of every finished call: the daemon's
  // metrics) must outlive the server.
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(const RpcServerOptions& options,
                                                          RpcObserver* observer);
  ~RpcServer();

  // The addresses actually bound (TCP port 0 resolved).
  const std::vector<ListenAddress>& bound() const { return bound_; }
  // The bound port of --health_address; 0 = none.
  int health_port() const { return health_port_; }

  // Marks health NOT_SERVING, stops accepting, waits up to `drain` for in-flight RPCs, cancels
  // the rest, and removes the Unix socket files. Idempotent.
  void Shutdown(absl::Duration drain);
  // grpc.health.v1 answers NOT_SERVING for the server ("") and diond.v1.Optimizer, on every
  // listener and --health_address, while the daemon keeps running (its compute device is lost);
  // diond.v1.Peer keeps its status (the world's membership does not need the device).
  // Thread-safe; for good.
  void SetOptimizerNotServing();

 private:
  RpcServer();
  std::unique_ptr<OptimizerService> service_;
  std::unique_ptr<PeerService> peer_service_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // --health_address only
  int health_port_ = 0;
  std::vector<std::unique_ptr<UnixListener>> unix_listeners_;
  std::vector<ListenAddress> bound_;
  bool shut_down_ = false;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_GRPC_SERVER_H_
