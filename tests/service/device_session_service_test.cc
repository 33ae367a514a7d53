// Device sessions over real processes, sockets and shared memory (docs/GPU.md "Device sessions"):
// the test-only daemon diond_testdevice computes on the host-memory TEST backend behind the plugin
// ABI, so every session is a device session (its own stream, fp32 device staging, host <-> device
// copies, host registration of its shm regions). Its results must equal the normal CPU daemon's
// bit for bit, for every algorithm, over several steps, over shm and over the streamed path;
// the device traffic is checked through the counters line the test binary logs; a session that
// does not fit the TEST pool's budget gets RESOURCE_EXHAUSTED with the numbers while the daemon
// and the other sessions carry on.
#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

constexpr int kSteps = 3;

SessionDesc Desc(AlgorithmKind algorithm) { return TwoMatricesAndABias(algorithm); }

std::vector<Chunk> InitialParams(const SessionDesc& d) { return SyntheticWeights(d, 1); }

grpc::Status StepScaled(v1::Optimizer::Stub& stub, const std::string& id, int64_t index,
                        double scale, v1::StepResponse* resp) {
  auto ctx = Ctx();
  v1::StepRequest req;
  req.set_session_id(id);
  req.set_step_index(index);
  req.set_gradient_scale(scale);
  return stub.Step(ctx.get(), req, resp);
}

TensorMap State(Daemon& d, const std::string& id) {
  TensorMap m;
  grpc::Status s = GetState(d.stub(), id, true, &m);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return m;
}

class DeviceSessions : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cpu_ = Daemon::Start().release();
    dev_ = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY).release();
  }
  static void TearDownTestSuite() {
    delete cpu_;
    delete dev_;
    cpu_ = dev_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(cpu_, nullptr);
    ASSERT_NE(dev_, nullptr);
  }
  // The same session `d` over shm on the CPU daemon (*c) and the device daemon (*g), each given
  // the initial weights.
  void Twins(const SessionDesc& d, std::unique_ptr<ShmSession>* c, std::unique_ptr<ShmSession>* g) {
    *c = CreateShmSession(cpu_->stub(), d.Request());
    *g = CreateShmSession(dev_->stub(), d.Request());
    ASSERT_NE(*c, nullptr);
    ASSERT_NE(*g, nullptr);
    ASSERT_TRUE(SetState(cpu_->stub(), (*c)->id, InitialParams(d)).ok());
    ASSERT_TRUE(SetState(dev_->stub(), (*g)->id, InitialParams(d)).ok());
  }
  static Daemon* cpu_;
  static Daemon* dev_;
};
Daemon* DeviceSessions::cpu_ = nullptr;
Daemon* DeviceSessions::dev_ = nullptr;

TEST_F(DeviceSessions, TheStartUpLineSaysItIsATestBackend) {
  const std::string log = dev_->Log();
  EXPECT_TRUE(absl::StrContains(
      log, "TEST DEVICE BACKEND: host memory behind the plugin ABI; not a product feature"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "steps run on test-device:0")) << log;
  EXPECT_FALSE(absl::StrContains(cpu_->Log(), "TEST DEVICE")) << cpu_->Log();
}

class EveryAlgorithm : public DeviceSessions,
                       public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(EveryAlgorithm, OverShmEqualsTheCpuDaemonBitForBit) {
  const SessionDesc d = Desc(GetParam());
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::vector<float> grad = SyntheticValues(7, t, i, d.Numel(i));
      c->WriteGrad(i, grad);
      g->WriteGrad(i, grad);
    }
    // Step 2 scales the gradients: the widen-and-scale pass runs on the device copy.
    const double scale = t == 2 ? 0.5 : 1.0;
    v1::StepResponse rc, rg;
    grpc::Status sc = StepScaled(cpu_->stub(), c->id, t, scale, &rc);
    grpc::Status sg = StepScaled(dev_->stub(), g->id, t, scale, &rg);
    ASSERT_TRUE(sc.ok()) << sc.error_message();
    ASSERT_TRUE(sg.ok()) << sg.error_message() << "\n" << dev_->Log();
    EXPECT_FALSE(rg.skipped());
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
    ASSERT_EQ(rg.update_norms_size(), rc.update_norms_size());
  }
  // The weights changed (the comparison is not of two untouched arenas) ...
  EXPECT_NE(c->ParamBytes(0), InitialParams(d)[0].data);
  // ... and the optimizer state is the same too.
  const TensorMap sc = State(*cpu_, c->id), sg = State(*dev_, g->id);
  ASSERT_EQ(sg.size(), sc.size());
  for (const auto& [name, bytes] : sc) {
    ASSERT_TRUE(sg.count(name)) << name;
    EXPECT_EQ(sg.at(name), bytes) << name;
  }
  EXPECT_TRUE(CloseSession(cpu_->stub(), c->id).ok());
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

INSTANTIATE_TEST_SUITE_P(DeviceSessions, EveryAlgorithm,
                         ::testing::Values(AlgorithmKind::kMuon, AlgorithmKind::kNorMuon,
                                           AlgorithmKind::kDion, AlgorithmKind::kDion2,
                                           AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW,
                                           AlgorithmKind::kLion));

class Bf16Weights : public DeviceSessions, public ::testing::WithParamInterface<bool> {};

