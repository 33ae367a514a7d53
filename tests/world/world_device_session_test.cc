// World sessions on device daemons (docs/GPU.md "World sessions", docs/DISTRIBUTED.md): a world
// of two test-only diond_testdevice daemons (the host-memory TEST backend in strict mode, so any
// host access of "device" memory faults) against a world of two CPU daemons, over real
// processes, loopback TCP, Gloo and shm. On the device daemons a world session keeps its state
// and staging on the device, runs the rules on the session's device Context and stages its
// collectives through host buffers by explicit copies.
//
//   * Every algorithm (REPLICATED), AVERAGE for AdamW / Muon / Dion / Dion2, DION_COMPRESSED for
//     Dion: after every step the trainers' arenas of the device world equal the CPU world's bit
//     for bit, rank by rank, with the same update norms and world bytes; the optimizer state
//     (GetState, every rank's owned share) too. --checksum_every=2 runs the device checksums.
//   * The copies: the TEST backend's counters (the counters line of the test daemon) show, per
//     step and rank, the local device step's copies plus exactly what the collectives need:
//     this rank's owned parameters device -> host, the others' host -> device (and, AVERAGE,
//     every gradient device -> host and the owned averaged gradients host -> device).
//   * Peer loss: a killed rank fails the survivor's pending step within --peer_timeout.
#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

constexpr int kWorld = 2;
constexpr int kSteps = 3;
constexpr absl::Duration kPeerTimeout = absl::Seconds(3);

std::vector<std::string> WorldFlags(int rank, int port) {
  std::vector<std::string> f = {absl::StrCat("--world_size=", kWorld),
                                absl::StrCat("--rank=", rank), "--heartbeat_interval=200ms",
                                absl::StrCat("--peer_timeout=",
                                             absl::ToInt64Seconds(kPeerTimeout), "s"),
                                "--checksum_every=2"};
  if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", port));
  return f;
}

// kWorld daemons forming one world: the CPU daemon, or diond_testdevice (`device`).
std::vector<std::unique_ptr<Daemon>> StartWorld(bool device) {
  std::vector<std::unique_ptr<Daemon>> d;
  for (int r = 0; r < kWorld; ++r) {
    const std::vector<std::string> flags = WorldFlags(r, r == 0 ? 0 : d[0]->tcp_port());
    d.push_back(device ? Daemon::StartBinary(DIOND_TESTDEVICE_BINARY, flags, {}, /*tcp=*/true)
                       : Daemon::Start(flags, /*tcp=*/true));
    if (d.back() == nullptr) return {};
  }
  return d;
}

void OnAllRanks(const std::function<void(int)>& f) {
  std::vector<std::thread> t;
  for (int r = 0; r < kWorld; ++r) t.emplace_back(f, r);
  for (auto& th : t) th.join();
}

// The last "test device counters: k=v ..." line of the test daemon's log, as k -> v.
std::map<std::string, int64_t> LastCounters(const Daemon& d) {
  const std::string log = d.Log();
  const size_t at = log.rfind("test device counters:");
  std::map<std::string, int64_t> out;
  if (at == std::string::npos) return out;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  static const std::regex kv("([a-z_]+)=([0-9]+)");
  for (std::sregex_iterator it(line.begin(), line.end(), kv), end; it != end; ++it) {
    int64_t v = 0;
    if (absl::SimpleAtoi((*it)[2].str(), &v)) out[(*it)[1].str()] = v;
  }
  return out;
}

// Whether the log has a checksum warning of world session `key` ("... differs on rank(s) ...").
bool LogHasDrift(const std::string& log, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, absl::StrCat("world session '", key, "'")) &&
        absl::StrContains(line, "differs on rank")) {
      return true;
    }
  }
  return false;
}

