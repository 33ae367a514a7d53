// World sessions across real diond daemons on loopback (docs/DISTRIBUTED.md): W daemons form a
// world, W trainer threads (one per daemon, each with its own shm arenas) create the same world
// session and step it together.
//
// Equivalence: every algorithm, with several public golden cases as parameters of one session
// (two same-shape parameters per case, so batches are split across ranks, and one group per
// case, so single matrices spread), must give after every step
//   * byte-identical parameter arenas on every rank, and
//   * the same bytes as the W = 1 path run in this process (fp32: owners run the single-process
//     code on the same inputs, so equality is exact, not within a tolerance).
// Bytes: the counted bytes per step match docs/DISTRIBUTED.md's formulas within 5%.
// Agreement: trainers that declare different sessions are refused with FAILED_PRECONDITION
// naming the ranks.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/golden_case.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

namespace fs = std::filesystem;
using optim::AlgorithmKind;

std::vector<std::string> WorldFlags(int rank, int w, int coordinator_port) {
  std::vector<std::string> f = {absl::StrCat("--world_size=", w), absl::StrCat("--rank=", rank),
                                "--heartbeat_interval=200ms", "--peer_timeout=3s",
                                "--checksum_every=4"};
  if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port));
  return f;
}

// W daemons forming one world (rank 0 first: it serves the rendezvous).
std::vector<std::unique_ptr<Daemon>> StartWorld(int w) {
  std::vector<std::unique_ptr<Daemon>> d;
  d.push_back(Daemon::Start(WorldFlags(0, w, 0), /*tcp=*/true));
  if (d[0] == nullptr) return {};
  for (int r = 1; r < w; ++r) {
    d.push_back(Daemon::Start(WorldFlags(r, w, d[0]->tcp_port()), /*tcp=*/true));
    if (d[r] == nullptr) return {};
  }
  return d;
}

// Runs f(rank) on W threads at once (the trainers) and joins them.
void OnAllRanks(int w, const std::function<void(int)>& f) {
  std::vector<std::thread> t;
  for (int r = 0; r < w; ++r) t.emplace_back(f, r);
  for (auto& th : t) th.join();
}

std::vector<std::string> VectorsOf(const std::string& prefix) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(DIOND_CONFORMANCE_VECTORS)) {
    const std::string f = e.path().filename().string();
    if (absl::StartsWith(f, prefix + "-") && e.path().extension() == ".safetensors") {
      files.push_back(e.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// One session with, per golden case k, group "g<k>" holding "p<k>a" and "p<k>b" (same shape).
struct MultiCase {
  SessionDesc desc;
  std::vector<GoldenCase> cases;
  std::vector<size_t> case_of;  // per parameter
  int64_t steps = 0;

  std::vector<float> Grad(size_t param, int64_t step) const {
    const GoldenCase& c = cases[case_of[param]];
    if (param % 2 == 0) return c.grads[static_cast<size_t>(step - 1)];
    std::vector<float> g =
        SyntheticValues(77, step, param, static_cast<int64_t>(c.param_init.size()));
    for (float& v : g) v *= 0.1f;
    return g;
  }
};

MultiCase Build(const std::string& algorithm_prefix,
                optim::Precision precision = optim::Precision::kFp32) {
  MultiCase m;
  for (const std::string& file : VectorsOf(algorithm_prefix)) {
    auto c = LoadGoldenCase(file);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) continue;
    const size_t k = m.cases.size();
    SessionDesc one = c->Session(precision);
    GroupDesc g = one.groups[0];
    g.proto.set_name(absl::StrCat("g", k));
    m.desc.groups.push_back(g);
    for (const char* suffix : {"a", "b"}) {
      m.desc.params.push_back({absl::StrCat("p", k, suffix), c->shape, absl::StrCat("g", k)});
      m.case_of.push_back(k);
    }
    m.steps = m.steps == 0 ? c->steps : std::min(m.steps, c->steps);
    m.cases.push_back(*std::move(c));
  }
  return m;
}

// The initial tensors every rank's trainer uploads (weights and golden initial state).
std::vector<Chunk> InitialChunks(const MultiCase& m) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    const GoldenCase& c = m.cases[m.case_of[i]];
    for (Chunk& ch : SplitTensor(m.desc.params[i].name, FloatBytes(c.param_init))) {
      chunks.push_back(std::move(ch));
    }
    for (const auto& [name, v] : c.state_init) {
      for (Chunk& ch : SplitTensor(m.desc.params[i].name + "/state." + name, FloatBytes(v))) {
        chunks.push_back(std::move(ch));
      }
    }
  }
  return chunks;
}

// Every algorithm in fp32, and the bf16-emulating orthogonalizers (owners run the same code; the
// exchange is fp32).
std::vector<std::pair<std::string, optim::Precision>> EveryAlgorithmAndPrecision() {
  std::vector<std::pair<std::string, optim::Precision>> runs;
  for (const std::string algo : {"muon", "normuon", "dion2", "nordion2", "dion", "adamw", "lion"}) {
    runs.push_back({algo, optim::Precision::kFp32});
  }
  for (const std::string algo : {"muon", "normuon", "dion2", "nordion2"}) {
    runs.push_back({algo, optim::Precision::kBf16Reference});
  }
  return runs;
}

// W = 1: the same groups in this process, from the golden cases' initial weights and state.
absl::StatusOr<std::unique_ptr<Replay>> InitialReplay(const MultiCase& m) {
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<Replay> replay, Replay::Create(m.desc));
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    const GoldenCase& c = m.cases[m.case_of[i]];
    replay->params()[i] = c.param_init;
    for (const auto& [name, v] : c.state_init) DIOND_RETURN_IF_ERROR(replay->SetState(i, name, v));
  }
  return replay;
}

class WorldSession : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    daemons_ = StartWorld(GetParam());
    ASSERT_EQ(static_cast<int>(daemons_.size()), GetParam());
  }
  // Creates world session `key` on every rank at once; empty on failure.
  std::vector<std::unique_ptr<ShmSession>> CreateEverywhere(const v1::CreateSessionRequest& req) {
    const int w = GetParam();
    std::vector<std::unique_ptr<ShmSession>> s(static_cast<size_t>(w));
    OnAllRanks(w, [&](int r) { s[r] = CreateShmSession(daemons_[r]->stub(), req); });
    for (auto& p : s) {
      if (p == nullptr) return {};
    }
    return s;
  }
  std::vector<std::unique_ptr<Daemon>> daemons_;
};

// Steps every rank once (concurrently); returns the responses.
std::vector<v1::StepResponse> StepAll(std::vector<std::unique_ptr<Daemon>>& d,
                                      std::vector<std::unique_ptr<ShmSession>>& s, int64_t step) {
  const int w = static_cast<int>(d.size());
  std::vector<v1::StepResponse> resp(static_cast<size_t>(w));
  OnAllRanks(w, [&](int r) {
    grpc::Status st = DoStep(d[r]->stub(), s[r]->id, step, &resp[r]);
    EXPECT_TRUE(st.ok()) << "rank " << r << " step " << step << ": " << st.error_message();
  });
  return resp;
}

