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
//   * Checksums on the device heal a drifted replica; a NaN on one rank skips the step on all.
//   * Checkpoints: DION_COMPRESSED SaveCheckpoint (the momentum average on the device state) and
//     an elastic restore (2 -> 1) into one device daemon, equal to the CPU's.
//   * Budgets: --max_session_bytes counts the sharded device pool bytes; a pool too small for
//     the sharding fails CreateSession cleanly. A trainer event that cannot be opened is refused
//     before the rank joins the step.
//   * Peer loss: a killed rank fails the survivor's pending step within --peer_timeout.
// Everything here runs on the TEST backend; no GPU has run this code.
#include <algorithm>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

constexpr int kWorld = 2;
constexpr int kSteps = 3;
constexpr absl::Duration kPeerTimeout = absl::Seconds(3);

std::vector<std::string> WorldFlags(int rank, int port) {
  std::vector<std::string> f = {
      absl::StrCat("--world_size=", kWorld), absl::StrCat("--rank=", rank),
      "--heartbeat_interval=200ms",
      absl::StrCat("--peer_timeout=", absl::ToInt64Seconds(kPeerTimeout), "s"),
      "--checksum_every=2"};
  if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", port));
  return f;
}

// kWorld daemons forming one world: the CPU daemon, or diond_testdevice (`device`); rank r gets
// --state_dir=state_dirs[r] when given.
std::vector<std::unique_ptr<Daemon>> StartWorld(bool device,
                                                const std::vector<std::string>& state_dirs = {}) {
  std::vector<std::unique_ptr<Daemon>> d;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> flags = WorldFlags(r, r == 0 ? 0 : d[0]->tcp_port());
    if (!state_dirs.empty()) flags.push_back("--state_dir=" + state_dirs[r]);
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

// Every rank's Step `step`; with `lr` (group -> learning rate), as the request's lr_override.
std::vector<v1::StepResponse> StepAll(std::vector<std::unique_ptr<Daemon>>& d,
                                      std::vector<std::unique_ptr<ShmSession>>& s, int64_t step,
                                      const std::map<std::string, double>& lr = {}) {
  std::vector<v1::StepResponse> resp(kWorld);
  OnAllRanks([&](int r) {
    v1::StepRequest req;
    req.set_session_id(s[r]->id);
    req.set_step_index(step);
    for (const auto& [group, value] : lr) (*req.mutable_lr_override())[group] = value;
    auto ctx = Ctx();
    grpc::Status st = d[r]->stub().Step(ctx.get(), req, &resp[r]);
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
std::string RunName(const ::testing::TestParamInfo<WorldRun>& info) { return RunLabel(info.param); }

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

// graph (docs/GPU.md "CUDA graphs"): a world session's update runs as a captured graph on each
// rank (its collectives run between the phases, outside it), replayed with the step's scalars.
// A learning-rate schedule (a new lr_override for every group at each step) on both worlds: the
// device world equals the CPU world bit for bit, and each rank replayed its graphs.
TEST_F(DeviceWorld, GraphReplaysWithALearningRateScheduleEqualTheCpuWorld) {
  const SessionDesc desc = Desc(AlgorithmKind::kMuon);
  const std::string key = "dev-graph-schedule";
  auto c = CreateEverywhere(*cpu_, desc, v1::GRADIENT_SYNC_AVERAGE, key);
  auto g = CreateEverywhere(*dev_, desc, v1::GRADIENT_SYNC_AVERAGE, key);
  ASSERT_EQ(static_cast<int>(c.size()), kWorld);
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  std::vector<std::map<std::string, int64_t>> before(kWorld), after(kWorld);
  for (int r = 0; r < kWorld; ++r) before[r] = LastCounters(*(*dev_)[r]);
  constexpr int64_t kScheduleSteps = 7;
  for (int64_t t = 1; t <= kScheduleSteps; ++t) {
    std::map<std::string, double> lr;
    for (size_t k = 0; k < desc.groups.size(); ++k) {
      lr[desc.groups[k].proto.name()] = 0.01 * static_cast<double>(k + 1) / static_cast<double>(t);
    }
    for (int r = 0; r < kWorld; ++r) {
      WriteSyntheticGrads(c[r].get(), desc, GradSeed(v1::GRADIENT_SYNC_AVERAGE, r), t);
      WriteSyntheticGrads(g[r].get(), desc, GradSeed(v1::GRADIENT_SYNC_AVERAGE, r), t);
    }
    auto rc = StepAll(*cpu_, c, t, lr);
    auto rg = StepAll(*dev_, g, t, lr);
    for (int r = 0; r < kWorld; ++r) {
      for (const auto& [group, norm] : rc[r].update_norms()) {
        EXPECT_EQ(rg[r].update_norms().at(group), norm) << group << ", rank " << r;
      }
      for (size_t i = 0; i < desc.params.size(); ++i) {
        ASSERT_EQ(g[r]->ParamBytes(i), c[r]->ParamBytes(i))
            << desc.params[i].name << ", rank " << r << ", step " << t;
      }
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    after[r] = LastCounters(*(*dev_)[r]);
    // Steps 2..7 as graphs: the reads and the writes one form each; the update two forms
    // captured (the staged state swaps at each commit), the other four replayed.
    EXPECT_EQ(after[r]["graph_launches"] - before[r]["graph_launches"], 3 * (kScheduleSteps - 1))
        << "rank " << r;
    EXPECT_EQ(after[r]["graphs_made"] - before[r]["graphs_made"], 1 + 2 + 1) << "rank " << r;
    EXPECT_FALSE(absl::StrContains((*dev_)[r]->Log(), absl::StrCat("session ", g[r]->id,
                                                                   ": the update phase of its "
                                                                   "steps runs eagerly")))
        << (*dev_)[r]->Log();
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
// weights host -> device, the new weights device -> host, one read-back of the gradients'
// finiteness flag (one float), one read-back of Σ(Δx)² per group the rank steps: one float per
// parameter of the group) plus what the collectives need and nothing else. The world phases pack
// and unpack on the device (device-to-device copies, not counted here); with no device
// communicator in this world (no NCCL), the step's device collectives stage each call through
// host buffers, one copy each way (server/session/device_comm.h). REPLICATED, per step: this
// rank's all-gather block (its owned parameters and its tail of 2G+1 floats: norms and status)
// goes down, the whole gathered wire comes up, the tail is written to the device first (one
// copy) and every rank's tail is read back (W copies). AVERAGE adds the reduce-scatter's input
// (W blocks of the largest owned size + 1) down, this rank's block up, and the summed non-finite
// flag down. Muon and AdamW exchange whole parameters (no compact form).
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
      const int64_t extra = 2 * static_cast<int64_t>(desc.groups.size()) + 1;
      int64_t block = 0;  // the reduce-scatter's block: the largest owned share, + the flag
      for (int q = 0; q < kWorld; ++q) {
        int64_t e = 0;
        for (size_t i : owned[q]) e += desc.Numel(i);
        block = std::max(block, e);
      }
      block += 1;
      const int64_t to_device = 2 * n + 2 + (average ? 1 : 0);
      const int64_t to_host = n + 1 + stepped_groups + 1 + kWorld + (average ? 2 : 0);
      const int64_t bytes_to_device =
          4 * (2 * total + extra + (total + kWorld * extra) + (average ? block : 0));
      const int64_t bytes_to_host = 4 * (total + 1 + norm_floats + (mine_elements + extra) +
                                         kWorld * extra + (average ? kWorld * block + 1 : 0));
      std::map<std::string, int64_t> got;
      for (const char* k : {"copies_to_device", "copies_to_host", "bytes_to_device",
                            "bytes_to_host", "graph_launches"}) {
        got[k] = end[r][k] - start[r][k];
      }
      // From step 2 the rank's step runs as captured graphs (docs/GPU.md "CUDA graphs"): its
      // reads, its update and its writes; each launch of the update's adds one upload: its
      // scalar records (a few dozen bytes).
      EXPECT_EQ(got["graph_launches"], 3 * steps) << "rank " << r;
      const int64_t launches = steps;  // of the update's graph
      EXPECT_EQ(got["copies_to_device"], to_device * steps + launches) << "rank " << r;
      EXPECT_EQ(got["copies_to_host"], to_host * steps) << "rank " << r;
      EXPECT_GT(got["bytes_to_device"], bytes_to_device * steps) << "rank " << r;
      EXPECT_LE(got["bytes_to_device"], bytes_to_device * steps + 256 * launches) << "rank " << r;
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

// The budgets count a world device session's device pool bytes (Session::BudgetBytes), as a local
// device session's: its staging plus the state of what the rank owns (the rest is released on
// the device when the session joins the world), as the TEST pool's counters show. Measured on
// the fixture's daemons, then enforced: with --max_session_bytes at the larger rank's share, a
// world of two device daemons creates and steps the world session, while the same session as
// a local one (all the state on one daemon) is refused with RESOURCE_EXHAUSTED and the numbers.
TEST_F(DeviceWorld, BudgetsCountTheWorldSessionsDevicePoolBytes) {
  const SessionDesc desc = Desc(AlgorithmKind::kAdamW);
  auto pool = [&](int r) { return LastCounters(*(*dev_)[r])["pool_in_use"]; };
  // A local session on rank 0 (no regions: just what CreateSession allocates).
  const int64_t before0 = pool(0);
  std::string local_id;
  {
    v1::CreateSessionResponse resp;
    grpc::Status st = (*dev_)[0]->stub().CreateSession(Ctx().get(), desc.Request(), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    local_id = resp.session_id();
  }
  const int64_t local = pool(0) - before0;
  ASSERT_TRUE(CloseSession((*dev_)[0]->stub(), local_id).ok());
  ASSERT_EQ(pool(0), before0);
  std::vector<int64_t> before(kWorld), held(kWorld);
  for (int r = 0; r < kWorld; ++r) before[r] = pool(r);
  v1::CreateSessionRequest req = desc.Request();
  req.set_world_key("dev-budget");
  std::vector<std::string> ids(kWorld);
  OnAllRanks([&](int r) {
    v1::CreateSessionResponse resp;
    grpc::Status st = (*dev_)[r]->stub().CreateSession(Ctx().get(), req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    ids[r] = resp.session_id();
  });
  int64_t numel = 0, largest = 0;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    numel += desc.Numel(i);
    largest = std::max(largest, desc.Numel(i));
  }
  auto lines = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t staging = 2 * lines(4 * numel) + lines(4 * largest);
  // The exchange's device buffers, made at creation (REPLICATED: no reduce-scatter): this rank's
  // all-gather block (its owned elements and a tail of 2G+1 floats) and the whole wire.
  for (int r = 0; r < kWorld; ++r) held[r] = pool(r) - before[r];  // before any other call
  const int64_t extra = 2 * static_cast<int64_t>(desc.groups.size()) + 1;
  std::vector<int64_t> owned_elements(kWorld, 0);
  for (int r = 0; r < kWorld; ++r) {
    TensorMap state;
    ASSERT_TRUE(GetState((*dev_)[r]->stub(), ids[r], false, &state).ok());
    for (size_t i = 0; i < desc.params.size(); ++i) {
      for (const auto& [name, bytes] : state) {
        if (absl::StartsWith(name, desc.params[i].name + "/state.")) {
          owned_elements[r] += desc.Numel(i);
          break;
        }
      }
    }
  }
  int64_t state_sum = 0;
  for (int r = 0; r < kWorld; ++r) {
    const int64_t exchange =
        lines(4 * (owned_elements[r] + extra)) + lines(4 * (numel + kWorld * extra));
    std::cout << "rank " << r << ": the world session holds " << held[r] << " pool bytes (staging "
              << staging << ", exchange " << exchange << "); the local session " << local << "\n";
    EXPECT_GT(held[r], staging + exchange) << "rank " << r << " holds no state";
    EXPECT_LT(held[r] - exchange, local) << "rank " << r << " holds more than its share";
    state_sum += held[r] - staging - exchange;
  }
  // The state is sharded: together the ranks hold one session's state, plus at most one 64-byte
  // line of Context::Allocate's rounding per state buffer (a rank's buffers of a shape bucket
  // shrink to what it owns, and an emptied one keeps its minimum line).
  int64_t state_tensors = 0;
  for (int r = 0; r < kWorld; ++r) {
    TensorMap state;
    ASSERT_TRUE(GetState((*dev_)[r]->stub(), ids[r], false, &state).ok());
    state_tensors += static_cast<int64_t>(state.size());
  }
  EXPECT_GE(state_sum, local - staging);
  EXPECT_LE(state_sum, local - staging + 64 * kWorld * state_tensors);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), ids[r]).ok());

  // Enforced: daemons that allow exactly the larger share create and step the world session.
  const int64_t limit = std::max(held[0], held[1]);
  std::vector<std::unique_ptr<Daemon>> d;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> flags = WorldFlags(r, r == 0 ? 0 : d[0]->tcp_port());
    flags.push_back(absl::StrCat("--max_session_bytes=", limit));
    d.push_back(Daemon::StartBinary(DIOND_TESTDEVICE_BINARY, flags, {}, /*tcp=*/true));
    ASSERT_NE(d.back(), nullptr);
  }
  {
    auto s = CreateEverywhere(d, desc, v1::GRADIENT_SYNC_REPLICATED, "dev-budget-enforced");
    ASSERT_EQ(static_cast<int>(s.size()), kWorld);
    for (int r = 0; r < kWorld; ++r) WriteSyntheticGrads(s[r].get(), desc, 7, 1);
    StepAll(d, s, 1);
  }
  d.clear();
  // One byte less than the larger share: that rank refuses it with the numbers, the world
  // exchange buffers named (they are made at creation, not in a step).
  const int big = held[0] >= held[1] ? 0 : 1;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> flags = WorldFlags(r, r == 0 ? 0 : d[0]->tcp_port());
    flags.push_back(absl::StrCat("--max_session_bytes=", held[big] - 1));
    d.push_back(Daemon::StartBinary(DIOND_TESTDEVICE_BINARY, flags, {}, /*tcp=*/true));
    ASSERT_NE(d.back(), nullptr);
  }
  {
    req.set_world_key("dev-budget-short");
    std::vector<grpc::Status> made(kWorld);
    OnAllRanks([&](int r) {
      v1::CreateSessionResponse resp;
      made[r] = d[r]->stub().CreateSession(Ctx().get(), req, &resp);
    });
    EXPECT_EQ(made[big].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << made[big].error_message();
    EXPECT_TRUE(
        absl::StrContains(made[big].error_message(), absl::StrCat("session needs ", held[big])))
        << made[big].error_message();
    EXPECT_TRUE(absl::StrContains(made[big].error_message(), "world exchange buffers"))
        << made[big].error_message();
    EXPECT_EQ(SessionCount(d[big]->stub()), 0u);
  }
  d.clear();

  // A pool that holds the whole state but not the smaller buffers the sharding allocates before
  // it frees the old ones: CreateSession is RESOURCE_EXHAUSTED naming the group and the pool's
  // numbers on both ranks (no crash), nothing of the session stays in the pool, and the daemons
  // carry on.
  const int64_t pool_budget = before0 + local + 64;
  for (int r = 0; r < kWorld; ++r) {
    d.push_back(Daemon::StartBinary(
        DIOND_TESTDEVICE_BINARY, WorldFlags(r, r == 0 ? 0 : d[0]->tcp_port()),
        {absl::StrCat("DIOND_TEST_DEVICE_BUDGET_BYTES=", pool_budget)}, /*tcp=*/true));
    ASSERT_NE(d.back(), nullptr);
  }
  std::vector<grpc::Status> created(kWorld);
  std::vector<int64_t> idle(kWorld);
  for (int r = 0; r < kWorld; ++r) idle[r] = LastCounters(*d[r])["pool_in_use"];
  req.set_world_key("dev-budget-sharding");
  OnAllRanks([&](int r) {
    v1::CreateSessionResponse resp;
    created[r] = d[r]->stub().CreateSession(Ctx().get(), req, &resp);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(created[r].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << created[r].error_message();
    EXPECT_TRUE(absl::StrContains(created[r].error_message(), "sharding the state of group"))
        << created[r].error_message();
    EXPECT_TRUE(absl::StrContains(created[r].error_message(),
                                  absl::StrCat("pool budget ", pool_budget, " bytes")))
        << created[r].error_message();
    EXPECT_TRUE(d[r]->Alive());
    EXPECT_EQ(SessionCount(d[r]->stub()), 0u);
  }
  // The next session change reports the pool: the failed session left nothing in it.
  const SessionDesc tiny = [] {
    SessionDesc t;
    t.groups.push_back(MakeGroup("v", AlgorithmKind::kAdamW, 0.001));
    t.params.push_back({"b", {16}, "v"});
    return t;
  }();
  for (int r = 0; r < kWorld; ++r) {
    v1::CreateSessionResponse resp;
    ASSERT_TRUE(d[r]->stub().CreateSession(Ctx().get(), tiny.Request(), &resp).ok());
    const int64_t tiny_held = LastCounters(*d[r])["pool_in_use"] - idle[r];
    EXPECT_GT(tiny_held, 0);
    EXPECT_LT(tiny_held, staging) << "rank " << r << ": the failed world session's bytes stayed";
  }
}

// AVERAGE with a NaN in one trainer's gradients (found on the device copy, summed with the
// flags of the reduce-scatter): every rank of both worlds skips the step, the weights and the
// state stay as they were, and the next step equals the CPU world's again.
TEST_F(DeviceWorld, ANonFiniteGradientOnOneRankSkipsTheStepOnEveryRank) {
  const SessionDesc desc = Desc(AlgorithmKind::kMuon);
  auto c = CreateEverywhere(*cpu_, desc, v1::GRADIENT_SYNC_AVERAGE, "dev-nonfinite");
  auto g = CreateEverywhere(*dev_, desc, v1::GRADIENT_SYNC_AVERAGE, "dev-nonfinite");
  ASSERT_EQ(static_cast<int>(c.size()), kWorld);
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  auto write = [&](int64_t t, bool nan) {
    for (int r = 0; r < kWorld; ++r) {
      WriteSyntheticGrads(c[r].get(), desc, 7 + r, t);
      WriteSyntheticGrads(g[r].get(), desc, 7 + r, t);
    }
    if (nan) {
      std::vector<float> v = SyntheticValues(7 + 1, t, 3, desc.Numel(3));
      v[5] = std::numeric_limits<float>::quiet_NaN();
      c[1]->WriteGrad(3, v);
      g[1]->WriteGrad(3, v);
    }
  };
  write(1, false);
  StepAll(*cpu_, c, 1);
  StepAll(*dev_, g, 1);
  std::vector<std::string> after_one;
  for (size_t i = 0; i < desc.params.size(); ++i) after_one.push_back(g[0]->ParamBytes(i));
  write(2, true);
  auto rc = StepAll(*cpu_, c, 2);
  auto rg = StepAll(*dev_, g, 2);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(rc[r].skipped()) << "rank " << r;
    EXPECT_TRUE(rg[r].skipped()) << "rank " << r;
    for (size_t i = 0; i < desc.params.size(); ++i) {
      EXPECT_EQ(g[r]->ParamBytes(i), after_one[i]) << desc.params[i].name << " rank " << r;
    }
  }
  write(3, false);
  StepAll(*cpu_, c, 3);
  StepAll(*dev_, g, 3);
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      EXPECT_EQ(g[r]->ParamBytes(i), c[r]->ParamBytes(i)) << desc.params[i].name << " rank " << r;
    }
    EXPECT_NE(g[r]->ParamBytes(0), after_one[0]);
    TensorMap sc, sg;
    ASSERT_TRUE(GetState((*cpu_)[r]->stub(), c[r]->id, false, &sc).ok());
    ASSERT_TRUE(GetState((*dev_)[r]->stub(), g[r]->id, false, &sg).ok());
    EXPECT_EQ(sg, sc) << "rank " << r;
    EXPECT_TRUE(CloseSession((*cpu_)[r]->stub(), c[r]->id).ok());
    EXPECT_TRUE(CloseSession((*dev_)[r]->stub(), g[r]->id).ok());
  }
}

// A trainer event that cannot be opened is refused before the rank joins the step, with a clear
// error, and the world steps on (events that open are stepped with in cuda_region_service_test's
// CudaRegionWorld: the TEST backend's events are same-process only).
TEST_F(DeviceWorld, AnUnopenableEventIsRefusedBeforeTheWorldSteps) {
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
  EXPECT_TRUE(absl::StrContains(st.error_message(), "ready_event cannot be opened"))
      << st.error_message();
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

// Checkpoints of DION_COMPRESSED world sessions on device daemons: SaveCheckpoint first averages
// every rank's Dion momentum (a collective, through host buffers and the device state); the
// checkpoints then restore, with the other rank's as shard_paths, into a single device daemon
// (elastic restore, 2 -> 1). At every stage the device side equals the CPU side bit for bit: the
// state after the save, the worlds' next step, and two more steps of the restored sessions.
TEST(DeviceWorldCheckpoints, SaveAndElasticRestoreMatchTheCpu) {
  const SessionDesc desc = Desc(AlgorithmKind::kDion);
  const v1::GradientSync sync = v1::GRADIENT_SYNC_DION_COMPRESSED;
  std::vector<std::string> cpu_dirs, dev_dirs;
  for (int r = 0; r < kWorld; ++r) {
    cpu_dirs.push_back(::diond::testing::MakeTempDir(absl::StrCat("diond_wdev_cpu", r)));
    dev_dirs.push_back(::diond::testing::MakeTempDir(absl::StrCat("diond_wdev_dev", r)));
  }
  auto cd = StartWorld(false, cpu_dirs);
  auto gd = StartWorld(true, dev_dirs);
  ASSERT_EQ(static_cast<int>(cd.size()), kWorld);
  ASSERT_EQ(static_cast<int>(gd.size()), kWorld);
  auto c = CreateEverywhere(cd, desc, sync, "dev-ckpt");
  auto g = CreateEverywhere(gd, desc, sync, "dev-ckpt");
  ASSERT_EQ(static_cast<int>(c.size()), kWorld);
  ASSERT_EQ(static_cast<int>(g.size()), kWorld);
  auto step_worlds = [&](int64_t t) {
    for (int r = 0; r < kWorld; ++r) {
      WriteSyntheticGrads(c[r].get(), desc, GradSeed(sync, r), t);
      WriteSyntheticGrads(g[r].get(), desc, GradSeed(sync, r), t);
    }
    StepAll(cd, c, t);
    StepAll(gd, g, t);
  };
  step_worlds(1);
  step_worlds(2);
  // SaveCheckpoint on every rank at once (the momentum average is a collective).
  std::vector<std::string> cpu_paths(kWorld), dev_paths(kWorld);
  for (auto* side : {&cd, &gd}) {
    const bool dev = side == &gd;
    OnAllRanks([&](int r) {
      v1::SaveCheckpointRequest req;
      req.set_session_id((dev ? g : c)[r]->id);
      v1::SaveCheckpointResponse resp;
      grpc::Status st = (*side)[r]->stub().SaveCheckpoint(Ctx().get(), req, &resp);
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
      EXPECT_EQ(resp.step_index(), 2);
      (dev ? dev_paths : cpu_paths)[r] = resp.path();
    });
  }
  // The state after the save: the device ranks' equal the CPU ranks', and every rank holds the
  // same (averaged) momentum of the Dion matrices that every rank steps.
  std::vector<TensorMap> dev_state(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    TensorMap sc;
    ASSERT_TRUE(GetState(cd[r]->stub(), c[r]->id, true, &sc).ok());
    ASSERT_TRUE(GetState(gd[r]->stub(), g[r]->id, true, &dev_state[r]).ok());
    ASSERT_EQ(dev_state[r].size(), sc.size());
    for (const auto& [name, bytes] : sc) {
      EXPECT_EQ(dev_state[r][name], bytes) << name << " rank " << r;
    }
  }
  int momenta = 0;
  for (const auto& [name, bytes] : dev_state[0]) {
    if (!absl::StartsWith(name, "w") || !absl::EndsWith(name, "/state.momentum")) continue;
    ++momenta;
    EXPECT_EQ(dev_state[1][name], bytes) << name << ": not synchronized";
  }
  EXPECT_EQ(momenta, 4);
  step_worlds(3);
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < desc.params.size(); ++i) {
      EXPECT_EQ(g[r]->ParamBytes(i), c[r]->ParamBytes(i)) << desc.params[i].name << " rank " << r;
    }
  }
  // Elastic restore into one daemon each: rank 0's checkpoint with rank 1's as a shard.
  auto c1 = Daemon::Start();
  auto g1 = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY);
  ASSERT_NE(c1, nullptr);
  ASSERT_NE(g1, nullptr);
  std::unique_ptr<ShmSession> rc, rg;
  for (auto* one : {&c1, &g1}) {
    const bool dev = one == &g1;
    const std::vector<std::string>& paths = dev ? dev_paths : cpu_paths;
    v1::LoadCheckpointRequest req;
    req.set_path(paths[0]);
    req.add_shard_paths(paths[1]);
    v1::LoadCheckpointResponse resp;
    grpc::Status st = (*one)->stub().LoadCheckpoint(Ctx().get(), req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << (*one)->Log();
    EXPECT_EQ(resp.step_index(), 2);
    (dev ? rg : rc) = BindShmSession((*one)->stub(), resp.session());
  }
  ASSERT_NE(rc, nullptr);
  ASSERT_NE(rg, nullptr);
  for (int64_t t = 3; t <= 4; ++t) {
    WriteSyntheticGrads(rc.get(), desc, 7, t);
    WriteSyntheticGrads(rg.get(), desc, 7, t);
    v1::StepResponse a, b;
    ASSERT_TRUE(DoStep(c1->stub(), rc->id, t, &a).ok());
    grpc::Status st = DoStep(g1->stub(), rg->id, t, &b);
    ASSERT_TRUE(st.ok()) << st.error_message();
    for (size_t i = 0; i < desc.params.size(); ++i) {
      EXPECT_EQ(rg->ParamBytes(i), rc->ParamBytes(i)) << desc.params[i].name << " step " << t;
    }
  }
  TensorMap sc, sg;
  ASSERT_TRUE(GetState(c1->stub(), rc->id, true, &sc).ok());
  ASSERT_TRUE(GetState(g1->stub(), rg->id, true, &sg).ok());
  ASSERT_EQ(sg.size(), sc.size());
  for (const auto& [name, bytes] : sc) EXPECT_EQ(sg[name], bytes) << name;
}

}  // namespace
}  // namespace diond::service_testing
