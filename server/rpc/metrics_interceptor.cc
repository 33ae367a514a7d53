#include "server/rpc/metrics_interceptor.h"

#include <atomic>
#include <chrono>
#include <string>

namespace diond::rpc {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MetricsInterceptor : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(grpc::experimental::ServerRpcInfo* info, RpcObserver* metrics)
      : method_(info->method() ? info->method() : "unknown"),
        metrics_(metrics),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      // Observed before the status leaves, so a client that scrapes /metrics after its call
      // returned always finds the call counted (observing in the destructor, after the call was
      // torn down, let a fast scrape miss it: the CI under ASan saw that).
      Observe(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

  // A call that ended without a status (the client cancelled, or its deadline passed before the
  // handler answered) is counted as CANCELLED when gRPC drops it.
  ~MetricsInterceptor() override { Observe(grpc::StatusCode::CANCELLED); }

 private:
  void Observe(grpc::StatusCode code) {
    // The hooks of one call run on gRPC's threads, and the send-status batch and the teardown
    // may come from two of them (TSan, scripts/tsan.sh, saw two such accesses): the exchange
    // makes sure each call is observed exactly once.
    if (observed_.exchange(true, std::memory_order_acq_rel)) return;
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    metrics_->ObserveRpc(method_, StatusCodeName(code), seconds);
  }

  std::string method_;
  RpcObserver* metrics_;
  std::chrono::steady_clock::time_point start_;
  std::atomic<bool> observed_{false};
};

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(RpcObserver* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MetricsInterceptor(info, metrics_);
  }

 private:
  RpcObserver* metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMetricsInterceptorFactory(RpcObserver* metrics) {
  return std::make_unique<Factory>(metrics);
}

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace diond::rpc
