// A gRPC server interceptor that counts every finished RPC and its latency by method and status
// code into DaemonMetrics. Installed once on the ServerBuilder; covers every service (Optimizer,
// health, reflection).
#ifndef DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_
#define DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics.h"

namespace diond::rpc {

// `metrics` must outlive the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMetricsInterceptorFactory(server::DaemonMetrics* metrics);

// "INVALID_ARGUMENT" etc.
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_METRICS_INTERCEPTOR_H_