TEST_P(WorldSession, EveryAlgorithmMatchesOneWorkerBitForBit) {
  const int w = GetParam();
  auto ctx = kernels::Context::CpuDefault();
  for (const auto& [algo, precision] : EveryAlgorithmAndPrecision()) {
    SCOPED_TRACE(absl::StrCat(algo, " ", optim::PrecisionName(precision)));
    MultiCase m = Build(algo, precision);
    ASSERT_FALSE(m.cases.empty());
    v1::CreateSessionRequest req = m.desc.Request();
    req.set_world_key(absl::StrCat("equiv-", algo, "-", optim::PrecisionName(precision)));
    auto s = CreateEverywhere(req);
    ASSERT_EQ(static_cast<int>(s.size()), w);
    const std::vector<Chunk> init = InitialChunks(m);
    for (int r = 0; r < w; ++r) ASSERT_TRUE(SetState(daemons_[r]->stub(), s[r]->id, init).ok());

    auto replay = InitialReplay(m);
    ASSERT_TRUE(replay.ok()) << replay.status();
    for (int64_t step = 1; step <= m.steps; ++step) {
      std::vector<std::vector<float>> grads;
      for (size_t i = 0; i < m.desc.params.size(); ++i) grads.push_back(m.Grad(i, step));
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < grads.size(); ++i) s[r]->WriteGrad(i, grads[i]);
      }
      const std::vector<std::vector<float>> before = (*replay)->params();
      ASSERT_TRUE((*replay)->Step(*ctx, grads).ok());
      auto resp = StepAll(daemons_, s, step);
      for (int r = 0; r < w; ++r) {
        EXPECT_GT(resp[r].world_bytes_sent(), 0) << "rank " << r;
        EXPECT_EQ(resp[r].update_norms().size(), m.desc.groups.size());
      }
      // update_norms: the whole group's change, the same on every rank.
      for (size_t k = 0; k < m.desc.groups.size(); ++k) {
        const std::string gname = absl::StrCat("g", k);
        double sq = 0;
        for (size_t i = 0; i < m.desc.params.size(); ++i) {
          if (m.desc.params[i].group != gname) continue;
          for (size_t e = 0; e < before[i].size(); ++e) {
            const double d = static_cast<double>((*replay)->params()[i][e]) - before[i][e];
            sq += d * d;
          }
        }
        for (int r = 0; r < w; ++r) {
          EXPECT_EQ(resp[r].update_norms().at(gname), resp[0].update_norms().at(gname));
          EXPECT_NEAR(resp[r].update_norms().at(gname), std::sqrt(sq), 1e-6 * std::sqrt(sq) + 1e-12)
              << gname << " rank " << r;
        }
      }
      for (size_t i = 0; i < m.desc.params.size(); ++i) {
        const std::string want = FloatBytes((*replay)->params()[i]);
        for (int r = 0; r < w; ++r) {
          ASSERT_EQ(s[r]->ParamBytes(i), want)
              << "rank " << r << ", parameter " << m.desc.params[i].name << ", step " << step;
        }
      }
    }
    for (int r = 0; r < w; ++r) EXPECT_TRUE(CloseSession(daemons_[r]->stub(), s[r]->id).ok());
  }
  // The checksum comparisons (--checksum_every=4) never found a differing replica.
  for (int r = 0; r < w; ++r)
    EXPECT_FALSE(absl::StrContains(daemons_[r]->Log(), "differs on rank"));
}

// --checksum_every=4: a replica that drifted (here: rank W−1's trainer scribbles on its weights;
// Dion2's compact exchange only overwrites the selected rows, so the drift survives a step) is
// found at the next check, logged, and healed with the owner's copy.
TEST_P(WorldSession, ChecksumsHealADriftedReplica) {
  const int w = GetParam();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("d2", AlgorithmKind::kDion2, 0.02));
  for (int j = 0; j < 6; ++j) desc.params.push_back({absl::StrCat("d", j), {24, 40}, "d2"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("checksums");
  auto s = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(s.size()), w);
  auto step_all = [&](int64_t step) {
    for (int r = 0; r < w; ++r) WriteSyntheticGrads(s[r].get(), desc, 6, step);
    StepAll(daemons_, s, step);
  };
  auto identical = [&] {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      for (int r = 1; r < w; ++r) {
        if (s[r]->ParamBytes(i) != s[0]->ParamBytes(i)) return false;
      }
    }
    return true;
  };
  for (int64_t step = 1; step <= 2; ++step) step_all(step);
  ASSERT_TRUE(identical());
  // Rank W−1's copy drifts: element 0 of every row of every parameter.
  const int bad = w - 1;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    std::vector<float> v = BytesToFloats(s[bad]->ParamBytes(i));
    for (size_t row = 0; row < 24; ++row) v[row * 40] += 0.5f;
    s[bad]->params_seg->Write(s[bad]->tensor(i).param_offset_bytes(), FloatBytes(v));
  }
  step_all(3);
  EXPECT_FALSE(identical()) << "the drift survives a step that is not a check";
  step_all(4);  // a check: healed
  EXPECT_TRUE(identical());
  for (int r = 0; r < w; ++r) {
    EXPECT_TRUE(absl::StrContains(daemons_[r]->Log(), absl::StrCat("differs on rank(s) ", bad)))
        << "rank " << r << " log:\n"
        << daemons_[r]->Log();
  }
}