TEST_P(Bf16Weights, WidenedAndNarrowedOnTheDeviceEqualTheCpuDaemonBitForBit) {
  // bf16 weights and gradients: widened on the device copy, the new weights narrowed there;
  // with fp32 master weights (GetParam) the master comes back for the commit.
  const SessionDesc d = Desc(AlgorithmKind::kNorMuon);
  v1::CreateSessionRequest req = d.Request();
  req.set_fp32_master_weights(GetParam());
  for (int i = 0; i < 2; ++i) req.mutable_parameters(i)->set_dtype(v1::DTYPE_BF16);
  auto c = CreateShmSession(cpu_->stub(), req);
  auto g = CreateShmSession(dev_->stub(), req);
  ASSERT_NE(c, nullptr);
  ASSERT_NE(g, nullptr);
  auto bytes = [&](size_t i, const std::vector<float>& v) {
    return i < 2 ? Bf16Bytes(v) : FloatBytes(v);
  };
  for (size_t i = 0; i < d.params.size(); ++i) {
    const std::string init = bytes(i, SyntheticValues(1, 0, i, d.Numel(i)));
    c->params_seg->Write(c->tensor(i).param_offset_bytes(), init);
    g->params_seg->Write(g->tensor(i).param_offset_bytes(), init);
  }
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::string grad = bytes(i, SyntheticValues(7, t, i, d.Numel(i)));
      c->WriteGradBytes(i, grad);
      g->WriteGradBytes(i, grad);
    }
    v1::StepResponse rc, rg;
    ASSERT_TRUE(StepScaled(cpu_->stub(), c->id, t, t == 3 ? 2.0 : 1.0, &rc).ok());
    const std::map<std::string, int64_t> before = LastCounters(*dev_);
    grpc::Status sg = StepScaled(dev_->stub(), g->id, t, t == 3 ? 2.0 : 1.0, &rg);
    ASSERT_TRUE(sg.ok()) << sg.error_message();
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
    if (t >= 2) {
      // Host -> device per step: every gradient, and the weights without master weights (the
      // master weights are on the device), plus the update graph's scalar records.
      const std::map<std::string, int64_t> after = LastCounters(*dev_);
      const int64_t n = static_cast<int64_t>(d.params.size());
      const int64_t weights_up = GetParam() ? n - 2 : n;
      EXPECT_EQ(after.at("copies_to_device") - before.at("copies_to_device"), n + weights_up + 1)
          << "step " << t;
    }
  }
  EXPECT_NE(g->ParamBytes(0), Bf16Bytes(SyntheticValues(1, 0, 0, d.Numel(0))));
  // SetState of the weights (the master weights where kept), then one more step: the device
  // session's master weights take them as the CPU daemon's do.
  std::vector<Chunk> fresh;  // in the parameters' dtypes
  for (size_t i = 0; i < d.params.size(); ++i) {
    fresh.push_back({d.params[i].name, 0, bytes(i, SyntheticValues(5, 0, i, d.Numel(i)))});
  }
  for (auto [daemon, id] : {std::make_pair(cpu_, c->id), std::make_pair(dev_, g->id)}) {
    grpc::Status st = SetState(daemon->stub(), id, fresh);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  for (size_t i = 0; i < d.params.size(); ++i) {
    ASSERT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << " after SetState";
    const std::string grad = bytes(i, SyntheticValues(7, kSteps + 1, i, d.Numel(i)));
    c->WriteGradBytes(i, grad);
    g->WriteGradBytes(i, grad);
  }
  ASSERT_TRUE(DoStep(cpu_->stub(), c->id, kSteps + 1).ok());
  ASSERT_TRUE(DoStep(dev_->stub(), g->id, kSteps + 1).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << ", after SetState";
  }
  // The master weights live on the device with the state: a step copies none of them between
  // host and device, and all three phases run as graphs from the second step.
  const std::string log = dev_->Log();
  EXPECT_FALSE(absl::StrContains(log, absl::StrCat("session ", g->id, ": the read phase of")))
      << log;
  for (const char* phase : {"read", "update", "write"}) {
    EXPECT_TRUE(absl::StrContains(
        log, absl::StrCat("session ", g->id, ": step 2: the ", phase, " phase was captured")))
        << phase << "\n"
        << log;
  }
  const TensorMap sc = State(*cpu_, c->id), sg = State(*dev_, g->id);
  EXPECT_EQ(sg, sc);  // the fp32 weights (the master weights when kept) and the state
  EXPECT_TRUE(CloseSession(cpu_->stub(), c->id).ok());
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

INSTANTIATE_TEST_SUITE_P(DeviceSessions, Bf16Weights, ::testing::Bool());

TEST_F(DeviceSessions, NonFiniteGradientsFoundOnTheDeviceChangeNothing) {
  SessionDesc d = Desc(AlgorithmKind::kMuon);
  d.non_finite = v1::NON_FINITE_POLICY_ERROR;
  auto g = CreateShmSession(dev_->stub(), d.Request());
  ASSERT_NE(g, nullptr);
  ASSERT_TRUE(SetState(dev_->stub(), g->id, InitialParams(d)).ok());
  for (size_t i = 0; i < d.params.size(); ++i)
    g->WriteGrad(i, SyntheticValues(7, 1, i, d.Numel(i)));
  ASSERT_TRUE(DoStep(dev_->stub(), g->id, 1).ok());
  const std::string arena = g->params_seg->Bytes(0, g->layout.param_arena_bytes());
  const TensorMap before = State(*dev_, g->id);
  std::vector<float> bad = SyntheticValues(7, 2, 2, d.Numel(2));
  bad[3] = std::numeric_limits<float>::infinity();
  g->WriteGrad(2, bad);
  for (double scale : {1.0, 0.25}) {  // in place (f32) and through the widening pass
    v1::StepResponse r;
    grpc::Status s = StepScaled(dev_->stub(), g->id, 2, scale, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(g->params_seg->Bytes(0, g->layout.param_arena_bytes()), arena);
    EXPECT_EQ(State(*dev_, g->id), before);
  }
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

TEST_F(DeviceSessions, TheStreamedPathEqualsTheCpuDaemonBitForBit) {
  const SessionDesc d = Desc(AlgorithmKind::kDion);
  std::string ids[2];
  Daemon* daemons[2] = {cpu_, dev_};
  for (int k = 0; k < 2; ++k) {
    auto ctx = Ctx();
    v1::CreateSessionResponse resp;
    ASSERT_TRUE(daemons[k]->stub().CreateSession(ctx.get(), d.Request(), &resp).ok());
    ids[k] = resp.session_id();
    ASSERT_TRUE(SetState(daemons[k]->stub(), ids[k], InitialParams(d)).ok());
  }
  for (int64_t t = 1; t <= kSteps; ++t) {
    std::vector<Chunk> grads;
    for (size_t i = 0; i < d.params.size(); ++i) {
      grads.push_back({d.params[i].name, 0, FloatBytes(SyntheticValues(9, t, i, d.Numel(i)))});
    }
    TensorMap out[2];
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(PushGradients(daemons[k]->stub(), ids[k], grads).ok());
      grpc::Status s = DoStep(daemons[k]->stub(), ids[k], t);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_TRUE(PullParameters(daemons[k]->stub(), ids[k], &out[k]).ok());
    }
    EXPECT_EQ(out[1], out[0]) << "step " << t;
    EXPECT_NE(out[1]["w"], InitialParams(d)[0].data);
  }
  // The daemon's host arenas of the streamed path are not pinned: no graph copies them.
  EXPECT_TRUE(absl::StrContains(dev_->Log(), absl::StrCat("session ", ids[1],
                                                          ": the read phase of its steps runs "
                                                          "eagerly, not as a captured graph "
                                                          "(reason pageable: ")))
      << dev_->Log();
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(CloseSession(daemons[k]->stub(), ids[k]).ok());
}

// graph (docs/GPU.md "CUDA graphs"): the read and write phases' graphs copy the trainer's
// memory at the addresses they were captured with. New regions (the trainer moves its arenas)
// drop them and capture again at the next step; a graph that kept the old addresses would read
// stale gradients and write the weights where the trainer no longer looks.
TEST_F(DeviceSessions, NewRegionsAreCapturedAgainAndStillEqualTheCpuDaemon) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  auto step = [&](ShmSession* cs, ShmSession* gs, int64_t t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      cs->WriteGrad(i, SyntheticValues(13, t, i, d.Numel(i)));
      gs->WriteGrad(i, SyntheticValues(13, t, i, d.Numel(i)));
    }
    ASSERT_TRUE(DoStep(cpu_->stub(), cs->id, t).ok());
    grpc::Status s = DoStep(dev_->stub(), gs->id, t);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (size_t i = 0; i < d.params.size(); ++i) {
      ASSERT_EQ(gs->ParamBytes(i), cs->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
  };
  for (int64_t t = 1; t <= 3; ++t) ASSERT_NO_FATAL_FAILURE(step(c.get(), g.get(), t));
  // The trainer moves to new segments, its weights copied over.
  for (auto [daemon, session] : {std::make_pair(cpu_, c.get()), std::make_pair(dev_, g.get())}) {
    for (const std::string& region : {session->param_region, session->grad_region}) {
      v1::UnregisterRegionRequest req;
      req.set_session_id(session->id);
      req.set_region_id(region);
      v1::UnregisterRegionResponse r;
      auto ctx = Ctx();
      grpc::Status st = daemon->stub().UnregisterRegion(ctx.get(), req, &r);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
  }
  auto c2 = BindShmSession(cpu_->stub(), c->layout);
  auto g2 = BindShmSession(dev_->stub(), g->layout);
  ASSERT_NE(c2, nullptr);
  ASSERT_NE(g2, nullptr);
  for (size_t i = 0; i < d.params.size(); ++i) {
    c2->params_seg->Write(c2->tensor(i).param_offset_bytes(), c->ParamBytes(i));
    g2->params_seg->Write(g2->tensor(i).param_offset_bytes(), g->ParamBytes(i));
  }
  // The old segments are left with other bytes: a graph still copying them would show.
  for (size_t i = 0; i < d.params.size(); ++i) {
    g->WriteGrad(i, std::vector<float>(static_cast<size_t>(d.Numel(i)), 1e3f));
  }
  for (int64_t t = 4; t <= 6; ++t) ASSERT_NO_FATAL_FAILURE(step(c2.get(), g2.get(), t));
  const std::string log = dev_->Log();
  for (const char* phase : {"read", "write"}) {
    for (int64_t t : {2, 4}) {
      EXPECT_TRUE(absl::StrContains(log, absl::StrCat("session ", g->id, ": step ", t, ": the ",
                                                      phase, " phase was captured as a graph")))
          << phase << ", step " << t << "\n"
          << log;
    }
  }
  // The update reads only the device staging: its graphs stay.
  EXPECT_FALSE(absl::StrContains(
      log, absl::StrCat("session ", g->id, ": step 4: the update phase was captured")))
      << log;
  EXPECT_EQ(State(*dev_, g->id), State(*cpu_, c->id));
  EXPECT_TRUE(CloseSession(cpu_->stub(), c->id).ok());
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

// A checkpoint of a device session with fp32 master weights (they live on the device): saved,
// loaded into a new session, bound to new segments (the restored master weights go back onto
// the device), and stepped on: equal to the CPU daemon doing the same, bit for bit.
TEST_F(DeviceSessions, AMasterWeightCheckpointRoundTripsThroughTheDevice) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  v1::CreateSessionRequest req = d.Request();
  req.set_fp32_master_weights(true);
  for (int i = 0; i < 2; ++i) req.mutable_parameters(i)->set_dtype(v1::DTYPE_BF16);
  const std::string dir = testing::MakeTempDir("diond_dev_ckpt");
  std::unique_ptr<ShmSession> sessions[2];  // [0] the CPU daemon's, [1] the device daemon's
  Daemon* daemons[2] = {cpu_, dev_};
  auto bytes = [&](size_t i, const std::vector<float>& v) {
    return i < 2 ? Bf16Bytes(v) : FloatBytes(v);
  };
  auto step = [&](ShmSession* s, Daemon* daemon, int64_t t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      s->WriteGradBytes(i, bytes(i, SyntheticValues(17, t, i, d.Numel(i))));
    }
    grpc::Status st = DoStep(daemon->stub(), s->id, t);
    ASSERT_TRUE(st.ok()) << st.error_message();
  };
  std::string paths[2];
  for (int k = 0; k < 2; ++k) {
    sessions[k] = CreateShmSession(daemons[k]->stub(), req);
    ASSERT_NE(sessions[k], nullptr);
    for (size_t i = 0; i < d.params.size(); ++i) {
      sessions[k]->params_seg->Write(sessions[k]->tensor(i).param_offset_bytes(),
                                     bytes(i, SyntheticValues(1, 0, i, d.Numel(i))));
    }
    for (int64_t t = 1; t <= 3; ++t)
      ASSERT_NO_FATAL_FAILURE(step(sessions[k].get(), daemons[k], t));
    v1::SaveCheckpointRequest save;
    save.set_session_id(sessions[k]->id);
    save.set_directory(absl::StrCat(dir, "/", k));
    v1::SaveCheckpointResponse saved;
    grpc::Status st = daemons[k]->stub().SaveCheckpoint(Ctx().get(), save, &saved);
    ASSERT_TRUE(st.ok()) << st.error_message();
    paths[k] = saved.path();
  }
  EXPECT_EQ(State(*dev_, sessions[1]->id), State(*cpu_, sessions[0]->id));
  std::unique_ptr<ShmSession> restored[2];
  for (int k = 0; k < 2; ++k) {
    v1::LoadCheckpointResponse loaded;
    grpc::Status st = LoadCheckpointFrom(daemons[k]->stub(), paths[k], &loaded);
    ASSERT_TRUE(st.ok()) << st.error_message();
    // The held weights (the master weights) go into the new segments and onto the device.
    restored[k] = BindShmSession(daemons[k]->stub(), loaded.session());
    ASSERT_NE(restored[k], nullptr);
    for (size_t i = 0; i < d.params.size(); ++i) {
      ASSERT_EQ(restored[k]->ParamBytes(i), sessions[k]->ParamBytes(i)) << d.params[i].name;
    }
  }
  EXPECT_EQ(State(*dev_, restored[1]->id), State(*cpu_, restored[0]->id));
  for (int64_t t = 4; t <= 6; ++t) {
    for (int k = 0; k < 2; ++k) ASSERT_NO_FATAL_FAILURE(step(restored[k].get(), daemons[k], t));
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(restored[1]->ParamBytes(i), restored[0]->ParamBytes(i))
          << d.params[i].name << ", step " << t;
    }
  }
  EXPECT_EQ(State(*dev_, restored[1]->id), State(*cpu_, restored[0]->id));
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(CloseSession(daemons[k]->stub(), sessions[k]->id).ok());
    EXPECT_TRUE(CloseSession(daemons[k]->stub(), restored[k]->id).ok());
  }
  std::filesystem::remove_all(dir);
}

