// Checkpoints through the real daemon (ARCHITECTURE.md §7):
//  - round trip: SaveCheckpoint -> LoadCheckpoint into a new session (shm and remote mode), then
//    both sessions keep training and stay bit-identical to the original;
//  - corrupted (flipped bytes) and truncated files are refused with DATA_LOSS naming the file,
//    and no half-made session is left behind;
//  - crash safety: a daemon writing a checkpoint after every step is SIGKILLed at a random
//    moment; after a restart the newest step-<N> directory loads and equals, bit for bit, the
//    in-process replay of N steps. Temporary directories are named .tmp-*, so a torn write can
//    never be mistaken for a checkpoint (server/session/checkpoint.h LatestCheckpoint).
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

namespace fs = std::filesystem;

SessionDesc SmallDesc() {
  SessionDesc d;
  d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
  d.groups.push_back(MakeGroup("dn", optim::AlgorithmKind::kDion, 0.02));
  d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w", {16, 8}, "m"});
  d.params.push_back({"d", {12, 10}, "dn"});
  d.params.push_back({"b", {8}, "a"});
  return d;
}

std::vector<Chunk> InitialWeights(const SessionDesc& d, uint64_t seed) {
  return SyntheticWeights(d, seed);
}

std::string Save(v1::Optimizer::Stub& stub, const std::string& session, int64_t expect_step) {
  v1::SaveCheckpointRequest req;
  req.set_session_id(session);
  v1::SaveCheckpointResponse resp;
  grpc::Status st = stub.SaveCheckpoint(Ctx().get(), req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.step_index(), expect_step);
  EXPECT_TRUE(absl::EndsWith(resp.path(), absl::StrCat("/step-", expect_step))) << resp.path();
  return resp.path();
}

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = testing::MakeTempDir("diond_ckpt");
    daemon_ = Daemon::Start({"--state_dir=" + state_dir_});
    ASSERT_NE(daemon_, nullptr);
  }
  v1::Optimizer::Stub& stub() { return daemon_->stub(); }
  std::string state_dir_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(Checkpoints, RoundTripContinuesBitExactInShmAndRemoteMode) {
  const SessionDesc d = SmallDesc();
  auto a = CreateShmSession(stub(), d.Request());
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(SetState(stub(), a->id, InitialWeights(d, 1)).ok());
  for (int64_t t = 1; t <= 3; ++t) {
    if (t == 3) {
      // An lr schedule change before the save: the checkpoint must carry it.
      v1::SetHyperparametersRequest hp;
      hp.set_session_id(a->id);
      hp.set_group("m");
      hp.mutable_hyperparameters()->set_lr(0.005);
      v1::SetHyperparametersResponse hp_resp;
      ASSERT_TRUE(stub().SetHyperparameters(Ctx().get(), hp, &hp_resp).ok());
    }
    WriteSyntheticGrads(a.get(), d, 2, t);
    ASSERT_TRUE(DoStep(stub(), a->id, t).ok());
  }
  const std::string path = Save(stub(), a->id, 3);
  TensorMap a_state;
  ASSERT_TRUE(GetState(stub(), a->id, true, &a_state).ok());

  // B: loaded, then bound to new shm segments; the restored weights land in B's arena.
  v1::LoadCheckpointResponse loaded;
  grpc::Status st = LoadCheckpointFrom(stub(), path, &loaded);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(loaded.step_index(), 3);
  EXPECT_NE(loaded.session().session_id(), a->id);
  ASSERT_EQ(loaded.session().layout_size(), a->layout.layout_size());
  TensorMap b_state;
  ASSERT_TRUE(GetState(stub(), loaded.session().session_id(), true, &b_state).ok());
  EXPECT_EQ(b_state, a_state);
  auto b = std::make_unique<ShmSession>();
  b->id = loaded.session().session_id();
  b->layout = loaded.session();
  b->grad_base = (b->layout.param_arena_bytes() + 255) / 256 * 256;
  b->params_seg = ShmSegment::Create(b->grad_base + b->layout.grad_arena_bytes());
  ASSERT_NE(b->params_seg, nullptr);
  for (auto [role, off, size] :
       {std::tuple{v1::REGION_ROLE_PARAMETERS, int64_t{0}, b->layout.param_arena_bytes()},
        std::tuple{v1::REGION_ROLE_GRADIENTS, b->grad_base, b->layout.grad_arena_bytes()}}) {
    v1::RegisterRegionRequest r;
    r.set_session_id(b->id);
    r.set_role(role);
    r.set_kind(v1::REGION_KIND_SYSTEM_SHM);
    r.mutable_system_shm()->set_name(b->params_seg->name());
    r.mutable_system_shm()->set_offset_bytes(off);
    r.mutable_system_shm()->set_size_bytes(size);
    v1::RegisterRegionResponse resp;
    ASSERT_TRUE(stub().RegisterRegion(Ctx().get(), r, &resp).ok());
  }
  for (size_t i = 0; i < d.params.size(); ++i) EXPECT_EQ(b->ParamBytes(i), a->ParamBytes(i));

  // C: loaded again, remote mode (Push/Pull, no regions).
  v1::LoadCheckpointResponse loaded_c;
  ASSERT_TRUE(LoadCheckpointFrom(stub(), path, &loaded_c).ok());
  const std::string c = loaded_c.session().session_id();

  for (int64_t t = 4; t <= 6; ++t) {
    WriteSyntheticGrads(a.get(), d, 2, t);
    WriteSyntheticGrads(b.get(), d, 2, t);
    std::vector<Chunk> grads;
    for (size_t i = 0; i < d.params.size(); ++i) {
      grads.push_back({d.params[i].name, 0, FloatBytes(SyntheticValues(2, t, i, d.Numel(i)))});
    }
    ASSERT_TRUE(PushGradients(stub(), c, grads).ok());
    ASSERT_TRUE(DoStep(stub(), a->id, t).ok());
    st = DoStep(stub(), b->id, t);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_TRUE(DoStep(stub(), c, t).ok());
    TensorMap pulled;
    ASSERT_TRUE(PullParameters(stub(), c, &pulled).ok());
    for (size_t i = 0; i < d.params.size(); ++i) {
      ASSERT_EQ(b->ParamBytes(i), a->ParamBytes(i)) << d.params[i].name << " step " << t;
      ASSERT_EQ(pulled[d.params[i].name], a->ParamBytes(i)) << d.params[i].name << " step " << t;
    }
  }
  TensorMap a_end, b_end, c_end;
  ASSERT_TRUE(GetState(stub(), a->id, true, &a_end).ok());
  ASSERT_TRUE(GetState(stub(), b->id, true, &b_end).ok());
  ASSERT_TRUE(GetState(stub(), c, true, &c_end).ok());
  EXPECT_EQ(b_end, a_end);
  EXPECT_EQ(c_end, a_end);
  EXPECT_NE(a_end, a_state);  // training did move
}

