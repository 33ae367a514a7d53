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

RpcServer::RpcServer() = default;

RpcServer::~RpcServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(const RpcServerOptions& options,
                                                            RpcObserver* observer) {
  std::unique_ptr<RpcServer> s(new RpcServer);
  if (options.manager == nullptr) return absl::InternalError("RpcServer needs a SessionManager");
  const bool tls = !options.tls_cert.empty();
  if (tls != !options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!tls && !options.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  AuthOptions auth = options.auth;
  auth.tls_client_certs = !options.tls_client_ca.empty();
  s->auth_ = std::make_unique<Authenticator>(auth);
  s->service_ =
      std::make_unique<OptimizerService>(options.manager, s->auth_.get(), options.service);

  // Unix sockets: bound here, accepted by UnixListener once the server runs.
  std::vector<std::string> unix_paths;
  auto unbind_unix = [&] {
    s->unix_listeners_.clear();
    for (const std::string& path : unix_paths) unlink(path.c_str());
  };
  for (const auto& a : options.listen) {
    if (a.kind != ListenAddress::Kind::kUnix) continue;
    absl::Status ready = PrepareUnixSocketPath(a.path);
    auto l = ready.ok() ? UnixListener::Bind(a.path)
                        : absl::StatusOr<std::unique_ptr<UnixListener>>(ready);
    if (!l.ok()) {
      unbind_unix();
      return l.status();
    }
    unix_paths.push_back(a.path);
    s->unix_listeners_.push_back(*std::move(l));
  }

  std::shared_ptr<grpc::ServerCredentials> tcp_creds = grpc::InsecureServerCredentials();
  if (tls) {
    grpc::SslServerCredentialsOptions so(auth.tls_client_certs
                                             ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                             : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    so.pem_root_certs = options.tls_client_ca;
    so.pem_key_cert_pairs.push_back({options.tls_key, options.tls_cert});
    tcp_creds = grpc::SslServerCredentials(so);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second daemon bind the same TCP port
  // and steal half the connections. A taken port must be an error.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
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

  std::vector<std::string> names;
  for (const auto& a : options.listen) names.push_back(a.ToString());
  if (s->server_ == nullptr) {
    unbind_unix();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", absl::StrJoin(names, ", "),
                     ": address already in use or not bindable (see the gRPC log line above)"));
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    ListenAddress a = options.listen[i];
    if (a.kind == ListenAddress::Kind::kTcp) {
      if (ports[i] == 0) {
        s->server_->Shutdown();
        unbind_unix();
        return absl::UnavailableError(absl::StrCat("cannot listen on ", a.ToString()));
      }
      a.port = ports[i];
    }
    s->bound_.push_back(a);
  }
  for (auto& l : s->unix_listeners_) l->Start(s->server_.get(), s->auth_->unix_peers());
  if (!options.health_address.empty()) {
    // A second server with gRPC's health service only (no interceptor, no other service): what
    // a kubelet's gRPC probe may reach on the pod IP while the API stays on loopback/unix.
    grpc::ServerBuilder hb;
    hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    int port = 0;
    hb.AddListeningPort(options.health_address, grpc::InsecureServerCredentials(), &port);
    s->health_server_ = hb.BuildAndStart();
    if (s->health_server_ == nullptr || port == 0) {
      if (s->health_server_) s->health_server_->Shutdown();
      s->server_->Shutdown();
      return absl::UnavailableError(
          absl::StrCat("cannot serve health checks on --health_address=", options.health_address,
                       ": address in use or not HOST:PORT"));
    }
    s->health_port_ = port;
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