TEST(DeviceSessionCounters, OneStreamPerSessionCopiesPerStepAndPairedHostRegistrations) {
  // A fresh test daemon, so that its counters count this test's traffic only.
  auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY);
  ASSERT_NE(dev, nullptr);
  std::map<std::string, int64_t> start = LastCounters(*dev);
  ASSERT_FALSE(start.empty()) << dev->Log();
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  const int64_t tensors = static_cast<int64_t>(d.params.size());
  int64_t numel = 0;
  for (size_t i = 0; i < d.params.size(); ++i) numel += d.Numel(i);
  {
    auto s = CreateShmSession(dev->stub(), d.Request());
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(SetState(dev->stub(), s->id, InitialParams(d)).ok());
    for (int64_t t = 1; t <= kSteps; ++t) {
      for (size_t i = 0; i < d.params.size(); ++i) {
        s->WriteGrad(i, SyntheticValues(7, t, i, d.Numel(i)));
      }
      ASSERT_TRUE(DoStep(dev->stub(), s->id, t).ok());
    }
    // From its second step the session's step runs as three graphs (docs/GPU.md "CUDA graphs"):
    // the reads and the writes, one form each, and the update: over shm the groups step staged
    // copies whose state and staging swap at each commit, so two update graphs are captured
    // (steps 2 and 3), each logged once, and replayed from then on; nothing fell back.
    const std::string log = dev->Log();
    EXPECT_FALSE(absl::StrContains(log, "runs eagerly")) << log;
    for (const char* phase : {"read", "update", "write"}) {
      EXPECT_TRUE(absl::StrContains(log, absl::StrCat("session ", s->id, ": step 2: the ", phase,
                                                      " phase was captured as a graph (")))
          << phase << "\n"
          << log;
    }
    EXPECT_TRUE(absl::StrContains(
        log, absl::StrCat("session ", s->id, ": step 3: the update phase was captured")))
        << log;
    std::map<std::string, int64_t> c = LastCounters(*dev);
    EXPECT_EQ(c["graphs_made"] - start["graphs_made"], 1 + 2 + 1);
    EXPECT_EQ(c["graph_launches"] - start["graph_launches"], 3 * (kSteps - 1));
    EXPECT_EQ(c["captures_invalidated"], start["captures_invalidated"]);
    // Muon's ApplyUpdate and the AdamW group's step read their scalars from the device.
    EXPECT_GT(c["device_scalar_ops"], start["device_scalar_ops"]);
    EXPECT_EQ(c["streams_created"] - start["streams_created"], 1);
    EXPECT_EQ(c["streams_live"], start["streams_live"] + 1);
    // Two regions (PARAMETERS, GRADIENTS), each registered once for DMA, and the session's
    // host words (the flag's and the norms' read-backs).
    EXPECT_EQ(c["host_registers"] - start["host_registers"], 3);
    EXPECT_EQ(c["host_registered_live"], 3);
    // Per step and fp32 tensor: gradients and weights host -> device, weights device -> host,
    // all queued on the session stream (asynchronous). The rules run on the device too, and
    // each group reads its parameters' Σ(Δx)² back (one float per parameter; docs/KERNELS.md
    // §4.3), queued with the weights' copies; the step itself reads its non-finite flag back
    // once (one float, queued, then waited for) and waits once for the new weights and the
    // norms: 2 host waits per step. A replayed graph's copies are the same copies.
    const int64_t groups = static_cast<int64_t>(d.groups.size());
    // Each launch of the update's graph adds one queued upload: the step's scalar records (a few
    // dozen bytes); the read and write graphs have none.
    const int64_t launches = kSteps - 1;
    EXPECT_EQ(c["copies_to_device"] - start["copies_to_device"], 2 * tensors * kSteps + launches);
    EXPECT_EQ(c["async_copies_to_device"] - start["async_copies_to_device"],
              2 * tensors * kSteps + launches);
    EXPECT_EQ(c["copies_to_host"] - start["copies_to_host"], (tensors + groups + 1) * kSteps);
    EXPECT_EQ(c["async_copies_to_host"] - start["async_copies_to_host"],
              (tensors + groups + 1) * kSteps);
    const int64_t record_bytes =
        c["bytes_to_device"] - start["bytes_to_device"] - 2 * 4 * numel * kSteps;
    EXPECT_GT(record_bytes, 0);
    EXPECT_LE(record_bytes, 256 * launches);
    EXPECT_EQ(c["bytes_to_host"] - start["bytes_to_host"], 4 * (numel + tensors + 1) * kSteps);
    EXPECT_EQ(c["syncs"] - start["syncs"], 2 * kSteps);
    EXPECT_GT(c["deferred"], start["deferred"]) << "the step's work is queued on its stream";
    EXPECT_GT(c["pool_in_use"], start["pool_in_use"]);  // the staging
    // Every op of the session ran on its own stream.
    EXPECT_GT(c["ops"], start["ops"]);
    EXPECT_EQ(c["ops_on_default_stream"], start["ops_on_default_stream"]);
    ASSERT_TRUE(CloseSession(dev->stub(), s->id).ok());
  }
  // The next session change reports after the closed session is gone: its stream destroyed and
  // its regions unregistered.
  auto ctx = Ctx();
  v1::CreateSessionResponse resp;
  ASSERT_TRUE(dev->stub().CreateSession(ctx.get(), d.Request(), &resp).ok());
  std::map<std::string, int64_t> c = LastCounters(*dev);
  EXPECT_EQ(c["streams_created"] - start["streams_created"], 2);
  EXPECT_EQ(c["streams_live"], start["streams_live"] + 1);
  EXPECT_EQ(c["host_unregisters"] - start["host_unregisters"], 3);
  EXPECT_EQ(c["host_registered_live"], 1);  // the new session's host words
  EXPECT_EQ(c["host_register_errors"], 0);
}

