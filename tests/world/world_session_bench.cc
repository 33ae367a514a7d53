// World-session benchmark (docs/BENCHMARKS.md "World sessions"): the 48 hidden matrices of
// GPT-2 small (12 layers × qkv 2304×768, proj 768×768, fc 3072×768, out 768×3072; 84.9M
// parameters) stepped by W = 1, 2, 4 real daemons on loopback with Muon, Dion (rank fraction 1/4)
// and Dion2 (fraction 1/4), REPLICATED. Per configuration: bytes per step per worker (counted by
// the communicator) next to the formula of docs/DISTRIBUTED.md, and step times.
//
// Not a ctest test (minutes of compute). Run:
//   build/tests/world/world_session_bench [--steps=N]
// It prints a Markdown table. Timing assertions: none; byte figures are checked within 5%.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

int g_steps = 3;  // the first is a warm-up

struct Algo {
  const char* name;
  AlgorithmKind kind;
};

// Floats one matrix contributes to the exchange (docs/DISTRIBUTED.md, step 4).
int64_t Payload(AlgorithmKind kind, int64_t m, int64_t n) {
  switch (kind) {
    case AlgorithmKind::kDion: {
      const int64_t r = optim::DionRank(m, n, 0.25, 1);
      return std::min(r * (m + n), m * n);
    }
    case AlgorithmKind::kDion2: {
      const bool rows = m <= n;
      const int64_t k = optim::SelectionCount(rows ? m : n, 0.25);
      return std::min(k * ((rows ? n : m) + 1), m * n);
    }
    default:
      return m * n;
  }
}

std::vector<std::vector<int64_t>> Gpt2SmallMatrices() {
  std::vector<std::vector<int64_t>> s;
  for (int layer = 0; layer < 12; ++layer) {
    s.push_back({2304, 768});
    s.push_back({768, 768});
    s.push_back({3072, 768});
    s.push_back({768, 3072});
  }
  return s;
}

std::vector<std::unique_ptr<Daemon>> StartWorld(int w) {
  std::vector<std::unique_ptr<Daemon>> d;
  const std::string threads = absl::StrCat("--compute_threads=", std::max(1, 2 / w));
  if (w == 1) {
    d.push_back(Daemon::Start({threads}, /*tcp=*/true));
    return d;
  }
  auto flags = [&](int r, int port) {
    std::vector<std::string> f = {absl::StrCat("--world_size=", w),
                                  absl::StrCat("--rank=", r),
                                  "--heartbeat_interval=500ms",
                                  "--peer_timeout=60s",
                                  threads,
                                  "--checksum_every=0"};
    if (r > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", port));
    return f;
  };
  d.push_back(Daemon::Start(flags(0, 0), true));
  for (int r = 1; r < w; ++r) d.push_back(Daemon::Start(flags(r, d[0]->tcp_port()), true));
  return d;
}

TEST(WorldSessionBench, Gpt2SmallHiddenMatrices) {
  const auto shapes = Gpt2SmallMatrices();
  std::printf(
      "| W | algorithm | bytes/step/worker | formula | vs Muon | step ms (median) | "
      "compute ms | exchange + other ms |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int w : {1, 2, 4}) {
    auto d = StartWorld(w);
    ASSERT_EQ(static_cast<int>(d.size()), w);
    double muon_bytes = 0;
    for (const Algo& a :
         {Algo{"Muon", AlgorithmKind::kMuon}, Algo{"Dion r=1/4", AlgorithmKind::kDion},
          Algo{"Dion2 α=1/4", AlgorithmKind::kDion2}}) {
      SessionDesc desc;
      GroupDesc g = MakeGroup("h", a.kind, 0.02);
      g.proto.mutable_hyperparameters()->set_rank_fraction(0.25);
      g.proto.mutable_hyperparameters()->set_fraction(0.25);
      desc.groups.push_back(g);
      for (size_t i = 0; i < shapes.size(); ++i) {
        desc.params.push_back({absl::StrCat("h", i / 4, ".", i % 4), shapes[i], "h"});
      }
      v1::CreateSessionRequest req = desc.Request();
      req.set_world_key(absl::StrCat("bench-", static_cast<int>(a.kind)));
      std::vector<std::unique_ptr<ShmSession>> s(static_cast<size_t>(w));
      {
        std::vector<std::thread> t;
        for (int r = 0; r < w; ++r) {
          t.emplace_back([&, r] { s[r] = CreateShmSession(d[r]->stub(), req); });
        }
        for (auto& th : t) th.join();
      }
      for (auto& p : s) ASSERT_NE(p, nullptr);
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < shapes.size(); ++i) {
          s[r]->params_seg->Write(s[r]->tensor(i).param_offset_bytes(),
                                  FloatBytes(SyntheticValues(1, 0, i, desc.Numel(i))));
        }
      }
      std::vector<double> step_ms, compute_ms;
      int64_t bytes = 0;
      for (int step = 1; step <= g_steps; ++step) {
        for (int r = 0; r < w; ++r) {
          for (size_t i = 0; i < shapes.size(); ++i) {
            s[r]->WriteGrad(i, SyntheticValues(2, step, i, desc.Numel(i)));
          }
        }
        std::vector<v1::StepResponse> resp(static_cast<size_t>(w));
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> t;
        for (int r = 0; r < w; ++r) {
          t.emplace_back([&, r] {
            grpc::Status st = DoStep(d[r]->stub(), s[r]->id, step, &resp[r]);
            EXPECT_TRUE(st.ok()) << st.error_message();
          });
        }
        for (auto& th : t) th.join();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        if (step == 1) continue;  // warm-up
        step_ms.push_back(ms);
        double worst_compute = 0;
        for (int r = 0; r < w; ++r) {
          worst_compute = std::max(worst_compute, resp[r].compute_micros() / 1000.0);
          bytes = std::max<int64_t>(bytes, resp[r].world_bytes_sent());
        }
        compute_ms.push_back(worst_compute);
      }
      double payload = 0;
      for (const auto& sh : shapes) payload += static_cast<double>(Payload(a.kind, sh[0], sh[1]));
      const double formula = w == 1 ? 0 : 4.0 * (w - 1) / w * payload + 4.0 * (w - 1);
      if (w > 1) {
        EXPECT_NEAR(static_cast<double>(bytes), formula, 0.05 * formula) << a.name;
      }
      if (a.kind == AlgorithmKind::kMuon) muon_bytes = static_cast<double>(bytes);
      std::sort(step_ms.begin(), step_ms.end());
      std::sort(compute_ms.begin(), compute_ms.end());
      const double med = step_ms[step_ms.size() / 2], cmed = compute_ms[compute_ms.size() / 2];
      std::printf("| %d | %s | %s | %s | %s | %.0f | %.0f | %.0f |\n", w, a.name,
                  absl::StrFormat("%.2f MB", bytes / 1e6).c_str(),
                  absl::StrFormat("%.2f MB", formula / 1e6).c_str(),
                  w == 1 ? "-" : absl::StrFormat("%.3f", bytes / muon_bytes).c_str(), med, cmed,
                  med - cmed);
      std::fflush(stdout);
      for (int r = 0; r < w; ++r) CloseSession(d[r]->stub(), s[r]->id);
    }
  }
}

}  // namespace
}  // namespace diond::service_testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--steps=", 0) == 0)
      diond::service_testing::g_steps = std::max(2, std::stoi(a.substr(8)));
  }
  return RUN_ALL_TESTS();
}