// REPLICATED Muon: one all-gather-v of the owned updated matrices (fp32) plus one status value
// per rank; balanced plan (12 same-shape matrices) => 4·(W−1)·(Σmn/W + 1) bytes per rank.
TEST_P(WorldSession, MuonBytesPerStepMatchTheFormula) {
  const int w = GetParam();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  const int64_t mrows = 64, ncols = 48, count = 12;
  for (int j = 0; j < count; ++j)
    desc.params.push_back({absl::StrCat("w", j), {mrows, ncols}, "m"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("bytes-muon");
  auto s = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(s.size()), w);
  for (int64_t step = 1; step <= 3; ++step) {
    for (int r = 0; r < w; ++r) WriteSyntheticGrads(s[r].get(), desc, 5, step);
    auto resp = StepAll(daemons_, s, step);
    const double formula = 4.0 * (w - 1) / w * static_cast<double>(count * mrows * ncols);
    for (int r = 0; r < w; ++r) {
      const double got = static_cast<double>(resp[r].world_bytes_sent());
      EXPECT_NEAR(got, formula, 0.05 * formula) << "rank " << r << " step " << step;
    }
  }
}

// Sharded state: each rank holds the optimizer state of the parameters it owns and nothing else,
// so the ranks' state bytes add up to one worker's, and GetState on a rank lists exactly the
// owned parameters' state (every parameter's values).
TEST_P(WorldSession, OptimizerStateIsShardedAcrossRanks) {
  const int w = GetParam();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  desc.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
  for (int j = 0; j < 6; ++j) desc.params.push_back({absl::StrCat("w", j), {32, 24}, "m"});
  for (int j = 0; j < 3; ++j) desc.params.push_back({absl::StrCat("b", j), {40}, "a"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("sharded-state");
  auto s = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(s.size()), w);
  // One worker's state: Muon momentum 32*24 floats per matrix; AdamW m, v (40 each) + step_dev.
  const int64_t whole = 4 * (6 * 32 * 24 + 3 * (40 + 40 + 1));
  int64_t sum = 0;
  std::set<std::string> owned_everywhere;
  for (int r = 0; r < w; ++r) {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(daemons_[r]->stub().ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    sum += list.sessions(0).state_bytes();
    if (w > 1) {
      EXPECT_LT(list.sessions(0).state_bytes(), whole) << "rank " << r;
    }
    std::map<std::string, std::string> state;
    ASSERT_TRUE(GetState(daemons_[r]->stub(), s[r]->id, true, &state).ok());
    for (const auto& p : desc.params) {
      EXPECT_TRUE(state.count(p.name)) << p.name;
    }
    for (const auto& [name, bytes] : state) {
      if (name.find("/state.") == std::string::npos) continue;
      EXPECT_TRUE(owned_everywhere.insert(name).second)
          << name << " is held by two ranks (found again on rank " << r << ")";
    }
  }
  EXPECT_EQ(sum, whole);
  EXPECT_EQ(owned_everywhere.size(), 6u * 1 + 3u * 3) << "every state tensor held exactly once";
}

// AVERAGE: every trainer has its own gradients; the daemons average them (reduce-scatter to the
// owners). The weights follow one worker stepping on the mean gradient (within fp32 summation
// order: the ring adds the W contributions in its own order), identical on every rank; a NaN in
// one trainer's gradients makes every rank skip the step.
TEST_P(WorldSession, AverageFollowsOneWorkerOnTheMeanGradient) {
  const int w = GetParam();
  auto ctx = kernels::Context::CpuDefault();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  desc.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
  for (int j = 0; j < 5; ++j)
    desc.params.push_back({absl::StrCat("w", j), {32, 24 + 8 * (j % 2)}, "m"});
  for (int j = 0; j < 3; ++j) desc.params.push_back({absl::StrCat("b", j), {40}, "a"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("average");
  req.set_gradient_sync(v1::GRADIENT_SYNC_AVERAGE);
  auto s = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(s.size()), w);
  auto replay = Replay::Create(desc);
  ASSERT_TRUE(replay.ok());
  std::vector<Chunk> init;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    (*replay)->params()[i] = SyntheticValues(1, 0, i, desc.Numel(i));
    for (Chunk& c : SplitTensor(desc.params[i].name, FloatBytes((*replay)->params()[i]))) {
      init.push_back(std::move(c));
    }
  }
  for (int r = 0; r < w; ++r) ASSERT_TRUE(SetState(daemons_[r]->stub(), s[r]->id, init).ok());
  for (int64_t step = 1; step <= 5; ++step) {
    const bool poisoned = step == 3;
    std::vector<std::vector<float>> mean(desc.params.size());
    for (size_t i = 0; i < desc.params.size(); ++i) {
      mean[i].assign(static_cast<size_t>(desc.Numel(i)), 0.0f);
      for (int r = 0; r < w; ++r) {
        std::vector<float> g = SyntheticValues(100 + r, step, i, desc.Numel(i));
        if (poisoned && r == w - 1 && i == 0) g[3] = std::nanf("");
        s[r]->WriteGrad(i, g);
        for (size_t e = 0; e < g.size(); ++e) mean[i][e] += g[e];
      }
      for (float& v : mean[i]) v /= static_cast<float>(w);
    }
    auto resp = StepAll(daemons_, s, step);
    for (int r = 0; r < w; ++r) EXPECT_EQ(resp[r].skipped(), poisoned) << "rank " << r;
    if (!poisoned) {
      ASSERT_TRUE((*replay)->Step(*ctx, mean).ok());
    }
    for (size_t i = 0; i < desc.params.size(); ++i) {
      const std::string rank0 = s[0]->ParamBytes(i);
      for (int r = 1; r < w; ++r) {
        ASSERT_EQ(s[r]->ParamBytes(i), rank0) << "rank " << r << " param " << i << " step " << step;
      }
      EXPECT_LE(RelFro(BytesToFloats(rank0), (*replay)->params()[i]), 1e-5)
          << "param " << desc.params[i].name << " step " << step;
    }
  }
}

// AVERAGE Muon: reduce-scatter of the gradients + all-gather-v of the updated matrices,
// 2·4·(W−1)·(Σmn/W + 1) bytes per rank for a balanced plan.
TEST_P(WorldSession, AverageBytesPerStepMatchTheFormula) {
  const int w = GetParam();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  const int64_t mrows = 64, ncols = 48, count = 12;
  for (int j = 0; j < count; ++j)
    desc.params.push_back({absl::StrCat("w", j), {mrows, ncols}, "m"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("bytes-average");
  req.set_gradient_sync(v1::GRADIENT_SYNC_AVERAGE);
  auto s = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(s.size()), w);
  for (int64_t step = 1; step <= 2; ++step) {
    for (int r = 0; r < w; ++r) WriteSyntheticGrads(s[r].get(), desc, 9 + r, step);
    auto resp = StepAll(daemons_, s, step);
    const double formula = 8.0 * (w - 1) / w * static_cast<double>(count * mrows * ncols);
    for (int r = 0; r < w; ++r) {
      EXPECT_NEAR(static_cast<double>(resp[r].world_bytes_sent()), formula, 0.05 * formula)
          << "rank " << r << " step " << step;
    }
  }
}

// REPLICATED Dion (rank fraction 1/4) and Dion2/NorDion2 (fraction 1/4): the compact exchange.
// Per matrix: Dion r(m+n) floats (P and Q_new), Dion2 k(n+1) (k selected rows of n and their
// indices; m <= n), plus one status value per rank; balanced plan => 4(W−1)/W·Σ(payload) bytes.
TEST_P(WorldSession, CompactExchangeBytesMatchTheFormulas) {
  const int w = GetParam();
  struct Algo {
    const char* name;
    AlgorithmKind kind;
    int64_t payload;  // floats per 48x80 matrix
  };
  // Dion: r = 12 (1/4 of 48), a + b = 128; Dion2/NorDion2: k = 12 rows of 80, + 12 indices.
  for (const Algo& a :
       {Algo{"dion", AlgorithmKind::kDion, 12 * 128}, Algo{"dion2", AlgorithmKind::kDion2, 12 * 81},
        Algo{"nordion2", AlgorithmKind::kNorDion2, 12 * 81}}) {
    SCOPED_TRACE(a.name);
    SessionDesc desc;
    GroupDesc g = MakeGroup("x", a.kind, 0.02);
    g.proto.mutable_hyperparameters()->set_rank_fraction(0.25);
    g.config.hyperparams.rank_fraction = 0.25;
    desc.groups.push_back(g);
    const int64_t mrows = 48, ncols = 80, count = 12;
    for (int j = 0; j < count; ++j)
      desc.params.push_back({absl::StrCat("w", j), {mrows, ncols}, "x"});
    v1::CreateSessionRequest req = desc.Request();
    req.set_world_key(absl::StrCat("bytes-", a.name));
    auto s = CreateEverywhere(req);
    ASSERT_EQ(static_cast<int>(s.size()), w);
    for (int64_t step = 1; step <= 3; ++step) {
      for (int r = 0; r < w; ++r) WriteSyntheticGrads(s[r].get(), desc, 3, step);
      auto resp = StepAll(daemons_, s, step);
      const double formula = 4.0 * (w - 1) / w * static_cast<double>(count * a.payload);
      const double muon = 4.0 * (w - 1) / w * static_cast<double>(count * mrows * ncols);
      for (int r = 0; r < w; ++r) {
        const double got = static_cast<double>(resp[r].world_bytes_sent());
        EXPECT_NEAR(got, formula, 0.05 * formula) << "rank " << r << " step " << step;
        // The stated fraction of Muon's traffic: r(m+n)/mn = 0.4 (Dion), k(n+1)/mn ≈ 0.25 (Dion2).
        const double fraction = static_cast<double>(a.payload) / (mrows * ncols);
        EXPECT_NEAR(got / muon, fraction, 0.05 * fraction);
      }
      for (size_t i = 0; i < desc.params.size(); ++i) {
        for (int r = 1; r < w; ++r) ASSERT_EQ(s[r]->ParamBytes(i), s[0]->ParamBytes(i));
      }
    }
  }
}

// DION_COMPRESSED (ALGORITHMS.md §9.7): every rank keeps its own Dion momentum and averages only
// P = B_i·Q and R = B_iᵀ·P; in exact arithmetic the weights follow AVERAGE (Dion on the averaged
// momentum). With a different gradient per trainer, the two sessions must agree within fp32
// tolerance, every rank's weights must be identical, the Dion traffic must be
// 2(W−1)/W·r(m+n) floats per matrix, and a checkpoint must synchronize the momenta.
TEST_P(WorldSession, DionCompressedFollowsAverage) {
  const int w = GetParam();
  SessionDesc desc;
  GroupDesc g = MakeGroup("dion", AlgorithmKind::kDion, 0.02);
  g.proto.mutable_hyperparameters()->set_rank_fraction(0.25);
  g.config.hyperparams.rank_fraction = 0.25;
  desc.groups.push_back(g);
  desc.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
  // Sizes large enough that Gloo's chunked ring splits every all-reduce evenly (chunks of at
  // least 256 floats), so every rank sends the ring volume.
  for (int j = 0; j < 4; ++j) desc.params.push_back({absl::StrCat("w", j), {96, 160}, "dion"});
  for (int j = 0; j < 2; ++j) desc.params.push_back({absl::StrCat("v", j), {128, 64}, "dion"});
  desc.params.push_back({"bias", {40}, "a"});
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("compressed");
  req.set_gradient_sync(v1::GRADIENT_SYNC_DION_COMPRESSED);
  auto c = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(c.size()), w);
  req.set_world_key("averaged");
  req.set_gradient_sync(v1::GRADIENT_SYNC_AVERAGE);
  auto a = CreateEverywhere(req);
  ASSERT_EQ(static_cast<int>(a.size()), w);
  std::vector<Chunk> init;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    for (Chunk& ch :
         SplitTensor(desc.params[i].name, FloatBytes(SyntheticValues(2, 0, i, desc.Numel(i))))) {
      init.push_back(std::move(ch));
    }
  }
  for (int r = 0; r < w; ++r) {
    ASSERT_TRUE(SetState(daemons_[r]->stub(), c[r]->id, init).ok());
    ASSERT_TRUE(SetState(daemons_[r]->stub(), a[r]->id, init).ok());
  }
  // Floats per Dion matrix: r(m+n) with r = 24 (96x160) and r = 16 (128x64).
  const double dion_floats = 4 * 24 * (96 + 160) + 2 * 16 * (128 + 64);
  for (int64_t step = 1; step <= 5; ++step) {
    for (int r = 0; r < w; ++r) {
      for (size_t i = 0; i < desc.params.size(); ++i) {
        std::vector<float> grad = SyntheticValues(200 + r, step, i, desc.Numel(i));
        c[r]->WriteGrad(i, grad);
        a[r]->WriteGrad(i, grad);
      }
    }
    auto rc = StepAll(daemons_, c, step);
    StepAll(daemons_, a, step);
    for (size_t i = 0; i < desc.params.size(); ++i) {
      const std::string rank0 = c[0]->ParamBytes(i);
      for (int r = 1; r < w; ++r) {
        ASSERT_EQ(c[r]->ParamBytes(i), rank0) << "rank " << r << " param " << i << " step " << step;
      }
      EXPECT_LE(RelFro(BytesToFloats(rank0), BytesToFloats(a[0]->ParamBytes(i))), 1e-4)
          << "param " << desc.params[i].name << " step " << step;
    }
    // 2(W−1)/W·4·Σ r(m+n) for the two all-reduces, plus the AdamW bias's reduce-scatter and
    // exchange (40 + 1 floats each way, not divided by W: one owner).
    const double formula = 2.0 * (w - 1) / w * 4 * dion_floats + 2.0 * (w - 1) * 4 * (40 + 1);
    for (int r = 0; r < w; ++r) {
      EXPECT_NEAR(static_cast<double>(rc[r].world_bytes_sent()), formula, 0.05 * formula)
          << "rank " << r;
    }
  }
  // The decoupled momenta differ between ranks until a checkpoint synchronizes them.
  std::vector<TensorMap> before(static_cast<size_t>(w)), after(static_cast<size_t>(w));
  for (int r = 0; r < w; ++r)
    ASSERT_TRUE(GetState(daemons_[r]->stub(), c[r]->id, false, &before[r]).ok());
  EXPECT_NE(before[0]["w0/state.momentum"], before[1]["w0/state.momentum"]);
  EXPECT_EQ(before[0]["w0/state.Q"], before[1]["w0/state.Q"]) << "Q is identical everywhere";
  const std::string dir = ::diond::testing::MakeTempDir("diond_compressed_ckpt");
  OnAllRanks(w, [&](int r) {
    v1::SaveCheckpointRequest sreq;
    sreq.set_session_id(c[r]->id);
    sreq.set_directory(absl::StrCat(dir, "/rank", r));
    v1::SaveCheckpointResponse sresp;
    auto ctx = Ctx();
    grpc::Status st = daemons_[r]->stub().SaveCheckpoint(ctx.get(), sreq, &sresp);
    EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
  });
  for (int r = 0; r < w; ++r)
    ASSERT_TRUE(GetState(daemons_[r]->stub(), c[r]->id, false, &after[r]).ok());
  for (int r = 1; r < w; ++r) {
    for (const char* p : {"w0", "w3", "v1"}) {
      EXPECT_EQ(after[r][absl::StrCat(p, "/state.momentum")],
                after[0][absl::StrCat(p, "/state.momentum")])
          << "rank " << r << " " << p;
    }
  }
  // The synchronized momentum is the mean of the ranks' momenta.
  std::vector<float> mean(BytesToFloats(before[0]["w0/state.momentum"]).size(), 0.0f);
  for (int r = 0; r < w; ++r) {
    auto m = BytesToFloats(before[r]["w0/state.momentum"]);
    for (size_t e = 0; e < m.size(); ++e) mean[e] += m[e] / static_cast<float>(w);
  }
  EXPECT_LE(RelFro(BytesToFloats(after[0]["w0/state.momentum"]), mean), 1e-6);
}

// StepRequest.params_without_grad (torch.optim's `p.grad is None`) in a world of two: every
// algorithm in both precisions. Independent expectations: a parameter without a gradient keeps
// its weights and every rank's copy of its state byte for byte (its gradient holds NaNs, so a
// read of it would show), and every rank holds exactly what one worker running the same groups
// with null gradients for those parameters holds.
class WorldSessionOfTwo : public WorldSession {};

TEST_P(WorldSessionOfTwo, ParamsWithoutGradKeepWeightsAndStateOnEveryRank) {
  const int w = GetParam();
  auto ctx = kernels::Context::CpuDefault();
  for (const auto& [algo, precision] : EveryAlgorithmAndPrecision()) {
    SCOPED_TRACE(absl::StrCat(algo, " ", optim::PrecisionName(precision)));
    MultiCase m = Build(algo, precision);
    ASSERT_FALSE(m.cases.empty());
    const size_t n = m.desc.params.size();
    v1::CreateSessionRequest req = m.desc.Request();
    req.set_world_key(absl::StrCat("nograd-", algo, "-", optim::PrecisionName(precision)));
    auto s = CreateEverywhere(req);
    ASSERT_EQ(static_cast<int>(s.size()), w);
    const std::vector<Chunk> init = InitialChunks(m);
    for (int r = 0; r < w; ++r) ASSERT_TRUE(SetState(daemons_[r]->stub(), s[r]->id, init).ok());
    auto replay = InitialReplay(m);
    ASSERT_TRUE(replay.ok()) << replay.status();
    // Step 1: every gradient; 2: two parameters without; 3: one; 4: the whole first group.
    const std::vector<std::vector<int32_t>> masks = {{}, {0, 3}, {1}, {0, 1}};
    const int64_t steps = std::min<int64_t>(m.steps, static_cast<int64_t>(masks.size()));
    for (int64_t step = 1; step <= steps; ++step) {
      const std::vector<int32_t>& mask = masks[static_cast<size_t>(step - 1)];
      std::vector<bool> no_grad(n, false);
      for (int32_t i : mask) {
        if (static_cast<size_t>(i) < n) no_grad[static_cast<size_t>(i)] = true;
      }
      std::vector<int32_t> sent;
      for (size_t i = 0; i < n; ++i) {
        if (no_grad[i]) sent.push_back(static_cast<int32_t>(i));
      }
      std::vector<std::vector<float>> grads;
      for (size_t i = 0; i < n; ++i) {
        grads.push_back(m.Grad(i, step));
        std::vector<float> written = grads.back();
        if (no_grad[i]) written.assign(written.size(), std::nanf(""));
        for (int r = 0; r < w; ++r) s[r]->WriteGrad(i, written);
      }
      std::vector<std::vector<std::string>> before(static_cast<size_t>(w));
      std::vector<TensorMap> state_before(static_cast<size_t>(w)),
          state_after(static_cast<size_t>(w));
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < n; ++i) before[r].push_back(s[r]->ParamBytes(i));
        ASSERT_TRUE(GetState(daemons_[r]->stub(), s[r]->id, false, &state_before[r]).ok());
      }
      ASSERT_TRUE((*replay)->Step(*ctx, grads, no_grad).ok());
      std::vector<v1::StepResponse> resp(static_cast<size_t>(w));
      OnAllRanks(w, [&](int r) {
        grpc::Status st = DoStepWithout(daemons_[r]->stub(), s[r]->id, step, sent, &resp[r]);
        EXPECT_TRUE(st.ok()) << "rank " << r << " step " << step << ": " << st.error_message();
      });
      for (int r = 0; r < w; ++r) {
        EXPECT_FALSE(resp[r].skipped()) << "rank " << r << ": a NaN it should not have read";
        ASSERT_TRUE(GetState(daemons_[r]->stub(), s[r]->id, false, &state_after[r]).ok());
      }
      for (size_t i = 0; i < n; ++i) {
        const std::string want = FloatBytes((*replay)->params()[i]);
        for (int r = 0; r < w; ++r) {
          const std::string got = s[r]->ParamBytes(i);
          ASSERT_EQ(got, want) << "rank " << r << ", " << m.desc.params[i].name << ", step "
                               << step;
          if (!no_grad[i]) continue;
          EXPECT_EQ(got, before[r][i]) << "rank " << r << ", " << m.desc.params[i].name;
          const std::string prefix = m.desc.params[i].name + "/state.";
          for (const auto& [k, v] : state_before[r]) {
            if (absl::StartsWith(k, prefix)) {
              EXPECT_EQ(state_after[r][k], v) << "rank " << r << " " << k;
            }
          }
        }
      }
    }
    for (int r = 0; r < w; ++r) EXPECT_TRUE(CloseSession(daemons_[r]->stub(), s[r]->id).ok());
  }
}

