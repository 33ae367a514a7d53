#include "server/metrics.h"

#include <ctime>
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
  BuildInfo info{"1.2.3", "cpu", false};
  info.openblas_core = "SkylakeX";
  info.openblas_core_source = "diond";
  info.fp32_gemm_auto = "openblas";
  info.bf16_matmul_auto = "onednn";
  info.engines_calibrated = true;
  DaemonMetrics m(registry, info);
  m.ObserveRpc("/diond.v1.Optimizer/Step", "OK", 0.001);
  m.ObserveRpc("/diond.v1.Optimizer/Step", "OK", 0.003);
  m.ObserveRpc("/diond.v1.Optimizer/Step", "INVALID_ARGUMENT", 0.0001);
  std::string text = Expose(*registry);
  EXPECT_NE(
      text.find(
          R"(diond_build_info{bf16_matmul_auto="onednn",compute_device="cpu",cuda_plugin="false",device="cpu",engines_calibrated="true",fp32_gemm_auto="openblas",fp32_symmetric_auto="onednn",openblas_core="SkylakeX",openblas_core_source="diond",version="1.2.3"} 1)"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(diond_rpcs_total{code="OK",method="/diond.v1.Optimizer/Step"} 2)"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find(R"(diond_rpcs_total{code="INVALID_ARGUMENT",method="/diond.v1.Optimizer/Step"} 1)"),
      std::string::npos);
  EXPECT_NE(
      text.find(
          R"(diond_rpc_duration_seconds_count{code="OK",method="/diond.v1.Optimizer/Step"} 2)"),
      std::string::npos);
  // 0.001 + 0.003 observed in the OK series.
  EXPECT_NE(
      text.find(
          R"(diond_rpc_duration_seconds_sum{code="OK",method="/diond.v1.Optimizer/Step"} 0.004)"),
      std::string::npos)
      << text;
}

