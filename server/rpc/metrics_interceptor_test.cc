#include "server/rpc/metrics_interceptor.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

using Seen = std::tuple<std::string, std::string>;  // method, code

class RecordingObserver : public RpcObserver {
 public:
  void ObserveRpc(absl::string_view method, absl::string_view code, double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.emplace_back(std::string(method), std::string(code));
    EXPECT_GE(seconds, 0.0);
  }
  std::vector<Seen> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  std::mutex mu_;
  std::vector<Seen> seen_;
};

// A health service of the test's own: Check answers OK for "known" and NOT_FOUND otherwise; Watch
// sends one status and then holds the call open until the client goes away.
class TestHealth : public grpc::health::v1::Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::health::v1::HealthCheckResponse* resp) override {
    if (req->service() != "known") return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown");
    resp->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
  grpc::Status Watch(grpc::ServerContext* ctx, const grpc::health::v1::HealthCheckRequest*,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* w) override {
    grpc::health::v1::HealthCheckResponse resp;
    resp.set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    w->Write(resp);
    while (!ctx->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
};

// A real in-process gRPC server with that service and only the interceptor on it.
class MetricsInterceptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&health_);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
    f.push_back(MakeMetricsInterceptorFactory(&observer_));
    builder.experimental().SetInterceptorCreators(std::move(f));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  grpc::Status Check(const std::string& service) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    return stub_->Check(&ctx, req, &resp);
  }

  RecordingObserver observer_;
  TestHealth health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

constexpr char kCheck[] = "/grpc.health.v1.Health/Check";
constexpr char kWatch[] = "/grpc.health.v1.Health/Watch";

TEST_F(MetricsInterceptorTest, ACallIsCountedBeforeItsClientSeesTheAnswer) {
  // No waiting anywhere: each call must be observed by the time the client has its status.
  for (int i = 1; i <= 50; ++i) {
    ASSERT_TRUE(Check("known").ok());
    ASSERT_EQ(observer_.seen().size(), static_cast<size_t>(i));
  }
  EXPECT_EQ(Check("unknown").error_code(), grpc::StatusCode::NOT_FOUND);
  auto seen = observer_.seen();
  ASSERT_EQ(seen.size(), 51u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(seen[i], Seen(kCheck, "OK"));
  EXPECT_EQ(seen[50], Seen(kCheck, "NOT_FOUND"));
}

TEST_F(MetricsInterceptorTest, ACallCancelledBeforeItsStatusIsCountedOnceAsCancelled) {
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("known");
  auto reader = stub_->Watch(&ctx, req);
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(reader->Read(&resp));  // the server streams the first status, then waits
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The server learns of the cancel asynchronously: wait (bounded) for the call to be dropped.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (observer_.seen().empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // Shutting the server down drops every call, so nothing can still be on its way.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server_.reset();
  auto seen = observer_.seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], Seen(kWatch, "CANCELLED"));
}

}  // namespace
}  // namespace diond::rpc