// Four matrices of `algorithm` (group "main"; Dion at rank fraction 1/4, so that its compact
// P / Q_new exchange is used) and two AdamW vectors (group "vec"): six parameters the shard plan
// spreads over both ranks.
SessionDesc Desc(AlgorithmKind algorithm) {
  SessionDesc d;
  GroupDesc main = MakeGroup("main", algorithm, 0.01);
  if (algorithm == AlgorithmKind::kDion) {
    main.proto.mutable_hyperparameters()->set_rank_fraction(0.25);
    main.config.hyperparams.rank_fraction = 0.25;
  }
  d.groups.push_back(main);
  d.groups.push_back(MakeGroup("vec", AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w0", {24, 16}, "main"});
  d.params.push_back({"w1", {16, 24}, "main"});
  d.params.push_back({"w2", {24, 16}, "main"});
  d.params.push_back({"w3", {32, 16}, "main"});
  d.params.push_back({"b0", {16}, "vec"});
  d.params.push_back({"b1", {24}, "vec"});
  return d;
}

// Rank r's trainer's gradients of step t: the same on every rank (REPLICATED), the rank's own
// otherwise.
uint64_t GradSeed(v1::GradientSync sync, int rank) {
  return sync == v1::GRADIENT_SYNC_REPLICATED ? 7 : 7 + static_cast<uint64_t>(rank);
}

// A world session `key` on every daemon of `d`, bound to shm, with the same initial weights.
std::vector<std::unique_ptr<ShmSession>> CreateEverywhere(std::vector<std::unique_ptr<Daemon>>& d,
                                                          const SessionDesc& desc,
                                                          v1::GradientSync sync,
                                                          const std::string& key) {
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key(key);
  req.set_gradient_sync(sync);
  std::vector<std::unique_ptr<ShmSession>> s(kWorld);
  OnAllRanks([&](int r) { s[r] = CreateShmSession(d[r]->stub(), req); });
  for (int r = 0; r < kWorld; ++r) {
    if (s[r] == nullptr) return {};
    grpc::Status st = SetState(d[r]->stub(), s[r]->id, SyntheticWeights(desc, 1));
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  return s;
}

std::vector<v1::StepResponse> StepAll(std::vector<std::unique_ptr<Daemon>>& d,
                                      std::vector<std::unique_ptr<ShmSession>>& s, int64_t step) {
  std::vector<v1::StepResponse> resp(kWorld);
  OnAllRanks([&](int r) {
    grpc::Status st = DoStep(d[r]->stub(), s[r]->id, step, &resp[r]);
    EXPECT_TRUE(st.ok()) << "rank " << r << " step " << step << ": " << st.error_message() << "\n"
                         << d[r]->Log();
  });
  return resp;
}

class DeviceWorld : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cpu_ = new std::vector<std::unique_ptr<Daemon>>(StartWorld(false));
    dev_ = new std::vector<std::unique_ptr<Daemon>>(StartWorld(true));
  }
  static void TearDownTestSuite() {
    delete cpu_;
    delete dev_;
    cpu_ = dev_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(static_cast<int>(cpu_->size()), kWorld);
    ASSERT_EQ(static_cast<int>(dev_->size()), kWorld);
  }
  static std::vector<std::unique_ptr<Daemon>>* cpu_;
  static std::vector<std::unique_ptr<Daemon>>* dev_;
};
std::vector<std::unique_ptr<Daemon>>* DeviceWorld::cpu_ = nullptr;
std::vector<std::unique_ptr<Daemon>>* DeviceWorld::dev_ = nullptr;

TEST_F(DeviceWorld, TheDeviceDaemonsRunOnTheTestBackend) {
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = (*dev_)[r]->Log();
    EXPECT_TRUE(absl::StrContains(log, "TEST DEVICE BACKEND")) << log;
    EXPECT_TRUE(absl::StrContains(log, "steps run on test-device:0")) << log;
    EXPECT_FALSE(absl::StrContains((*cpu_)[r]->Log(), "TEST DEVICE")) << r;
  }
}