TEST(DaemonMetrics, StepGraphSeriesExistAtZeroAndCountByPhaseModeAndReason) {
  auto registry = std::make_shared<prometheus::Registry>();
  DaemonMetrics m(registry, {"1.2.3", "test:0", false});
  std::string text = Expose(*registry);
  // (prometheus-cpp writes the labels in name order.)
  for (const char* line :
       {"diond_step_graphs_total{mode=\"captured\",phase=\"read\"} 0",
        "diond_step_graphs_total{mode=\"replayed\",phase=\"update\"} 0",
        "diond_step_graphs_total{mode=\"replayed\",phase=\"write\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"update\",reason=\"unsupported\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"update\",reason=\"sync_point\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"update\",reason=\"capture_failed\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"update\",reason=\"world\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"read\",reason=\"pageable\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"write\",reason=\"capture_failed\"} 0"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  // Only the phases' possible reasons exist at zero.
  EXPECT_EQ(text.find("phase=\"read\",reason=\"world\""), std::string::npos) << text;
  EXPECT_EQ(text.find("phase=\"update\",reason=\"pageable\""), std::string::npos) << text;
  m.CountGraphStep("update", "captured");
  m.CountGraphStep("update", "replayed");
  m.CountGraphStep("update", "replayed");
  m.CountGraphStep("read", "replayed");
  m.CountGraphFallback("update", "sync_point");
  m.CountGraphFallback("write", "pageable");
  text = Expose(*registry);
  for (const char* line :
       {"diond_step_graphs_total{mode=\"captured\",phase=\"update\"} 1",
        "diond_step_graphs_total{mode=\"replayed\",phase=\"update\"} 2",
        "diond_step_graphs_total{mode=\"replayed\",phase=\"read\"} 1",
        "diond_step_graphs_total{mode=\"captured\",phase=\"read\"} 0",
        "diond_step_graph_fallbacks_total{phase=\"update\",reason=\"sync_point\"} 1",
        "diond_step_graph_fallbacks_total{phase=\"write\",reason=\"pageable\"} 1"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
}

TEST(DaemonMetrics, ReapedSessionsExistAtZeroAndCountByReason) {
  auto registry = std::make_shared<prometheus::Registry>();
  DaemonMetrics m(registry, {"1.2.3", "cpu", false});
  std::string text = Expose(*registry);
  for (const char* line : {"diond_sessions_reaped_total{reason=\"idle\"} 0\n",
                           "diond_sessions_reaped_total{reason=\"orphan\"} 0\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  m.CountSessionReaped("orphan");
  m.CountSessionReaped("orphan");
  m.CountSessionReaped("idle");
  text = Expose(*registry);
  for (const char* line : {"diond_sessions_reaped_total{reason=\"idle\"} 1\n",
                           "diond_sessions_reaped_total{reason=\"orphan\"} 2\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
}

TEST(DaemonMetrics, LimitsCheckpointsAndScrapeTimeSessionGauges) {
  auto registry = std::make_shared<prometheus::Registry>();
  BuildInfo info{"1.2.3", "cpu", false};
  info.openblas_core = "SkylakeX";
  info.openblas_core_source = "diond";
  info.fp32_gemm_auto = "openblas";
  info.bf16_matmul_auto = "onednn";
  info.engines_calibrated = true;
  DaemonMetrics m(registry, info);
  std::vector<std::shared_ptr<prometheus::Collectable>> sources = m.collectables();
  ASSERT_EQ(sources.size(), 2u);
  auto expose_all = [&] {
    std::string out;
    for (auto& s : sources) out += Expose(*s);
    return out;
  };
  // Defaults: no world, no limits, no source yet (zeros), never checkpointed.
  std::string text = expose_all();
  for (const char* line :
       {"diond_world_size 1\n", "diond_world_rank 0\n", "diond_memory_budget_bytes 0\n",
        "diond_state_bytes 0\n", "diond_checkpoint_steps_behind 0\n",
        "diond_checkpoint_last_success_timestamp_seconds 0\n",
        "diond_checkpoint_failures_total 0\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  Limits limits;
  limits.max_session_bytes = 1000;
  limits.memory_budget_bytes = 5000;
  limits.checkpoint_every = 50;
  limits.world_size = 4;
  limits.rank = 3;
  m.SetLimits(limits);
  int calls = 0;
  m.SetSessionSource([&calls] {
    ++calls;
    SessionTotals t;
    t.state_bytes = 4321;
    t.steps_behind = 77;
    return t;
  });
  m.CountCheckpointFailure();
  m.CountCheckpointFailure();
  // prometheus-cpp stamps with std::time; absl::Now can run microseconds ahead of it across a
  // second's boundary, so the lower bound comes from the same clock.
  const double before = static_cast<double>(std::time(nullptr));
  m.ObserveCheckpoint(10);
  text = expose_all();
  EXPECT_EQ(calls, 1);  // read at scrape time, once per scrape
  for (const char* line :
       {"diond_max_session_bytes 1000\n", "diond_memory_budget_bytes 5000\n",
        "diond_checkpoint_interval_steps 50\n", "diond_world_size 4\n", "diond_world_rank 3\n",
        "diond_state_bytes 4321\n", "diond_checkpoint_steps_behind 77\n",
        "diond_checkpoint_failures_total 2\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  const std::string key = "diond_checkpoint_last_success_timestamp_seconds ";
  size_t at = text.find("\n" + key);
  ASSERT_NE(at, std::string::npos) << text;
  const double stamp = std::stod(text.substr(at + 1 + key.size()));
  EXPECT_GE(stamp, before);
  EXPECT_LE(stamp, before + 3600);
  // Unset again (daemon shutdown): zeros, and the old source is not called any more.
  m.SetSessionSource(nullptr);
  text = expose_all();
  EXPECT_EQ(calls, 1);
  EXPECT_NE(text.find("diond_state_bytes 0\n"), std::string::npos) << text;
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