// asynccopy: the host waits of a device step over shm, per algorithm of the main group (the
// "vec" group is AdamW): the step's own two (the non-finite flag read back once before the
// rules, one wait for the new weights and the groups' update norms before the answer), plus the
// rules' listed sync points (docs/GPU.md "Sync points": none for Muon, NorMuon, AdamW, Lion).
// The step's own copies are all queued (the flag's read-back too), so Muon, NorMuon, AdamW and
// Lion make no synchronous copy at all. The weights equal the CPU daemon's bit for bit (the TEST
// backend runs the queued work in stream order only when the step waits: a missing wait would
// hand the trainer stale weights).
class DeviceStepSyncs : public DeviceSessions,
                        public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(DeviceStepSyncs, TwoHostWaitsPerStepBesideTheRulesListedOnes) {
  constexpr int64_t kGroups = 2;
  const AlgorithmKind kind = GetParam();
  const SessionDesc d = Desc(kind);
  const int64_t tensors = static_cast<int64_t>(d.params.size());
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  // The counters line of the session's creation (SetState over shm does not touch the device).
  const std::map<std::string, int64_t> before = LastCounters(*dev_);
  ASSERT_FALSE(before.empty()) << dev_->Log();
  for (int64_t t = 1; t <= kSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      c->WriteGrad(i, SyntheticValues(7, t, i, d.Numel(i)));
      g->WriteGrad(i, SyntheticValues(7, t, i, d.Numel(i)));
    }
    ASSERT_TRUE(DoStep(cpu_->stub(), c->id, t).ok());
    ASSERT_TRUE(DoStep(dev_->stub(), g->id, t).ok());
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
  }
  const std::map<std::string, int64_t> after = LastCounters(*dev_);
  auto per_step = [&](const char* k) -> double {
    return static_cast<double>(after.at(k) - before.at(k)) / kSteps;
  };
  const double syncs = per_step("syncs");
  const double sync_reads = per_step("copies_to_host") - per_step("async_copies_to_host");
  // The step's own copies are all queued: gradients and weights up, weights down; and from the
  // second step, where the update runs as a graph, the upload of its scalar records.
  auto delta = [&](const char* k) { return after.at(k) - before.at(k); };
  // (Three graphs a step from the second, two where the update runs eagerly: Dion, Dion2.)
  const bool update_graph = kind == AlgorithmKind::kMuon || kind == AlgorithmKind::kNorMuon ||
                            kind == AlgorithmKind::kAdamW || kind == AlgorithmKind::kLion;
  EXPECT_EQ(delta("graph_launches"), (update_graph ? 3 : 2) * (kSteps - 1)) << AlgorithmName(kind);
  const int64_t launches = update_graph ? kSteps - 1 : 0;  // those with scalar records
  EXPECT_EQ(delta("async_copies_to_device"), 2 * tensors * kSteps + launches);
  // ... and down, with the new weights, each group's update norms (one queued copy a group), and
  // the non-finite flag.
  EXPECT_EQ(per_step("async_copies_to_host"), tensors + kGroups + 1);
  // At least the step's two waits.
  EXPECT_GE(syncs, 2) << AlgorithmName(kind);
  if (update_graph) {
    // Rules without uploads or other sync points of their own in a step (docs/GPU.md): exactly
    // the step's two waits, both for the stream (the flag comes back with the first).
    EXPECT_EQ(delta("copies_to_device"), 2 * tensors * kSteps + launches)
        << "no synchronous upload";
    EXPECT_EQ(syncs, 2) << AlgorithmName(kind) << ": the step's 2";
    EXPECT_EQ(sync_reads, 0) << AlgorithmName(kind);
  }
  // Dion and Dion2 add their own (the all-zero flags, the initial Q's upload, the top-k
  // indices, the Cholesky-QR fallback), bounded per bucket by device_step_test.
  EXPECT_TRUE(CloseSession(cpu_->stub(), c->id).ok());
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