struct WorldRun {
  AlgorithmKind algorithm;
  v1::GradientSync sync;
};
std::string RunLabel(const WorldRun& run) {
  std::string sync = run.sync == v1::GRADIENT_SYNC_REPLICATED ? "Replicated"
                     : run.sync == v1::GRADIENT_SYNC_AVERAGE  ? "Average"
                                                              : "DionCompressed";
  std::string a(optim::AlgorithmName(run.algorithm));
  a.erase(std::remove_if(a.begin(), a.end(), [](char c) { return !std::isalnum(c); }), a.end());
  return a + sync;
}
void PrintTo(const WorldRun& run, std::ostream* os) { *os << RunLabel(run); }
std::string RunName(const ::testing::TestParamInfo<WorldRun>& info) {
  return RunLabel(info.param);
}

class DeviceWorldRuns : public DeviceWorld, public ::testing::WithParamInterface<WorldRun> {};

TEST_P(DeviceWorldRuns, EqualsTheCpuWorldBitForBit) {
  const WorldRun run = GetParam();
  const SessionDesc desc = Desc(run.algorithm);
  const std::string key = absl::StrCat("dev-equiv-", RunLabel(run));
  auto c = CreateEverywhere(*cpu_, desc, run.sync, key);
  auto g = CreateEverywhere(*dev_, desc, run.sync, key);
  ASSERT_EQ(static_cast<int>(c.size()), kWorld);
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  const std::vector<Chunk> init = SyntheticWeights(desc, 1);
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (int r = 0; r < kWorld; ++r) {
      WriteSyntheticGrads(c[r].get(), desc, GradSeed(run.sync, r), t);
      WriteSyntheticGrads(g[r].get(), desc, GradSeed(run.sync, r), t);
    }
    auto rc = StepAll(*cpu_, c, t);
    auto rg = StepAll(*dev_, g, t);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_FALSE(rg[r].skipped());
      EXPECT_EQ(rg[r].world_bytes_sent(), rc[r].world_bytes_sent()) << "rank " << r;
      EXPECT_GT(rg[r].world_bytes_sent(), 0) << "rank " << r;
      ASSERT_EQ(rg[r].update_norms().size(), rc[r].update_norms().size());
      for (const auto& [group, norm] : rc[r].update_norms()) {
        EXPECT_EQ(rg[r].update_norms().at(group), norm) << group << ", rank " << r;
      }
      for (size_t i = 0; i < desc.params.size(); ++i) {
        ASSERT_EQ(g[r]->ParamBytes(i), c[r]->ParamBytes(i))
            << desc.params[i].name << ", rank " << r << ", step " << t;
        // Every rank of a world holds the same weights.
        EXPECT_EQ(g[r]->ParamBytes(i), g[0]->ParamBytes(i)) << desc.params[i].name;
      }
    }
  }
  // The weights moved (the comparison is not of untouched arenas) ...
  for (size_t i = 0; i < desc.params.size(); ++i) {
    EXPECT_NE(g[0]->ParamBytes(i), init[i].data) << desc.params[i].name;
  }
  // ... and every rank's share of the optimizer state is the CPU rank's, bit for bit.
  std::set<std::string> held;
  for (int r = 0; r < kWorld; ++r) {
    TensorMap sc, sg;
    ASSERT_TRUE(GetState((*cpu_)[r]->stub(), c[r]->id, true, &sc).ok());
    grpc::Status st = GetState((*dev_)[r]->stub(), g[r]->id, true, &sg);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(sg.size(), sc.size()) << "rank " << r;
    for (const auto& [name, bytes] : sc) {
      ASSERT_TRUE(sg.count(name)) << name << ", rank " << r;
      EXPECT_EQ(sg.at(name), bytes) << name << ", rank " << r;
      if (absl::StrContains(name, "/state.")) held.insert(name);
    }
  }
  EXPECT_FALSE(held.empty());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_FALSE(LogHasDrift((*dev_)[r]->Log(), key)) << (*dev_)[r]->Log();
    EXPECT_TRUE(CloseSession((*cpu_)[r]->stub(), c[r]->id).ok());
    EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), g[r]->id).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Algorithms, DeviceWorldRuns,
    ::testing::Values(WorldRun{AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kLion, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kNorMuon, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kDion, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kDion2, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kNorDion2, v1::GRADIENT_SYNC_REPLICATED},
                      WorldRun{AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRun{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRun{AlgorithmKind::kDion, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRun{AlgorithmKind::kDion2, v1::GRADIENT_SYNC_AVERAGE},
                      WorldRun{AlgorithmKind::kDion, v1::GRADIENT_SYNC_DION_COMPRESSED}),
    RunName);


// Which parameters each rank owns: those whose state its GetState lists (every parameter of
// Desc has state). Call it after the counted steps: its copies are counted at the next report.
std::vector<std::set<size_t>> OwnedParams(std::vector<std::unique_ptr<Daemon>>& d,
                                          std::vector<std::unique_ptr<ShmSession>>& s,
                                          const SessionDesc& desc) {
  std::vector<std::set<size_t>> owned(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    TensorMap state;
    grpc::Status st = GetState(d[r]->stub(), s[r]->id, false, &state);
    EXPECT_TRUE(st.ok()) << st.error_message();
    for (const auto& [name, bytes] : state) {
      for (size_t i = 0; i < desc.params.size(); ++i) {
        if (absl::StartsWith(name, desc.params[i].name + "/state.")) owned[r].insert(i);
      }
    }
  }
  return owned;
}

// The copies of a world device session's steps, from the TEST backend's counters (the line the
// test daemon logs after every step), on every rank: the local device step's (gradients and
// weights host -> device, the new weights device -> host, one read-back of Σ(Δx)² per group the
// rank steps: one float per parameter of the group) plus what the collectives need and nothing
// else. REPLICATED: the owned parameters device -> host for the all-gather, the others' host ->
// device. AVERAGE adds every gradient device -> host for the reduce-scatter and the owned
// averaged gradients host -> device. Muon and AdamW exchange whole parameters (no compact form).
TEST_F(DeviceWorld, CopiesCarryOnlyWhatTheCollectivesNeed) {
  const SessionDesc desc = Desc(AlgorithmKind::kMuon);
  const int64_t n = static_cast<int64_t>(desc.params.size());
  int64_t total = 0;
  for (size_t i = 0; i < desc.params.size(); ++i) total += desc.Numel(i);
  for (v1::GradientSync sync : {v1::GRADIENT_SYNC_REPLICATED, v1::GRADIENT_SYNC_AVERAGE}) {
    SCOPED_TRACE(sync == v1::GRADIENT_SYNC_REPLICATED ? "REPLICATED" : "AVERAGE");
    const bool average = sync == v1::GRADIENT_SYNC_AVERAGE;
    auto g = CreateEverywhere(*dev_, desc, sync, absl::StrCat("dev-copies-", sync));
    ASSERT_EQ(static_cast<int>(g.size()), kWorld);
    std::vector<std::map<std::string, int64_t>> start(kWorld), end(kWorld);
    for (int64_t t = 1; t <= kSteps; ++t) {
      for (int r = 0; r < kWorld; ++r) WriteSyntheticGrads(g[r].get(), desc, GradSeed(sync, r), t);
      StepAll(*dev_, g, t);
      // Counted from the report after step 1 (SetState's copies come before it).
      for (int r = 0; r < kWorld; ++r) (t == 1 ? start : end)[r] = LastCounters(*(*dev_)[r]);
    }
    const int64_t steps = kSteps - 1;
    const std::vector<std::set<size_t>> owned = OwnedParams(*dev_, g, desc);
    std::set<size_t> all;
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_FALSE(owned[r].empty()) << "rank " << r << " owns nothing: the test proves less";
      for (size_t i : owned[r]) EXPECT_TRUE(all.insert(i).second) << "owned twice: " << i;
    }
    EXPECT_EQ(static_cast<int64_t>(all.size()), n);
    for (int r = 0; r < kWorld; ++r) {
      const int64_t mine = static_cast<int64_t>(owned[r].size());
      int64_t mine_elements = 0;
      std::set<std::string> groups;
      for (size_t i : owned[r]) {
        mine_elements += desc.Numel(i);
        groups.insert(desc.params[i].group);
      }
      const int64_t stepped_groups = static_cast<int64_t>(groups.size());
      int64_t norm_floats = 0;  // Σ(Δx)² read-backs: every parameter of a stepped group
      for (const ParamDesc& p : desc.params) norm_floats += groups.count(p.group);
      const int64_t to_device = 2 * n + (n - mine) + (average ? mine : 0);
      const int64_t to_host = n + stepped_groups + mine + (average ? n : 0);
      const int64_t bytes_to_device =
          4 * (2 * total + (total - mine_elements) + (average ? mine_elements : 0));
      const int64_t bytes_to_host =
          4 * (total + norm_floats + mine_elements + (average ? total : 0));
      std::map<std::string, int64_t> got;
      for (const char* k : {"copies_to_device", "copies_to_host", "bytes_to_device",
                            "bytes_to_host"}) {
        got[k] = end[r][k] - start[r][k];
      }
      EXPECT_EQ(got["copies_to_device"], to_device * steps) << "rank " << r;
      EXPECT_EQ(got["copies_to_host"], to_host * steps) << "rank " << r;
      EXPECT_EQ(got["bytes_to_device"], bytes_to_device * steps) << "rank " << r;
      EXPECT_EQ(got["bytes_to_host"], bytes_to_host * steps) << "rank " << r;
      std::cout << "rank " << r << " (owns " << mine << " of " << n << ", " << mine_elements
                << " of " << total << " elements), per step: " << got["copies_to_device"] / steps
                << " copies / " << got["bytes_to_device"] / steps << " bytes to the device, "
                << got["copies_to_host"] / steps << " / " << got["bytes_to_host"] / steps
                << " to the host\n";
      // Every op of the world sessions ran on a session stream, and the session's stream lives.
      EXPECT_EQ(end[r]["ops_on_default_stream"], start[r]["ops_on_default_stream"]);
    }
    for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), g[r]->id).ok());
  }
}

