#include "server/rpc/grpc_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "server/rpc/metrics_interceptor.h"
#include "server/rpc/optimizer_service.h"

namespace diond::rpc {

namespace {

// TLS needs both halves; a client CA (mutual TLS) needs TLS.
absl::Status CheckTlsFlags(const RpcServerOptions& options) {
  const bool tls = !options.tls_cert.empty();
  if (tls != !options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!tls && !options.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const RpcServerOptions& options,
                                                        bool client_certs) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions so(client_certs ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  so.pem_root_certs = options.tls_client_ca;
  so.pem_key_cert_pairs.push_back({options.tls_key, options.tls_cert});
  return grpc::SslServerCredentials(so);
}

void UnlinkUnixSockets(const std::vector<std::unique_ptr<UnixListener>>& listeners,
                       const std::vector<ListenAddress>& listen) {
  size_t n = listeners.size();
  for (const ListenAddress& a : listen) {
    if (n == 0) break;
    if (a.kind != ListenAddress::Kind::kUnix) continue;
    unlink(a.path.c_str());
    --n;
  }
}

// Every Unix address bound now (accepted by UnixListener once the server runs). On a failure the
// sockets bound so far are removed; a path that was not ours is left alone.
absl::StatusOr<std::vector<std::unique_ptr<UnixListener>>> BindUnixSockets(
    const std::vector<ListenAddress>& listen) {
  std::vector<std::unique_ptr<UnixListener>> listeners;
  for (const ListenAddress& a : listen) {
    if (a.kind != ListenAddress::Kind::kUnix) continue;
    absl::Status ready = PrepareUnixSocketPath(a.path);
    auto l = ready.ok() ? UnixListener::Bind(a.path)
                        : absl::StatusOr<std::unique_ptr<UnixListener>>(ready);
    if (!l.ok()) {
      UnlinkUnixSockets(listeners, listen);
      return l.status();
    }
    listeners.push_back(*std::move(l));
  }
  return listeners;
}

// A second server with gRPC's health service only (no interceptor, no other service): what a
// kubelet's gRPC probe may reach on the pod IP while the API stays on loopback/unix.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& address,
                                                                int* port) {
  grpc::ServerBuilder hb;
  hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  hb.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  std::unique_ptr<grpc::Server> server = hb.BuildAndStart();
  if (server == nullptr || *port == 0) {
    if (server) server->Shutdown();
    return absl::UnavailableError(absl::StrCat("cannot serve health checks on --health_address=",
                                               address, ": address in use or not HOST:PORT"));
  }
  return server;
}

}  // namespace

RpcServer::RpcServer() = default;

RpcServer::~RpcServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(const RpcServerOptions& options,
                                                            RpcObserver* observer) {
  std::unique_ptr<RpcServer> s(new RpcServer);
  if (options.manager == nullptr) return absl::InternalError("RpcServer needs a SessionManager");
  DIOND_RETURN_IF_ERROR(CheckTlsFlags(options));
  AuthOptions auth = options.auth;
  auth.tls_client_certs = !options.tls_client_ca.empty();
  s->auth_ = std::make_unique<Authenticator>(auth);
  s->service_ =
      std::make_unique<OptimizerService>(options.manager, s->auth_.get(), options.service);
  DIOND_ASSIGN_OR_RETURN(s->unix_listeners_, BindUnixSockets(options.listen));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second daemon bind the same TCP port
  // and steal half the connections. A taken port must be an error.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  const std::shared_ptr<grpc::ServerCredentials> tcp_creds =
      TcpCredentials(options, auth.tls_client_certs);
  std::vector<int> ports(options.listen.size(), 0);
  bool any_tcp = false;
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const auto& a = options.listen[i];
    if (a.kind != ListenAddress::Kind::kTcp) continue;
    any_tcp = true;
    builder.AddListeningPort(a.ToString(), tcp_creds, &ports[i]);
  }
  if (any_tcp && !s->auth_->tcp_usable()) {
    DIOND_LOG(WARNING) << "TCP listeners have no credential configured: every call over TCP "
                          "gets UNAUTHENTICATED (give --auth_token_file or --tls_client_ca, or "
                          "--allow_unauthenticated_tcp)";
  }
  builder.RegisterService(s->service_.get());
  if (options.coordinator != nullptr) {
    s->peer_service_ = std::make_unique<PeerService>(options.coordinator, options.world_secret,
                                                     auth.tls_client_certs);
    builder.RegisterService(s->peer_service_.get());
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> icpt;
  icpt.push_back(MakeMetricsInterceptorFactory(observer));
  builder.experimental().SetInterceptorCreators(std::move(icpt));

  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr) {
    std::vector<std::string> names;
    for (const auto& a : options.listen) names.push_back(a.ToString());
    UnlinkUnixSockets(s->unix_listeners_, options.listen);
    s->unix_listeners_.clear();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", absl::StrJoin(names, ", "),
                     ": address already in use or not bindable (see the gRPC log line above)"));
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    ListenAddress a = options.listen[i];
    if (a.kind == ListenAddress::Kind::kTcp) {
      if (ports[i] == 0) {
        s->server_->Shutdown();
        UnlinkUnixSockets(s->unix_listeners_, options.listen);
        s->unix_listeners_.clear();
        return absl::UnavailableError(absl::StrCat("cannot listen on ", a.ToString()));
      }
      a.port = ports[i];
    }
    s->bound_.push_back(a);
  }
  for (auto& l : s->unix_listeners_) l->Start(s->server_.get(), s->auth_->unix_peers());
  if (!options.health_address.empty()) {
    absl::StatusOr<std::unique_ptr<grpc::Server>> health =
        StartHealthServer(options.health_address, &s->health_port_);
    if (!health.ok()) {
      s->server_->Shutdown();
      return health.status();
    }
    s->health_server_ = *std::move(health);
  }
  for (grpc::Server* server : {s->server_.get(), s->health_server_.get()}) {
    if (server == nullptr) continue;
    auto* health = server->GetHealthCheckService();
    health->SetServingStatus(true);
    health->SetServingStatus("diond.v1.Optimizer", true);
    if (s->peer_service_) health->SetServingStatus("diond.v1.Peer", true);
  }
  return s;
}

void RpcServer::SetOptimizerNotServing() {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    auto* health = server->GetHealthCheckService();
    health->SetServingStatus("", false);
    health->SetServingStatus("diond.v1.Optimizer", false);
  }
}

void RpcServer::Shutdown(absl::Duration drain) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(false);
  for (auto& l : unix_listeners_) l->Stop();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + drain));
  server_->Wait();
  if (health_server_) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  for (const auto& a : bound_) {
    if (a.kind == ListenAddress::Kind::kUnix) unlink(a.path.c_str());
  }
}

}  // namespace diond::rpc