// Copies a checkpoint, damages one file with `damage`, and requires DATA_LOSS naming it.
class DamagedCheckpoint : public Checkpoints {
 protected:
  void ExpectRefused(const std::string& file, const std::function<void(const std::string&)>& damage,
                     const std::string& label) {
    SCOPED_TRACE(label);
    const SessionDesc d = SmallDesc();
    v1::CreateSessionResponse created;
    ASSERT_TRUE(stub().CreateSession(Ctx().get(), d.Request(), &created).ok());
    ASSERT_TRUE(SetState(stub(), created.session_id(), InitialWeights(d, 3)).ok());
    const std::string good = Save(stub(), created.session_id(), 0);
    const std::string copy = absl::StrCat(state_dir_, "/damaged-", label);
    fs::copy(good, copy, fs::copy_options::recursive);
    damage(copy + "/" + file);
    const size_t sessions = SessionCount(stub());
    v1::LoadCheckpointResponse resp;
    grpc::Status st = LoadCheckpointFrom(stub(), copy, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), copy + "/" + file)) << st.error_message();
    EXPECT_EQ(SessionCount(stub()), sessions) << "a refused load left a session behind";
    EXPECT_TRUE(daemon_->Serving());
    // The undamaged original still loads.
    EXPECT_TRUE(LoadCheckpointFrom(stub(), good, &resp).ok());
  }
};

void FlipBytes(const std::string& path, int64_t from_end, int count) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const int64_t size = f.tellg();
  for (int i = 0; i < count; ++i) {
    f.seekg(size - from_end + i);
    char c;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(size - from_end + i);
    f.write(&c, 1);
  }
}

TEST_F(DamagedCheckpoint, FlippedTensorBytesAreDataLoss) {
  // The last bytes of the file are the last tensor's data: only the CRC can notice.
  ExpectRefused(
      "tensors.safetensors", [](const std::string& p) { FlipBytes(p, 12, 4); }, "flipped");
}

TEST_F(DamagedCheckpoint, TruncatedTensorFileIsDataLoss) {
  ExpectRefused(
      "tensors.safetensors", [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); },
      "truncated");
}

TEST_F(DamagedCheckpoint, TruncatedManifestIsDataLoss) {
  ExpectRefused(
      "manifest.json", [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 3); },
      "manifest");
}

TEST_F(DamagedCheckpoint, MissingTensorFileIsDataLoss) {
  ExpectRefused(
      "tensors.safetensors", [](const std::string& p) { fs::remove(p); }, "missing");
}