// The rules of the per-rule device tests below, and their test names.
const AlgorithmKind kDeviceRules[] = {AlgorithmKind::kMuon,  AlgorithmKind::kNorMuon,
                                      AlgorithmKind::kAdamW, AlgorithmKind::kLion,
                                      AlgorithmKind::kDion,  AlgorithmKind::kDion2};
std::string RuleName(const ::testing::TestParamInfo<AlgorithmKind>& i) {
  return std::string(AlgorithmName(i.param));
}

INSTANTIATE_TEST_SUITE_P(Rules, DeviceStepSyncs, ::testing::ValuesIn(kDeviceRules), RuleName);

// StepRequest.params_without_grad (torch.optim's `p.grad is None`), every algorithm in both
// precisions, over shm on the CPU daemon and on the device daemon. Independent expectations:
//   * a parameter without a gradient keeps its weights and its state byte for byte (its
//     gradient holds NaNs, which would skip the step if they were read);
//   * the others equal, bit for bit, a session that does not have the skipped parameters at all
//     (given the same initial state): a parameter without a gradient changes nothing for the
//     rest of its group, its megabatch included;
//   * the device session equals the CPU daemon's bit for bit, its captured graphs included
//     (a step with another set of skipped parameters is another graph).
// Then every parameter has its gradient again and each continues from its own state.
class WithoutGrad
    : public DeviceSessions,
      public ::testing::WithParamInterface<std::tuple<AlgorithmKind, optim::Precision>> {};