// AVERAGE: a parameter is stepped when any rank's trainer has its gradient (the others add
// zeros, as DDP does); under REPLICATED the ranks must agree, else every rank refuses the step
// and nothing changes; a retry with agreeing sets then applies it.
TEST_P(WorldSessionOfTwo, ParamsWithoutGradAcrossRanks) {
  const int w = GetParam();
  auto ctx = kernels::Context::CpuDefault();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  desc.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
  for (int j = 0; j < 3; ++j) desc.params.push_back({absl::StrCat("w", j), {32, 24}, "m"});
  for (int j = 0; j < 2; ++j) desc.params.push_back({absl::StrCat("b", j), {40}, "a"});
  const size_t n = desc.params.size();
  std::vector<Chunk> init;
  std::vector<std::vector<float>> start(n);
  for (size_t i = 0; i < n; ++i) {
    start[i] = SyntheticValues(1, 0, i, desc.Numel(i));
    for (Chunk& c : SplitTensor(desc.params[i].name, FloatBytes(start[i])))
      init.push_back(std::move(c));
  }
  // Rank 0's trainer has no gradient for w0 and b0; no rank has one for w2.
  auto mask_of = [](int r) {
    return r == 0 ? std::vector<int32_t>{0, 2, 3} : std::vector<int32_t>{2};
  };
  {
    v1::CreateSessionRequest req = desc.Request();
    req.set_world_key("nograd-average");
    req.set_gradient_sync(v1::GRADIENT_SYNC_AVERAGE);
    auto s = CreateEverywhere(req);
    ASSERT_EQ(static_cast<int>(s.size()), w);
    for (int r = 0; r < w; ++r) ASSERT_TRUE(SetState(daemons_[r]->stub(), s[r]->id, init).ok());
    auto replay = Replay::Create(desc);
    ASSERT_TRUE(replay.ok());
    (*replay)->params() = start;
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<std::vector<float>> mean(n);
      std::vector<bool> no_grad(n, false);
      no_grad[2] = true;
      for (size_t i = 0; i < n; ++i) {
        mean[i].assign(static_cast<size_t>(desc.Numel(i)), 0.0f);
        for (int r = 0; r < w; ++r) {
          const std::vector<int32_t> mask = mask_of(r);
          const bool none =
              std::find(mask.begin(), mask.end(), static_cast<int32_t>(i)) != mask.end();
          std::vector<float> g = SyntheticValues(100 + r, step, i, desc.Numel(i));
          if (none) g.assign(g.size(), std::nanf(""));  // never read
          s[r]->WriteGrad(i, g);
          if (!none) {
            for (size_t e = 0; e < g.size(); ++e) mean[i][e] += g[e];
          }
        }
        for (float& v : mean[i]) v /= static_cast<float>(w);
      }
      std::vector<v1::StepResponse> resp(static_cast<size_t>(w));
      OnAllRanks(w, [&](int r) {
        grpc::Status st = DoStepWithout(daemons_[r]->stub(), s[r]->id, step, mask_of(r), &resp[r]);
        EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
      });
      ASSERT_TRUE((*replay)->Step(*ctx, mean, no_grad).ok());
      for (size_t i = 0; i < n; ++i) {
        const std::string rank0 = s[0]->ParamBytes(i);
        for (int r = 1; r < w; ++r) ASSERT_EQ(s[r]->ParamBytes(i), rank0) << "param " << i;
        // The same tolerance as AverageFollowsOneWorkerOnTheMeanGradient (the ring's sum order).
        EXPECT_LE(RelFro(BytesToFloats(rank0), (*replay)->params()[i]), 1e-5)
            << desc.params[i].name << " step " << step;
      }
      EXPECT_EQ(s[0]->ParamBytes(2), FloatBytes(start[2])) << "w2 has no gradient anywhere";
    }
  }
  {
    v1::CreateSessionRequest req = desc.Request();
    req.set_world_key("nograd-replicated");
    auto s = CreateEverywhere(req);
    ASSERT_EQ(static_cast<int>(s.size()), w);
    for (int r = 0; r < w; ++r) {
      ASSERT_TRUE(SetState(daemons_[r]->stub(), s[r]->id, init).ok());
      WriteSyntheticGrads(s[r].get(), desc, 5, 1);
    }
    std::vector<grpc::Status> st(static_cast<size_t>(w));
    OnAllRanks(w,
               [&](int r) { st[r] = DoStepWithout(daemons_[r]->stub(), s[r]->id, 1, mask_of(r)); });
    for (int r = 0; r < w; ++r) {
      EXPECT_EQ(st[r].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "rank " << r;
      EXPECT_THAT(st[r].error_message(), ::testing::HasSubstr("must name the same"));
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(s[r]->ParamBytes(i), FloatBytes(start[i]));
    }
    OnAllRanks(w, [&](int r) { st[r] = DoStepWithout(daemons_[r]->stub(), s[r]->id, 1, {2}); });
    for (int r = 0; r < w; ++r) {
      EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
      EXPECT_NE(s[r]->ParamBytes(0), FloatBytes(start[0]));
      EXPECT_EQ(s[r]->ParamBytes(2), FloatBytes(start[2]));
    }
  }
}

