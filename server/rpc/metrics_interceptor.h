// A gRPC server interceptor that reports every RPC, once, with its latency by method and status
// code to an RpcObserver (the daemon's metrics, connected by server/exe). Installed once on the
// ServerBuilder; covers every service (Optimizer, health, reflection).
#ifndef DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_
#define DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"
#include "server/rpc/rpc_observer.h"

namespace diond::rpc {

// `observer` must outlive the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMetricsInterceptorFactory(RpcObserver* observer);

// "INVALID_ARGUMENT" etc.
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_
