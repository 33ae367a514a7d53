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
#include "server/rpc/metrics_interceptor.h"
#include "server/rpc/optimizer_service.h"

namespace diond::rpc {

RpcServer::RpcServer() = default;

RpcServer::~RpcServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(const RpcServerOptions& options,
                                                            server::DaemonMetrics* metrics) {
  std::unique_ptr<RpcServer> s(new RpcServer);
  if (options.manager == nullptr) return absl::InternalError("RpcServer needs a SessionManager");
  s->service_ = std::make_unique<OptimizerService>(options.manager, options.service);

  for (const auto& a : options.listen) {
    if (a.kind == server::ListenAddress::Kind::kUnix) {
      DIOND_RETURN_IF_ERROR(server::PrepareUnixSocketPath(a.path));
    }
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
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const auto& a = options.listen[i];
    builder.AddListeningPort(a.ToString(), grpc::InsecureServerCredentials(),
                             a.kind == server::ListenAddress::Kind::kTcp ? &ports[i] : nullptr);
  }
  builder.RegisterService(s->service_.get());
  if (options.coordinator != nullptr) {
    s->peer_service_ = std::make_unique<PeerService>(options.coordinator);
    builder.RegisterService(s->peer_service_.get());
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> icpt;
  icpt.push_back(MakeMetricsInterceptorFactory(metrics));
  builder.experimental().SetInterceptorCreators(std::move(icpt));

  // Unix sockets are created 0600 (owner only): set the umask around the bind.
  mode_t old_mask = umask(0177);
  s->server_ = builder.BuildAndStart();
  umask(old_mask);

  std::vector<std::string> names;
  for (const auto& a : options.listen) names.push_back(a.ToString());
  if (s->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", absl::StrJoin(names, ", "),
        ": address already in use or not bindable (see the gRPC log line above)"));
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    server::ListenAddress a = options.listen[i];
    if (a.kind == server::ListenAddress::Kind::kTcp) {
      if (ports[i] == 0) {
        s->server_->Shutdown();
        return absl::UnavailableError(absl::StrCat("cannot listen on ", a.ToString()));
      }
      a.port = ports[i];
    } else {
      // Belt and braces: the umask covers the bind, chmod covers an odd umask-ignoring kernel.
      chmod(a.path.c_str(), 0600);
    }
    s->bound_.push_back(a);
  }
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
      return absl::UnavailableError(absl::StrCat("cannot serve health checks on --health_address=",
                                                 options.health_address,
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

void RpcServer::Shutdown(absl::Duration drain) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(absl::ToChronoTime(absl::Now() + drain));
  server_->Wait();
  if (health_server_) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  for (const auto& a : bound_) {
    if (a.kind == server::ListenAddress::Kind::kUnix) unlink(a.path.c_str());
  }
}

}  // namespace diond::rpc