TEST_P(WorldSession, DisagreeingTrainersAreRefusedNamingTheRanks) {
  const int w = GetParam();
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  desc.params.push_back({"w", {16, 8}, "m"});
  std::vector<grpc::Status> st(static_cast<size_t>(w));
  OnAllRanks(w, [&](int r) {
    SessionDesc mine = desc;
    if (r == w - 1) mine.params[0].shape = {16, 9};  // the last rank's trainer differs
    v1::CreateSessionRequest req = mine.Request();
    req.set_world_key("disagree");
    v1::CreateSessionResponse resp;
    auto c = Ctx();
    st[r] = daemons_[r]->stub().CreateSession(c.get(), req, &resp);
  });
  for (int r = 0; r < w; ++r) {
    EXPECT_EQ(st[r].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st[r].error_message();
    const std::string named = r == w - 1 ? "rank(s) 0" : absl::StrCat("rank(s) ", w - 1);
    EXPECT_TRUE(absl::StrContains(st[r].error_message(), named)) << st[r].error_message();
  }
}

// Failure: a SIGKILLed daemon makes the survivors' pending Steps fail with UNAVAILABLE within the
// peer timeout (no hang); the daemon restarts, the world rebuilds, every rank loads its
// checkpoint of the same step (a consistent cut: --checkpoint_every writes each rank's owned
// state after the same step), and the run continues to the same bits as an uninterrupted one.
// Muon m0..m3 (32x24), Dion2 d0..d2 (24x40) and an AdamW bias (24): the session of the
// failure and elastic tests.
SessionDesc MixedSession() {
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  desc.groups.push_back(MakeGroup("d2", AlgorithmKind::kDion2, 0.02));
  desc.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
  for (int j = 0; j < 4; ++j) desc.params.push_back({absl::StrCat("m", j), {32, 24}, "m"});
  for (int j = 0; j < 3; ++j) desc.params.push_back({absl::StrCat("d", j), {24, 40}, "d2"});
  desc.params.push_back({"bias", {24}, "a"});
  return desc;
}

// The gradients of `step`: SyntheticValues(seed, step) for every parameter.
std::vector<std::vector<float>> SyntheticGrads(const SessionDesc& desc, uint64_t seed,
                                               int64_t step) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    g.push_back(SyntheticValues(seed, step, i, desc.Numel(i)));
  }
  return g;
}