TEST(CheckpointCrash, SigkillWhileCheckpointingEveryStepRestartsToTheLatestCompleteOne) {
  const std::string dir = testing::MakeTempDir("diond_crash");
  const std::string state_dir = dir + "/state";
  const std::vector<std::string> flags = {"--state_dir=" + state_dir, "--checkpoint_every=1"};
  auto daemon = Daemon::Start(flags, false, dir);
  ASSERT_NE(daemon, nullptr);
  // Large-ish: about 2.5 MB per checkpoint (weights + Muon momentum + AdamW moments), so that a
  // good share of the wall time is spent writing and fsyncing checkpoints.
  SessionDesc d;
  d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
  d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w", {256, 256}, "m"});
  d.params.push_back({"e", {512, 128}, "a"});
  auto s = CreateShmSession(daemon->stub(), d.Request());
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(SetState(daemon->stub(), s->id, InitialWeights(d, 5)).ok());
  const std::string session_dir = state_dir + "/" + s->id;

  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const int64_t kill_after = 3 + static_cast<int64_t>(rng() % 10);
  const int temp_polls = static_cast<int>(rng() % 200);
  SCOPED_TRACE(absl::StrCat("seed ", seed, ": kill after ", kill_after, " acknowledged steps, ",
                            temp_polls, " polls for a .tmp-* directory"));

  std::atomic<int64_t> acked{0};
  std::thread trainer([&] {
    for (int64_t t = 1; t <= 1000; ++t) {
      WriteSyntheticGrads(s.get(), d, 6, t);
      if (!DoStep(daemon->stub(), s->id, t).ok()) return;  // killed
      acked = t;
    }
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (acked < kill_after && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  // Aim at a checkpoint in flight: poll a random number of times for a temporary directory.
  for (int i = 0; i < temp_polls; ++i) {
    std::vector<std::string> temps;
    CheckpointSteps(session_dir, &temps);
    if (!temps.empty()) break;
  }
  daemon->Kill();
  trainer.join();
  const int64_t last_acked = acked;
  ASSERT_GE(last_acked, kill_after);

  std::vector<std::string> temps;
  std::vector<int64_t> steps = CheckpointSteps(session_dir, &temps);
  ASSERT_FALSE(steps.empty());
  for (const std::string& t : temps) EXPECT_TRUE(absl::StartsWith(t, ".tmp-")) << t;
  const int64_t latest = steps.back();
  // Every acknowledged step was checkpointed before its reply; the step in flight may also be.
  EXPECT_GE(latest, last_acked);
  EXPECT_LE(latest, last_acked + 1);

  daemon = Daemon::Start(flags, false, dir);
  ASSERT_NE(daemon, nullptr);
  v1::LoadCheckpointResponse loaded;
  grpc::Status st =
      LoadCheckpointFrom(daemon->stub(), absl::StrCat(session_dir, "/step-", latest), &loaded);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(loaded.step_index(), latest);
  TensorMap restored;
  ASSERT_TRUE(GetState(daemon->stub(), loaded.session().session_id(), true, &restored).ok());

  auto ctx = kernels::Context::CpuDefault();
  auto replay = *Replay::Create(d);
  for (size_t i = 0; i < d.params.size(); ++i) {
    replay->params()[i] = SyntheticValues(5, 0, i, d.Numel(i));
  }
  for (int64_t t = 1; t <= latest; ++t) {
    std::vector<std::vector<float>> g;
    for (size_t i = 0; i < d.params.size(); ++i) g.push_back(SyntheticValues(6, t, i, d.Numel(i)));
    ASSERT_TRUE(replay->Step(*ctx, g).ok());
  }
  for (size_t i = 0; i < d.params.size(); ++i) {
    EXPECT_EQ(restored[d.params[i].name], FloatBytes(replay->params()[i])) << d.params[i].name;
    for (const std::string& name : replay->StateNames(i)) {
      EXPECT_EQ(restored[d.params[i].name + "/state." + name],
                FloatBytes(*replay->GetState(i, name)))
          << d.params[i].name << "/state." << name;
    }
  }
  // No complete-looking directory is torn: the older ones load too.
  for (int64_t step : steps) {
    if (step == latest) continue;
    v1::LoadCheckpointResponse r;
    st = LoadCheckpointFrom(daemon->stub(), absl::StrCat(session_dir, "/step-", step), &r);
    EXPECT_TRUE(st.ok()) << "step-" << step << ": " << st.error_message();
    EXPECT_EQ(r.step_index(), step);
    if (st.ok()) {
      EXPECT_TRUE(CloseSession(daemon->stub(), r.session().session_id()).ok());
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace diond::service_testing