TEST_P(WithoutGrad, SkippedParametersAndStateStayAndTheOthersIgnoreThem) {
  const auto [kind, precision] = GetParam();
  auto make = [&, kind = kind, precision = precision](const std::vector<std::string>& names) {
    SessionDesc d;
    GroupDesc main = MakeGroup("main", kind, 0.01);
    main.config.precision = precision;
    main.proto.set_precision(precision == optim::Precision::kFp32 ? v1::PRECISION_FP32
                                                                  : v1::PRECISION_BF16_REFERENCE);
    d.groups = {main, MakeGroup("vec", AlgorithmKind::kAdamW, 0.001)};
    for (const std::string& n : names) {
      const bool vec = n[0] == 'b';
      d.params.push_back({n,
                          vec        ? std::vector<int64_t>{16}
                          : n == "u" ? std::vector<int64_t>{16, 24}
                                     : std::vector<int64_t>{24, 16},
                          vec ? "vec" : "main"});
    }
    return d;
  };
  const std::vector<std::string> all = {"w0", "w1", "w2", "u", "b0", "b1"};
  const SessionDesc d = make(all);
  const SessionDesc r = make({"w0", "w2", "u", "b0"});  // without w1 and b1
  const std::vector<int32_t> frozen = {1, 5};           // w1, b1
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  std::unique_ptr<ShmSession> rc = CreateShmSession(cpu_->stub(), r.Request());
  ASSERT_NE(rc, nullptr);
  {
    // The reduced session starts from the same weights and state (Dion's Q is drawn per
    // session, not per name).
    TensorMap full = State(*cpu_, c->id);
    std::vector<Chunk> init;
    for (const ParamDesc& p : r.params) {
      for (const auto& [k, v] : full) {
        if (k == p.name || absl::StartsWith(k, p.name + "/state.")) {
          for (Chunk& ch : SplitTensor(k, v)) init.push_back(std::move(ch));
        }
      }
    }
    ASSERT_TRUE(SetState(cpu_->stub(), rc->id, init).ok());
  }
  const TensorMap start = State(*cpu_, c->id);
  auto step_all = [&](int64_t t, const std::vector<int32_t>& without) {
    std::vector<bool> none(all.size(), false);
    for (int32_t i : without) none[static_cast<size_t>(i)] = true;
    size_t k = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      std::vector<float> grad = SyntheticValues(13, t, i, d.Numel(i));
      if (!none[i]) {
        if (t <= 4) rc->WriteGrad(k++, grad);
      } else {
        grad.assign(grad.size(), std::nanf(""));
      }
      c->WriteGrad(i, grad);
      g->WriteGrad(i, grad);
    }
    v1::StepResponse a, b;
    grpc::Status sc = DoStepWithout(cpu_->stub(), c->id, t, without, &a);
    grpc::Status sg = DoStepWithout(dev_->stub(), g->id, t, without, &b);
    ASSERT_TRUE(sc.ok()) << sc.error_message();
    ASSERT_TRUE(sg.ok()) << sg.error_message() << "\n" << dev_->Log();
    EXPECT_FALSE(a.skipped());
    EXPECT_FALSE(b.skipped());
    if (t <= 4) {
      grpc::Status sr = DoStep(cpu_->stub(), rc->id, t);
      ASSERT_TRUE(sr.ok()) << sr.error_message();
    }
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << all[i] << ", step " << t;
    }
  };
  for (int64_t t = 1; t <= 4; ++t) {
    ASSERT_NO_FATAL_FAILURE(step_all(t, frozen));
    size_t k = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      if (i == 1 || i == 5) {
        EXPECT_EQ(c->ParamBytes(i), start.at(all[i])) << all[i] << " moved at step " << t;
        continue;
      }
      EXPECT_EQ(c->ParamBytes(i), rc->ParamBytes(k++)) << all[i] << ", step " << t;
    }
  }
  EXPECT_NE(c->ParamBytes(0), start.at("w0"));
  TensorMap now = State(*cpu_, c->id);
  for (const auto& [k, v] : start) {
    if (absl::StartsWith(k, "w1/") || absl::StartsWith(k, "b1/")) {
      EXPECT_EQ(now.at(k), v) << k;
    }
  }
  EXPECT_EQ(State(*dev_, g->id), now);
  // Everything has its gradient again; then another set goes without (another graph form).
  ASSERT_NO_FATAL_FAILURE(step_all(5, {}));
  EXPECT_NE(c->ParamBytes(1), start.at("w1"));
  ASSERT_NO_FATAL_FAILURE(step_all(6, {3, 4}));
  ASSERT_NO_FATAL_FAILURE(step_all(7, {3, 4}));
  EXPECT_EQ(State(*dev_, g->id), State(*cpu_, c->id));
  for (auto& [daemon, s] : {std::make_pair(cpu_, c.get()), std::make_pair(dev_, g.get())}) {
    EXPECT_TRUE(CloseSession(daemon->stub(), s->id).ok());
  }
  EXPECT_TRUE(CloseSession(cpu_->stub(), rc->id).ok());
}

INSTANTIATE_TEST_SUITE_P(
    DeviceSessions, WithoutGrad,
    ::testing::Values(std::make_tuple(AlgorithmKind::kMuon, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kNorMuon, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kDion, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kDion2, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kNorDion2, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kAdamW, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kLion, optim::Precision::kFp32),
                      std::make_tuple(AlgorithmKind::kMuon, optim::Precision::kBf16Reference),
                      std::make_tuple(AlgorithmKind::kNorMuon, optim::Precision::kBf16Reference),
                      std::make_tuple(AlgorithmKind::kDion2, optim::Precision::kBf16Reference),
                      std::make_tuple(AlgorithmKind::kNorDion2, optim::Precision::kBf16Reference)),
    [](const auto& info) {
      return absl::StrCat(AlgorithmName(std::get<0>(info.param)), "_",
                          optim::PrecisionName(std::get<1>(info.param)));
    });

// Bad sets of parameters without a gradient are refused before anything changes, and the same
// step index then runs.
TEST_F(DeviceSessions, BadParamsWithoutGradAreRefusedAndChangeNothing) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  for (auto& [daemon, s] : {std::make_pair(cpu_, c.get()), std::make_pair(dev_, g.get())}) {
    WriteSyntheticGrads(s, d, 3, 1);
    const TensorMap before = State(*daemon, s->id);
    const int32_t n = static_cast<int32_t>(d.params.size());
    for (const auto& [bad, says] : std::vector<std::pair<std::vector<int32_t>, std::string>>{
             {{n}, "is not a parameter of the session"},
             {{-1}, "is not a parameter of the session"},
             {{0, 1, 0}, "is named twice"},
             {{std::numeric_limits<int32_t>::max()}, "is not a parameter"}}) {
      grpc::Status st = DoStepWithout(daemon->stub(), s->id, 1, bad);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << says;
      EXPECT_TRUE(absl::StrContains(st.error_message(), says)) << st.error_message();
    }
    EXPECT_EQ(State(*daemon, s->id), before);
    EXPECT_TRUE(DoStepWithout(daemon->stub(), s->id, 1, {0}).ok());
    EXPECT_TRUE(CloseSession(daemon->stub(), s->id).ok());
  }
}