// The uninterrupted run (W = 1, in this process) of `desc` from SyntheticValues(init_seed)
// weights over SyntheticGrads(grad_seed) steps 1..`steps`: the initial weights as chunks, and
// (*expected)[step][param] the weights after each step.
void ReferenceRun(const SessionDesc& desc, uint64_t init_seed, uint64_t grad_seed, int64_t steps,
                  std::vector<Chunk>* init,
                  std::vector<std::vector<std::vector<float>>>* expected) {
  auto ctx = kernels::Context::CpuDefault();
  auto replay = Replay::Create(desc);
  ASSERT_TRUE(replay.ok());
  for (size_t i = 0; i < desc.params.size(); ++i) {
    (*replay)->params()[i] = SyntheticValues(init_seed, 0, i, desc.Numel(i));
    for (Chunk& c : SplitTensor(desc.params[i].name, FloatBytes((*replay)->params()[i]))) {
      init->push_back(std::move(c));
    }
  }
  expected->resize(static_cast<size_t>(steps) + 1);
  for (int64_t step = 1; step <= steps; ++step) {
    ASSERT_TRUE((*replay)->Step(*ctx, SyntheticGrads(desc, grad_seed, step)).ok());
    (*expected)[step] = (*replay)->params();
  }
}

TEST(WorldSessionFailure, KillRestartResumeFromCheckpoint) {
  constexpr int w = 3;
  constexpr absl::Duration kPeerTimeout = absl::Seconds(3);
  std::vector<std::string> state(w);
  std::vector<std::unique_ptr<Daemon>> d(w);
  auto flags = [&](int r, int port) {
    std::vector<std::string> f = WorldFlags(r, w, port);
    f.push_back("--state_dir=" + state[r]);
    f.push_back("--checkpoint_every=2");
    return f;
  };
  for (int r = 0; r < w; ++r)
    state[r] = ::diond::testing::MakeTempDir(absl::StrCat("diond_ws_state", r));
  d[0] = Daemon::Start(flags(0, 0), /*tcp=*/true);
  ASSERT_NE(d[0], nullptr);
  const int port = d[0]->tcp_port();
  for (int r = 1; r < w; ++r) {
    d[r] = Daemon::Start(flags(r, port), /*tcp=*/true);
    ASSERT_NE(d[r], nullptr);
  }
  const SessionDesc desc = MixedSession();
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("resume");
  auto grads = [&](int64_t step) { return SyntheticGrads(desc, 8, step); };
  std::vector<Chunk> init;
  std::vector<std::vector<std::vector<float>>> expected;
  ASSERT_NO_FATAL_FAILURE(ReferenceRun(desc, 4, 8, 8, &init, &expected));

  std::vector<std::unique_ptr<ShmSession>> s(w);
  OnAllRanks(w, [&](int r) { s[r] = CreateShmSession(d[r]->stub(), req); });
  for (int r = 0; r < w; ++r) {
    ASSERT_NE(s[r], nullptr);
    ASSERT_TRUE(SetState(d[r]->stub(), s[r]->id, init).ok());
  }
  auto run_steps = [&](int64_t from, int64_t to) {
    for (int64_t step = from; step <= to; ++step) {
      auto g = grads(step);
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < g.size(); ++i) s[r]->WriteGrad(i, g[i]);
      }
      StepAll(d, s, step);
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < g.size(); ++i) {
          ASSERT_EQ(s[r]->ParamBytes(i), FloatBytes(expected[step][i]))
              << "rank " << r << " param " << i << " step " << step;
        }
      }
    }
  };
  run_steps(1, 5);  // checkpoints after steps 2 and 4 on every rank

  // Step 6 is pending on ranks 0 and 1 (waiting for rank 2) when rank 2 is killed.
  auto g6 = grads(6);
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < g6.size(); ++i) s[r]->WriteGrad(i, g6[i]);
  }
  std::vector<grpc::Status> pending(w - 1);
  std::vector<absl::Time> answered(w - 1);
  std::vector<std::thread> trainers;
  for (int r = 0; r < w - 1; ++r) {
    trainers.emplace_back([&, r] {
      pending[r] = DoStep(d[r]->stub(), s[r]->id, 6);
      answered[r] = absl::Now();
    });
  }
  absl::SleepFor(absl::Milliseconds(500));
  const std::vector<std::string> victim_flags = flags(w - 1, port);
  const std::string victim_dir = d[w - 1]->dir();
  const std::string victim_session = s[w - 1]->id;
  d[w - 1]->Kill();
  const absl::Time killed = absl::Now();
  for (auto& t : trainers) t.join();
  for (int r = 0; r < w - 1; ++r) {
    EXPECT_EQ(pending[r].error_code(), grpc::StatusCode::UNAVAILABLE)
        << "rank " << r << ": " << pending[r].error_message();
    EXPECT_LE(answered[r] - killed, kPeerTimeout + absl::Seconds(1)) << "rank " << r;
    std::cout << "rank " << r << " answered " << absl::FormatDuration(answered[r] - killed)
              << " after the kill: " << pending[r].error_message() << "\n";
    EXPECT_TRUE(absl::StrContains(pending[r].error_message(), "rank 2"))
        << pending[r].error_message();
    // New steps fail at once, too.
    grpc::Status again = DoStep(d[r]->stub(), s[r]->id, 6);
    EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAVAILABLE) << again.error_message();
  }

  // Restart rank 2 on its own state directory; resume everybody from the last common checkpoint.
  s[w - 1].reset();
  d[w - 1] = Daemon::Start(victim_flags, /*tcp=*/true, victim_dir);
  ASSERT_NE(d[w - 1], nullptr);
  std::vector<std::string> ids(w);
  for (int r = 0; r < w; ++r) ids[r] = r == w - 1 ? victim_session : s[r]->id;
  int64_t cut = 1 << 30;
  for (int r = 0; r < w; ++r) {
    int64_t latest = 0;
    for (const auto& e : fs::directory_iterator(state[r] + "/" + ids[r])) {
      const std::string n = e.path().filename().string();
      if (absl::StartsWith(n, "step-")) latest = std::max<int64_t>(latest, std::stoll(n.substr(5)));
    }
    cut = std::min(cut, latest);
  }
  ASSERT_EQ(cut, 4);
  for (int r = 0; r < w - 1; ++r) EXPECT_TRUE(CloseSession(d[r]->stub(), s[r]->id).ok());
  std::vector<std::unique_ptr<ShmSession>> resumed(w);
  OnAllRanks(w, [&](int r) {
    v1::LoadCheckpointRequest lreq;
    lreq.set_path(absl::StrCat(state[r], "/", ids[r], "/step-", cut));
    v1::LoadCheckpointResponse lresp;
    auto c = Ctx();
    grpc::Status st = d[r]->stub().LoadCheckpoint(c.get(), lreq, &lresp);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
    resumed[r] = BindShmSession(d[r]->stub(), lresp.session());
  });
  for (int r = 0; r < w; ++r) ASSERT_NE(resumed[r], nullptr);
  s = std::move(resumed);
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      ASSERT_EQ(s[r]->ParamBytes(i), FloatBytes(expected[cut][i])) << "restored, rank " << r;
    }
  }
  run_steps(cut + 1, 8);
}