// --checksum_every=2 on device daemons: the checksums are computed on the device; a replica that
// drifted (rank 1's trainer scribbles on its weights after step 2; Dion2's compact exchange only
// overwrites the selected rows, so the drift survives step 3) is healed at step 4 with the
// owner's copy, which crosses through a host buffer. The CPU world, given the same scribble,
// ends with the same bytes.
TEST_F(DeviceWorld, ChecksumsHealADriftedReplicaOnTheDevice) {
  SessionDesc desc;
  desc.groups.push_back(MakeGroup("d2", AlgorithmKind::kDion2, 0.02));
  for (int j = 0; j < 4; ++j) desc.params.push_back({absl::StrCat("d", j), {24, 40}, "d2"});
  auto c = CreateEverywhere(*cpu_, desc, v1::GRADIENT_SYNC_REPLICATED, "dev-checksums");
  auto g = CreateEverywhere(*dev_, desc, v1::GRADIENT_SYNC_REPLICATED, "dev-checksums");
  ASSERT_EQ(static_cast<int>(c.size()), kWorld);
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  auto step_all = [&](int64_t t) {
    for (int r = 0; r < kWorld; ++r) {
      WriteSyntheticGrads(c[r].get(), desc, 6, t);
      WriteSyntheticGrads(g[r].get(), desc, 6, t);
    }
    StepAll(*cpu_, c, t);
    StepAll(*dev_, g, t);
  };
  auto identical = [&](std::vector<std::unique_ptr<ShmSession>>& s) {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      if (s[1]->ParamBytes(i) != s[0]->ParamBytes(i)) return false;
    }
    return true;
  };
  step_all(1);
  step_all(2);
  ASSERT_TRUE(identical(g));
  for (auto* s : {&c, &g}) {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      std::vector<float> v = BytesToFloats((*s)[1]->ParamBytes(i));
      for (size_t row = 0; row < 24; ++row) v[row * 40] += 0.5f;
      (*s)[1]->params_seg->Write((*s)[1]->tensor(i).param_offset_bytes(), FloatBytes(v));
    }
  }
  step_all(3);
  EXPECT_FALSE(identical(g)) << "the drift survives a step that is not a check";
  step_all(4);  // a check: healed
  EXPECT_TRUE(identical(g));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(LogHasDrift((*dev_)[r]->Log(), "dev-checksums")) << (*dev_)[r]->Log();
    EXPECT_TRUE(absl::StrContains((*dev_)[r]->Log(), "differs on rank(s) 1")) << (*dev_)[r]->Log();
    for (size_t i = 0; i < desc.params.size(); ++i) {
      EXPECT_EQ(g[r]->ParamBytes(i), c[r]->ParamBytes(i)) << desc.params[i].name << " rank " << r;
    }
    EXPECT_TRUE(CloseSession((*cpu_)[r]->stub(), c[r]->id).ok());
    EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), g[r]->id).ok());
  }
}