// graph (docs/GPU.md "CUDA graphs"): from the second step a device session's update runs as a
// captured graph, replayed with the step's own scalars. The TEST backend emulates the capture
// (kernels/testing/host_device_backend.h): a replay that kept the scalars of the step it was
// captured in would differ from the CPU daemon, which gets the same learning-rate schedule (a
// new lr_override for each group at every step).
class DeviceStepGraphs : public DeviceSessions,
                         public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(DeviceStepGraphs, ReplayedUpdatesWithANewLearningRateEachStepEqualTheCpuDaemon) {
  const AlgorithmKind kind = GetParam();
  const SessionDesc d = Desc(kind);
  std::unique_ptr<ShmSession> c, g;
  ASSERT_NO_FATAL_FAILURE(Twins(d, &c, &g));
  const std::map<std::string, int64_t> before = LastCounters(*dev_);
  constexpr int64_t kGraphSteps = 9;
  for (int64_t t = 1; t <= kGraphSteps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      c->WriteGrad(i, SyntheticValues(11, t, i, d.Numel(i)));
      g->WriteGrad(i, SyntheticValues(11, t, i, d.Numel(i)));
    }
    v1::StepRequest req;
    req.set_step_index(t);
    (*req.mutable_lr_override())["main"] = 0.02 / static_cast<double>(t);
    (*req.mutable_lr_override())["vec"] = 0.001 * static_cast<double>(t);
    v1::StepResponse rc, rg;
    for (auto [daemon, session, resp] :
         {std::make_tuple(cpu_, c.get(), &rc), std::make_tuple(dev_, g.get(), &rg)}) {
      req.set_session_id(session->id);
      auto ctx = Ctx();
      grpc::Status s = daemon->stub().Step(ctx.get(), req, resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_EQ(g->ParamBytes(i), c->ParamBytes(i)) << d.params[i].name << ", step " << t;
    }
    for (const auto& [group, norm] : rc.update_norms()) {
      EXPECT_EQ(rg.update_norms().at(group), norm) << group << ", step " << t;
    }
  }
  EXPECT_EQ(State(*dev_, g->id), State(*cpu_, c->id));
  const std::map<std::string, int64_t> after = LastCounters(*dev_);
  const int64_t launches = after.at("graph_launches") - before.at("graph_launches");
  const int64_t made = after.at("graphs_made") - before.at("graphs_made");
  const std::string log = dev_->Log();
  // Every step from the second reads (uploads, scans) and writes (the new weights into the
  // trainer's pinned shm) as graphs, one form each.
  for (const char* phase : {"read", "write"}) {
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("session ", g->id, ": step 2: the ", phase,
                                                    " phase was captured as a graph")))
        << phase << "\n"
        << log;
  }
  if (kind == AlgorithmKind::kDion || kind == AlgorithmKind::kDion2) {
    // Their rules read values back inside the update (all-zero flags, top-k indices): the
    // recording finds it, the update is not captured, and the session says so once.
    EXPECT_EQ(launches, 2 * (kGraphSteps - 1));
    EXPECT_EQ(made, 2);
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("session ", g->id,
                                                    ": the update phase of its steps runs "
                                                    "eagerly, not as a captured graph (reason "
                                                    "sync_point: ")))
        << log;
  } else {
    // The update too; two forms of it (the staged state swaps at each commit) are captured,
    // the others replayed with their own scalars.
    EXPECT_EQ(launches, 3 * (kGraphSteps - 1)) << AlgorithmName(kind);
    EXPECT_EQ(made, 1 + 2 + 1) << AlgorithmName(kind);
    EXPECT_FALSE(absl::StrContains(log, absl::StrCat("session ", g->id, ": the update phase")))
        << log;
  }
  EXPECT_EQ(after.at("captures_invalidated"), before.at("captures_invalidated"));
  EXPECT_FALSE(absl::StrContains(log,
                                 "phase of its steps runs eagerly, not as a captured graph "
                                 "(reason pageable"))
      << log;
  EXPECT_TRUE(CloseSession(cpu_->stub(), c->id).ok());
  EXPECT_TRUE(CloseSession(dev_->stub(), g->id).ok());
}

INSTANTIATE_TEST_SUITE_P(Rules, DeviceStepGraphs, ::testing::ValuesIn(kDeviceRules), RuleName);

TEST(DeviceSessionBudget, ASessionOverThePoolGetsResourceExhaustedWithTheNumbers) {
  constexpr int64_t kBudget = int64_t{256} << 20;
  auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY, {},
                                 {absl::StrCat("DIOND_TEST_DEVICE_BUDGET_BYTES=", kBudget)});
  ASSERT_NE(dev, nullptr);
  // A small session that fits, stepped before and after the refusal.
  const SessionDesc small = Desc(AlgorithmKind::kAdamW);
  auto s = CreateShmSession(dev->stub(), small.Request());
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(SetState(dev->stub(), s->id, InitialParams(small)).ok());
  for (size_t i = 0; i < small.params.size(); ++i) {
    s->WriteGrad(i, SyntheticValues(7, 1, i, small.Numel(i)));
  }
  ASSERT_TRUE(DoStep(dev->stub(), s->id, 1).ok());
  const std::string after_one = s->ParamBytes(0);

  // 9000 x 9000 fp32 = 324 MB of staging per role: over the 256 MiB pool.
  SessionDesc big;
  big.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.01));
  big.params.push_back({"huge", {9000, 9000}, "m"});
  {
    auto ctx = Ctx();
    v1::CreateSessionResponse resp;
    grpc::Status st = dev->stub().CreateSession(ctx.get(), big.Request(), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "device staging")) << st.error_message();
    EXPECT_TRUE(
        absl::StrContains(st.error_message(), absl::StrCat("pool budget ", kBudget, " bytes")))
        << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "324000000 requested")) << st.error_message();
  }
  // The daemon and the small session carry on.
  EXPECT_TRUE(dev->Alive());
  for (size_t i = 0; i < small.params.size(); ++i) {
    s->WriteGrad(i, SyntheticValues(7, 2, i, small.Numel(i)));
  }
  grpc::Status st = DoStep(dev->stub(), s->id, 2);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_NE(s->ParamBytes(0), after_one);
}

// --max_session_bytes and --memory_budget_bytes count what a device session takes from the device
// pool (staging, state, the scratch its steps grew), as the TEST pool's own counters show it.