// A daemon without a world (--world_size=1) runs a world session as a world of one: every mode is
// accepted, nothing is sent, and the weights are those of a local session.
// A world session's CreateSession waits for the same session on the other ranks, and a Step for
// their part of the collectives. Those waits must not hold gRPC's callback threads (cores / 2, at
// least 2, for the whole process): two of them on a two-core rank 0 would leave no thread for any
// other call, so it would answer nothing (not a ListSessions) and serve no heartbeat (the other
// ranks would be declared lost after --peer_timeout). The handlers wait on the service's own pool
// (server/rpc/handler_pool.h). 20 waits are more than gRPC's 16-thread cap on any machine.
TEST(WorldSessionWaits, TheDaemonServesOtherCallsWhileWorldSessionsWaitForTheirPeers) {
  constexpr int kWaiting = 20;
  auto d = StartWorld(2);
  ASSERT_EQ(d.size(), 2u);
  const SessionDesc desc = TwoMatricesAndABias(AlgorithmKind::kMuon);
  auto request = [&](int k) {
    v1::CreateSessionRequest req = desc.Request();
    req.set_world_key(absl::StrCat("wait-", k));
    return req;
  };
  std::vector<std::string> ids[2];
  ids[0].resize(kWaiting);
  ids[1].resize(kWaiting);
  auto create_all = [&](int rank) {
    std::vector<std::thread> t;
    for (int k = 0; k < kWaiting; ++k) {
      t.emplace_back([&, k, rank] {
        auto ctx = Ctx();
        v1::CreateSessionResponse resp;
        grpc::Status s = d[rank]->stub().CreateSession(ctx.get(), request(k), &resp);
        EXPECT_TRUE(s.ok()) << "rank " << rank << ", session " << k << ": " << s.error_message();
        ids[rank][k] = resp.session_id();
      });
    }
    return t;
  };
  // Rank 0's trainers create their world sessions; rank 1's have not yet: all 20 wait.
  std::vector<std::thread> rank0 = create_all(0);
  absl::SleepFor(absl::Milliseconds(500));
  // Rank 0 still answers at once, and still serves rank 1's heartbeats past --peer_timeout (3s).
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ListSessionsResponse list;
    grpc::Status s = d[0]->stub().ListSessions(&ctx, v1::ListSessionsRequest(), &list);
    EXPECT_TRUE(s.ok()) << "ListSessions while " << kWaiting
                        << " world CreateSessions wait: " << s.error_message();
    absl::SleepFor(absl::Seconds(1));
  }
  EXPECT_FALSE(absl::StrContains(d[0]->Log(), "lost")) << d[0]->Log();
  // Rank 1's trainers come: every session is created on both ranks.
  std::vector<std::thread> rank1 = create_all(1);
  for (auto& t : rank0) t.join();
  for (auto& t : rank1) t.join();
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < kWaiting; ++k) {
      EXPECT_FALSE(ids[r][k].empty()) << "rank " << r << ", session " << k;
      if (!ids[r][k].empty()) {
        EXPECT_TRUE(CloseSession(d[r]->stub(), ids[r][k]).ok());
      }
    }
  }
}