// World device sessions refuse what is not built for them with a clear error: trainer events.
TEST_F(DeviceWorld, EventsAreRefusedWithAClearError) {
  const SessionDesc desc = Desc(AlgorithmKind::kAdamW);
  auto g = CreateEverywhere(*dev_, desc, v1::GRADIENT_SYNC_REPLICATED, "dev-events");
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  auto ctx = Ctx();
  v1::StepRequest req;
  req.set_session_id(g[0]->id);
  req.set_step_index(1);
  req.set_ready_event(std::string(64, '\x01'));
  v1::StepResponse resp;
  grpc::Status st = (*dev_)[0]->stub().Step(ctx.get(), req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "local device sessions")) << st.error_message();
  // Nothing was stepped: the world steps on from step 1.
  for (int r = 0; r < kWorld; ++r) WriteSyntheticGrads(g[r].get(), desc, 7, 1);
  StepAll(*dev_, g, 1);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), g[r]->id).ok());
}

// A killed rank fails the survivor's pending step within --peer_timeout (UNAVAILABLE naming the
// lost rank), and later steps at once; the surviving device daemon serves on.
TEST(DeviceWorldFailure, PeerLossFailsTheStepWithinThePeerTimeout) {
  auto d = StartWorld(true);
  ASSERT_EQ(static_cast<int>(d.size()), kWorld);
  const SessionDesc desc = Desc(AlgorithmKind::kMuon);
  auto s = CreateEverywhere(d, desc, v1::GRADIENT_SYNC_AVERAGE, "dev-loss");
  ASSERT_EQ(static_cast<int>(s.size()), kWorld);
  for (int r = 0; r < kWorld; ++r) WriteSyntheticGrads(s[r].get(), desc, 7 + r, 1);
  StepAll(d, s, 1);
  WriteSyntheticGrads(s[0].get(), desc, 7, 2);
  grpc::Status pending;
  absl::Time answered;
  std::thread trainer([&] {
    pending = DoStep(d[0]->stub(), s[0]->id, 2);
    answered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(500));
  d[1]->Kill();
  const absl::Time killed = absl::Now();
  trainer.join();
  EXPECT_EQ(pending.error_code(), grpc::StatusCode::UNAVAILABLE) << pending.error_message();
  EXPECT_LE(answered - killed, kPeerTimeout + absl::Seconds(1));
  std::cout << "rank 0 answered " << absl::FormatDuration(answered - killed)
            << " after the kill: " << pending.error_message() << "\n";
  EXPECT_TRUE(absl::StrContains(pending.error_message(), "rank 1")) << pending.error_message();
  grpc::Status again = DoStep(d[0]->stub(), s[0]->id, 2);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAVAILABLE) << again.error_message();
  EXPECT_TRUE(d[0]->Serving());
  EXPECT_TRUE(CloseSession(d[0]->stub(), s[0]->id).ok());
}

}  // namespace
}  // namespace diond::service_testing
