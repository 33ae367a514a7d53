#include "server/metrics.h"

#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace diond::server {
namespace {

std::string Expose(prometheus::Collectable& c) {
  prometheus::TextSerializer s;
  return s.Serialize(c.Collect());
}

TEST(DaemonMetrics, BuildInfoAndRpcCountsByMethodAndCode) {
  auto registry = std::make_shared<prometheus::Registry>();
  DaemonMetrics m(registry, {"1.2.3", "cpu", false});
  m.ObserveRpc("/diond.v1.Optimizer/Step", "OK", 0.001);
  m.ObserveRpc("/diond.v1.Optimizer/Step", "OK", 0.003);
  m.ObserveRpc("/diond.v1.Optimizer/Step", "INVALID_ARGUMENT", 0.0001);
  std::string text = Expose(*registry);
  EXPECT_NE(text.find(R"(diond_build_info{compute_device="cpu",cuda_plugin="false",device="cpu",version="1.2.3"} 1)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(diond_rpcs_total{code="OK",method="/diond.v1.Optimizer/Step"} 2)"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find(
          R"(diond_rpcs_total{code="INVALID_ARGUMENT",method="/diond.v1.Optimizer/Step"} 1)"),
      std::string::npos);
  EXPECT_NE(text.find(R"(diond_rpc_duration_seconds_count{code="OK",method="/diond.v1.Optimizer/Step"} 2)"),
            std::string::npos);
  // 0.001 + 0.003 observed in the OK series.
  EXPECT_NE(text.find(R"(diond_rpc_duration_seconds_sum{code="OK",method="/diond.v1.Optimizer/Step"} 0.004)"),
            std::string::npos)
      << text;
}

TEST(ProcessCollector, ReportsPlausibleProcessValues) {
  auto c = MakeProcessCollector();
  bool saw_rss = false, saw_fds = false, saw_start = false;
  for (const auto& f : c->Collect()) {
    ASSERT_FALSE(f.metric.empty());
    if (f.name == "process_resident_memory_bytes") {
      saw_rss = true;
      EXPECT_GT(f.metric[0].gauge.value, 1 << 20);  // any real process has > 1 MiB resident
    }
    if (f.name == "process_open_fds") {
      saw_fds = true;
      EXPECT_GE(f.metric[0].gauge.value, 3);  // stdin, stdout, stderr
    }
    if (f.name == "process_start_time_seconds") {
      saw_start = true;
      EXPECT_GT(f.metric[0].gauge.value, 1.6e9);  // after 2020
    }
  }
  EXPECT_TRUE(saw_rss && saw_fds && saw_start);
}

TEST(MetricsServer, SecondServerOnSamePortFailsCleanly) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto first = MetricsServer::Start("127.0.0.1:0", {registry});
  ASSERT_THAT(first, testing::IsOk());
  int port = (*first)->port();
  ASSERT_GT(port, 0);
  auto second = MetricsServer::Start("127.0.0.1:" + std::to_string(port), {registry});
  EXPECT_THAT(second, testing::StatusIs(absl::StatusCode::kUnavailable,
                                        ::testing::HasSubstr(std::to_string(port))));
}

}  // namespace
}  // namespace diond::server