// Context::Allocate's rounding: whole 64-byte lines.
int64_t Lines(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// The fp32 staging of `d` (parameters and gradients, one tensor's conversion buffer).
int64_t StagingBytes(const SessionDesc& d) {
  int64_t numel = 0, largest = 0;
  for (size_t i = 0; i < d.params.size(); ++i) {
    numel += d.Numel(i);
    largest = std::max(largest, d.Numel(i));
  }
  // fp32 parameters and gradients, one tensor's conversion buffer, the step's non-finite flag.
  return 2 * Lines(4 * numel) + Lines(4 * largest) + Lines(4);
}

// Creates a session from `d` (no regions) and returns its id, or the error.
grpc::Status Create(Daemon& dev, const SessionDesc& d, std::string* id = nullptr) {
  auto ctx = Ctx();
  v1::CreateSessionResponse resp;
  grpc::Status st = dev.stub().CreateSession(ctx.get(), d.Request(), &resp);
  if (id != nullptr) *id = resp.session_id();
  return st;
}

SessionDesc Tiny() {
  SessionDesc d;
  d.groups.push_back(MakeGroup("v", AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"b", {16}, "v"});
  return d;
}

// The pool bytes a session of `d` holds right after CreateSession, and after `steps` steps,
// measured on a fresh unlimited test daemon through the pool's counters.
struct Held {
  int64_t created = 0, stepped = 0;
};
Held Measure(const SessionDesc& d, int steps) {
  Held h;
  auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY);
  EXPECT_NE(dev, nullptr);
  if (dev == nullptr) return h;
  const int64_t before = LastCounters(*dev)["pool_in_use"];
  auto s = CreateShmSession(dev->stub(), d.Request());
  EXPECT_NE(s, nullptr);
  if (s == nullptr) return h;
  h.created = LastCounters(*dev)["pool_in_use"] - before;
  EXPECT_TRUE(SetState(dev->stub(), s->id, InitialParams(d)).ok());
  for (int64_t t = 1; t <= steps; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      s->WriteGrad(i, SyntheticValues(7, t, i, d.Numel(i)));
    }
    EXPECT_TRUE(DoStep(dev->stub(), s->id, t).ok());
  }
  h.stepped = LastCounters(*dev)["pool_in_use"] - before;
  return h;
}

TEST(DeviceSessionBudget, MaxSessionBytesCountsTheStagingAndStateThePoolReallyHolds) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  const int64_t staging = StagingBytes(d);
  const int64_t held = Measure(d, 0).created;
  const int64_t tiny = Measure(Tiny(), 0).created;
  int64_t numel = 0;
  for (size_t i = 0; i < d.params.size(); ++i) numel += d.Numel(i);
  // AdamW keeps m and v per element (and a step counter): the pool holds at least that and the
  // staging.
  ASSERT_GE(held, staging + 2 * 4 * numel);
  ASSERT_LT(tiny, StagingBytes(d) - 1);
  {
    // One byte short of what the session holds: refused with the real number (the state alone,
    // all that was counted before, fits), and what was allocated is released.
    auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY,
                                   {absl::StrCat("--max_session_bytes=", held - 1)});
    ASSERT_NE(dev, nullptr);
    const int64_t before = LastCounters(*dev)["pool_in_use"];
    grpc::Status st = Create(*dev, d);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_TRUE(
        absl::StrContains(st.error_message(), absl::StrCat("session needs ", held, " bytes")))
        << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), absl::StrCat("staging ", staging)))
        << st.error_message();
    EXPECT_TRUE(
        absl::StrContains(st.error_message(), absl::StrCat("--max_session_bytes is ", held - 1)))
        << st.error_message();
    // The next session change reports the pool: only the tiny session's bytes are in it.
    ASSERT_TRUE(Create(*dev, Tiny()).ok());
    EXPECT_EQ(LastCounters(*dev)["pool_in_use"] - before, tiny);
  }
  {
    // Below the staging alone: refused before anything is allocated (the pool's high-water
    // mark never saw the session).
    auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY,
                                   {absl::StrCat("--max_session_bytes=", staging - 1)});
    ASSERT_NE(dev, nullptr);
    const std::map<std::string, int64_t> start = LastCounters(*dev);
    grpc::Status st = Create(*dev, d);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), absl::StrCat("session needs ", staging,
                                                                   " bytes (a device "
                                                                   "session's staging alone")))
        << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "nothing was allocated"))
        << st.error_message();
    ASSERT_TRUE(Create(*dev, Tiny()).ok());
    const std::map<std::string, int64_t> after = LastCounters(*dev);
    EXPECT_EQ(after.at("pool_in_use") - start.at("pool_in_use"), tiny);
    // Had the staging been allocated, the high-water mark would have reached it.
    ASSERT_LT(start.at("pool_peak"), start.at("pool_in_use") + staging);
    EXPECT_LT(after.at("pool_peak"), start.at("pool_in_use") + staging);
  }
}

TEST(DeviceSessionBudget, MemoryBudgetCountsTheScratchASessionsStepsGrew) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  const Held h = Measure(d, 2);
  // Muon's Newton-Schulz iteration takes its temporaries from the session's scratch arena,
  // whose blocks stay with the session.
  ASSERT_GT(h.stepped, h.created);
  // Two fresh sessions fit the budget; one that stepped and the next fresh one do not.
  const int64_t budget = 2 * h.created;
  auto dev = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY,
                                 {absl::StrCat("--memory_budget_bytes=", budget)});
  ASSERT_NE(dev, nullptr);
  const int64_t before = LastCounters(*dev)["pool_in_use"];
  auto s = CreateShmSession(dev->stub(), d.Request());
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(SetState(dev->stub(), s->id, InitialParams(d)).ok());
  for (int64_t t = 1; t <= 2; ++t) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      s->WriteGrad(i, SyntheticValues(7, t, i, d.Numel(i)));
    }
    ASSERT_TRUE(DoStep(dev->stub(), s->id, t).ok());
  }
  // What the pool says this daemon's one session holds, and what the refusal says is in use.
  const int64_t in_pool = LastCounters(*dev)["pool_in_use"] - before;
  EXPECT_EQ(in_pool, h.stepped);
  grpc::Status st = Create(*dev, d);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(),
                                absl::StrCat("; ", in_pool, " of the ", budget,
                                             "-byte memory budget (--memory_budget_bytes) "
                                             "are in use by 1 session(s)")))
      << st.error_message();
  // Closing the stepped session gives its bytes back to the budget.
  ASSERT_TRUE(CloseSession(dev->stub(), s->id).ok());
  std::string id;
  EXPECT_TRUE(Create(*dev, d, &id).ok());
  EXPECT_EQ(LastCounters(*dev)["pool_in_use"] - before, h.created);
}

}  // namespace
}  // namespace diond::service_testing