TEST(WorldSessionOfOne, RunsLikeALocalSession) {
  auto d = Daemon::Start();
  ASSERT_NE(d, nullptr);
  auto ctx = kernels::Context::CpuDefault();
  for (v1::GradientSync sync : {v1::GRADIENT_SYNC_REPLICATED, v1::GRADIENT_SYNC_AVERAGE,
                                v1::GRADIENT_SYNC_DION_COMPRESSED}) {
    SCOPED_TRACE(v1::GradientSync_Name(sync));
    SessionDesc desc;
    GroupDesc dion = MakeGroup("dion", AlgorithmKind::kDion, 0.02);
    dion.proto.mutable_hyperparameters()->set_rank_fraction(0.25);
    dion.config.hyperparams.rank_fraction = 0.25;
    desc.groups.push_back(dion);
    desc.groups.push_back(MakeGroup("d2", AlgorithmKind::kDion2, 0.02));
    desc.params.push_back({"a", {48, 80}, "dion"});
    desc.params.push_back({"b", {24, 40}, "d2"});
    v1::CreateSessionRequest req = desc.Request();
    req.set_world_key("alone");
    req.set_gradient_sync(sync);
    auto s = CreateShmSession(d->stub(), req);
    ASSERT_NE(s, nullptr);
    auto replay = Replay::Create(desc);
    ASSERT_TRUE(replay.ok());
    std::vector<Chunk> init;
    for (size_t i = 0; i < desc.params.size(); ++i) {
      (*replay)->params()[i] = SyntheticValues(3, 0, i, desc.Numel(i));
      for (Chunk& c : SplitTensor(desc.params[i].name, FloatBytes((*replay)->params()[i]))) {
        init.push_back(std::move(c));
      }
    }
    ASSERT_TRUE(SetState(d->stub(), s->id, init).ok());
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<std::vector<float>> g;
      for (size_t i = 0; i < desc.params.size(); ++i) {
        g.push_back(SyntheticValues(4, step, i, desc.Numel(i)));
        s->WriteGrad(i, g.back());
      }
      ASSERT_TRUE((*replay)->Step(*ctx, g).ok());
      v1::StepResponse resp;
      ASSERT_TRUE(DoStep(d->stub(), s->id, step, &resp).ok());
      EXPECT_EQ(resp.world_bytes_sent(), 0);
      for (size_t i = 0; i < desc.params.size(); ++i) {
        ASSERT_EQ(s->ParamBytes(i), FloatBytes((*replay)->params()[i])) << "step " << step;
      }
    }
    EXPECT_TRUE(CloseSession(d->stub(), s->id).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(W, WorldSession, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return absl::StrCat("W", info.param); });
INSTANTIATE_TEST_SUITE_P(W, WorldSessionOfTwo, ::testing::Values(2));

// Elastic restore: the checkpoints of a world of W_old ranks restored into a world of
// W_new ranks. Every new rank loads one old rank's checkpoint with the others' as shard_paths and
// keeps its share under the new shard plan; K more steps equal the uninterrupted W = 1 run bit
// for bit (Muon, Dion2 and AdamW are deterministic).
class WorldSessionElastic : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(WorldSessionElastic, CheckpointRestoresIntoAnotherWorldSizeBitExact) {
  // Not a structured binding: lambdas below use w_old, and C++17 forbids capturing one (clang).
  const int w_old = std::get<0>(GetParam());
  const int w_new = std::get<1>(GetParam());
  const SessionDesc desc = MixedSession();
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("elastic");
  auto grads = [&](int64_t step) { return SyntheticGrads(desc, 18, step); };
  std::vector<Chunk> init;
  std::vector<std::vector<std::vector<float>>> expected;
  ASSERT_NO_FATAL_FAILURE(ReferenceRun(desc, 14, 18, 8, &init, &expected));
  auto start_world = [&](int w, std::vector<std::string>* state) {
    std::vector<std::unique_ptr<Daemon>> d(w);
    state->resize(w);
    for (int r = 0; r < w; ++r) {
      (*state)[r] = ::diond::testing::MakeTempDir(absl::StrCat("diond_elastic", r));
    }
    auto flags = [&](int r, int port) {
      std::vector<std::string> f = WorldFlags(r, w, port);
      f.push_back("--state_dir=" + (*state)[r]);
      f.push_back("--checkpoint_every=2");
      return f;
    };
    d[0] = Daemon::Start(flags(0, 0), /*tcp=*/true);
    if (d[0] == nullptr) return d;
    for (int r = 1; r < w; ++r) d[r] = Daemon::Start(flags(r, d[0]->tcp_port()), /*tcp=*/true);
    return d;
  };
  auto run_steps = [&](std::vector<std::unique_ptr<Daemon>>& d,
                       std::vector<std::unique_ptr<ShmSession>>& s, int64_t from, int64_t to) {
    for (int64_t step = from; step <= to; ++step) {
      auto g = grads(step);
      for (auto& sr : s) {
        for (size_t i = 0; i < g.size(); ++i) sr->WriteGrad(i, g[i]);
      }
      StepAll(d, s, step);
      for (size_t r = 0; r < s.size(); ++r) {
        for (size_t i = 0; i < g.size(); ++i) {
          ASSERT_EQ(s[r]->ParamBytes(i), FloatBytes(expected[step][i]))
              << "W=" << s.size() << " rank " << r << " param " << i << " step " << step;
        }
      }
    }
  };

  // The old world: 4 steps, checkpoints after steps 2 and 4 on every rank.
  std::vector<std::string> old_state;
  auto d = start_world(w_old, &old_state);
  for (auto& x : d) ASSERT_NE(x, nullptr);
  std::vector<std::unique_ptr<ShmSession>> s(w_old);
  OnAllRanks(w_old, [&](int r) { s[r] = CreateShmSession(d[r]->stub(), req); });
  for (int r = 0; r < w_old; ++r) {
    ASSERT_NE(s[r], nullptr);
    ASSERT_TRUE(SetState(d[r]->stub(), s[r]->id, init).ok());
  }
  run_steps(d, s, 1, 4);
  int64_t old_total = 0;  // state bytes of all old ranks together: one copy, sharded
  for (int r = 0; r < w_old; ++r) {
    v1::ListSessionsResponse list;
    ASSERT_TRUE(d[r]->stub().ListSessions(Ctx().get(), {}, &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    old_total += list.sessions(0).state_bytes();
  }
  std::vector<std::string> old_paths;
  for (int r = 0; r < w_old; ++r) {
    old_paths.push_back(absl::StrCat(old_state[r], "/", s[r]->id, "/step-4"));
  }
  s.clear();
  for (auto& x : d) x->Kill();
  d.clear();

  // The new world: each rank loads "its" old checkpoint plus the others as shards.
  std::vector<std::string> new_state;
  d = start_world(w_new, &new_state);
  for (auto& x : d) ASSERT_NE(x, nullptr);
  // Without the other ranks' shards the new share is incomplete: refused, naming a tensor.
  if (w_new != w_old) {
    std::vector<grpc::Status> alone(w_new);
    OnAllRanks(w_new, [&](int r) {
      v1::LoadCheckpointRequest lreq;
      lreq.set_path(old_paths[r % w_old]);
      v1::LoadCheckpointResponse lresp;
      alone[r] = d[r]->stub().LoadCheckpoint(Ctx().get(), lreq, &lresp);
    });
    bool refused = false;
    for (const grpc::Status& st : alone) {
      if (!st.ok()) {
        refused = true;
        EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
        EXPECT_TRUE(absl::StrContains(st.error_message(), "shard_paths")) << st.error_message();
      }
    }
    EXPECT_TRUE(refused);
    for (int r = 0; r < w_new; ++r) {  // the ranks that did load close what they got
      v1::ListSessionsResponse list;
      ASSERT_TRUE(d[r]->stub().ListSessions(Ctx().get(), {}, &list).ok());
      for (const auto& i : list.sessions()) {
        EXPECT_TRUE(CloseSession(d[r]->stub(), i.session_id()).ok());
      }
    }
  }
  s.resize(w_new);
  std::vector<int64_t> state_bytes(w_new);
  OnAllRanks(w_new, [&](int r) {
    v1::LoadCheckpointRequest lreq;
    lreq.set_path(old_paths[r % w_old]);
    for (int o = 0; o < w_old; ++o) {
      if (o != r % w_old) lreq.add_shard_paths(old_paths[o]);
    }
    v1::LoadCheckpointResponse lresp;
    grpc::Status st = d[r]->stub().LoadCheckpoint(Ctx().get(), lreq, &lresp);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
    EXPECT_EQ(lresp.step_index(), 4);
    s[r] = BindShmSession(d[r]->stub(), lresp.session());
  });
  for (int r = 0; r < w_new; ++r) {
    ASSERT_NE(s[r], nullptr);
    for (size_t i = 0; i < desc.params.size(); ++i) {
      ASSERT_EQ(s[r]->ParamBytes(i), FloatBytes(expected[4][i])) << "restored, rank " << r;
    }
    // Each new rank holds only its share of the state: together exactly one copy.
    v1::ListSessionsResponse list;
    ASSERT_TRUE(d[r]->stub().ListSessions(Ctx().get(), {}, &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    state_bytes[r] = list.sessions(0).state_bytes();
  }
  int64_t total = 0;
  for (int64_t b : state_bytes) total += b;
  EXPECT_EQ(total, old_total);
  run_steps(d, s, 5, 8);
  std::cout << "W=" << w_old << " -> W=" << w_new << ": steps 5-8 bit-identical to W=1"
            << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Sizes, WorldSessionElastic,
                         ::testing::Values(std::make_pair(3, 2), std::make_pair(2, 4)),
                         [](const auto& info) {
                           return absl::StrCat("W", info.param.first, "to", info.param.second);
                         });

}  // namespace
}  // namespace diond::service_testing
