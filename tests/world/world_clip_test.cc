// The daemon-side gradient clip of world sessions (StepRequest.max_grad_norm; docs/DATA_PLANE.md
// "Gradient clip", docs/DISTRIBUTED.md "One step") across two real daemons on loopback. The
// reference is a third, local daemon clipping the gradients a world's ranks step on, as
// torch's clip_grad_norm_ after DDP's all-reduce would:
//  - AVERAGE: the mean of the two ranks' gradients ((a + b) / 2: exact in any order for two);
//    grad_norm and the weights after every step equal the reference's bit for bit on both ranks,
//    also with a parameter that only one rank has a gradient for;
//  - REPLICATED: the same gradients on both ranks, the same result;
//  - a NaN on one rank: both ranks skip, their grad_norm not finite;
//  - DION_COMPRESSED: refused (FAILED_PRECONDITION), nothing applied;
//  - the same on three device daemons (diond_testdevice, the TEST backend): the norms are the
//    device's (f32 per tensor) on the world's ranks and on the reference alike.
#include <cmath>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;
constexpr int kW = 2;

grpc::Status ClippedStep(v1::Optimizer::Stub& stub, const std::string& id, int64_t step,
                         double max_norm, v1::StepResponse* resp,
                         const std::vector<int32_t>& without = {}) {
  auto ctx = Ctx();
  v1::StepRequest req;
  req.set_session_id(id);
  req.set_step_index(step);
  req.set_max_grad_norm(max_norm);
  for (int32_t i : without) req.add_params_without_grad(i);
  return stub.Step(ctx.get(), req, resp);
}

class WorldClip : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { StartAll(""); }
  // The world's two daemons and the local reference: CPU daemons, or `binary`.
  static void StartAll(const std::string& binary) {
    auto start = [&](const std::vector<std::string>& f, bool tcp) {
      return (binary.empty() ? Daemon::Start(f, tcp) : Daemon::StartBinary(binary, f, {}, tcp))
          .release();
    };
    auto flags = [](int rank, int port) {
      std::vector<std::string> f = {absl::StrCat("--world_size=", kW),
                                    absl::StrCat("--rank=", rank), "--heartbeat_interval=200ms",
                                    "--peer_timeout=10s"};
      if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", port));
      return f;
    };
    world_[0] = start(flags(0, 0), /*tcp=*/true);
    if (world_[0] != nullptr) world_[1] = start(flags(1, world_[0]->tcp_port()), /*tcp=*/true);
    local_ = start({}, /*tcp=*/false);
  }
  static void TearDownTestSuite() {
    for (Daemon** d : {&world_[0], &world_[1], &local_}) {
      delete *d;
      *d = nullptr;
    }
  }
  void SetUp() override {
    ASSERT_NE(world_[0], nullptr);
    ASSERT_NE(world_[1], nullptr);
    ASSERT_NE(local_, nullptr);
    desc_ = SessionDesc();
    desc_.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
    desc_.groups.push_back(MakeGroup("a", AlgorithmKind::kAdamW, 0.01));
    for (int j = 0; j < 4; ++j) {
      desc_.params.push_back({absl::StrCat("w", j), {32, 24 + 8 * (j % 2)}, "m"});
    }
    for (int j = 0; j < 3; ++j) desc_.params.push_back({absl::StrCat("b", j), {40}, "a"});
  }

  // The world session on both ranks (sync mode `sync`, key `key`) and the local reference, all
  // with the same weights.
  void Create(v1::GradientSync sync, const std::string& key) {
    v1::CreateSessionRequest req = desc_.Request();
    req.set_world_key(key);
    req.set_gradient_sync(sync);
    std::thread t([&] { ranks_[1] = CreateShmSession(world_[1]->stub(), req); });
    ranks_[0] = CreateShmSession(world_[0]->stub(), req);
    t.join();
    ASSERT_NE(ranks_[0], nullptr);
    ASSERT_NE(ranks_[1], nullptr);
    ref_ = CreateShmSession(local_->stub(), desc_.Request());
    ASSERT_NE(ref_, nullptr);
    std::vector<Chunk> init;
    for (size_t i = 0; i < desc_.params.size(); ++i) {
      for (Chunk& c : SplitTensor(desc_.params[i].name,
                                  FloatBytes(SyntheticValues(1, 0, i, desc_.Numel(i))))) {
        init.push_back(std::move(c));
      }
    }
    for (int r = 0; r < kW; ++r) ASSERT_TRUE(SetState(world_[r]->stub(), ranks_[r]->id, init).ok());
    ASSERT_TRUE(SetState(local_->stub(), ref_->id, init).ok());
  }

  // Rank r's gradient of parameter i at `step` (the same on every rank when `same`).
  std::vector<float> Grad(int r, size_t i, int64_t step, bool same) const {
    return SyntheticValues(same ? 100 : 100 + static_cast<uint64_t>(r), step, i, desc_.Numel(i));
  }

  // Both ranks step at once; `without[r]` are rank r's parameters without a gradient.
  void StepWorld(int64_t step, double max_norm, v1::StepResponse resp[kW],
                 const std::vector<int32_t> without[kW]) {
    std::thread t([&] {
      grpc::Status st =
          ClippedStep(world_[1]->stub(), ranks_[1]->id, step, max_norm, &resp[1], without[1]);
      EXPECT_TRUE(st.ok()) << "rank 1: " << st.error_message();
    });
    grpc::Status st =
        ClippedStep(world_[0]->stub(), ranks_[0]->id, step, max_norm, &resp[0], without[0]);
    EXPECT_TRUE(st.ok()) << "rank 0: " << st.error_message();
    t.join();
  }

  // `steps` clipped steps; the reference steps on the mean (AVERAGE) or the common gradients.
  // Parameter 5 has a gradient on rank 0 only in `lopsided` (the mean then halves it).
  void RunAndCompare(bool average, int steps, bool lopsided) {
    const double max_norm = 2.0;  // well below the gradients' norm (about 19): every step clips
    for (int64_t step = 1; step <= steps; ++step) {
      std::vector<int32_t> without[kW];
      if (lopsided) without[1] = {5};
      for (size_t i = 0; i < desc_.params.size(); ++i) {
        std::vector<float> mean(static_cast<size_t>(desc_.Numel(i)), 0.0f);
        for (int r = 0; r < kW; ++r) {
          std::vector<float> g = Grad(r, i, step, !average);
          const bool has = !(lopsided && r == 1 && i == 5);
          if (has) ranks_[r]->WriteGrad(i, g);
          for (size_t e = 0; e < g.size(); ++e) mean[e] += has ? g[e] : 0.0f;
        }
        if (average) {
          for (float& v : mean) v /= static_cast<float>(kW);
        } else {
          mean = Grad(0, i, step, true);
        }
        ref_->WriteGrad(i, mean);
      }
      v1::StepResponse resp[kW], want;
      StepWorld(step, max_norm, resp, without);
      ASSERT_TRUE(ClippedStep(local_->stub(), ref_->id, step, max_norm, &want).ok());
      ASSERT_GT(want.grad_norm(), 4 * max_norm);
      for (int r = 0; r < kW; ++r) {
        EXPECT_FALSE(resp[r].skipped());
        EXPECT_EQ(resp[r].grad_norm(), want.grad_norm()) << "rank " << r << " step " << step;
        for (size_t i = 0; i < desc_.params.size(); ++i) {
          ASSERT_EQ(ranks_[r]->ParamBytes(i), ref_->ParamBytes(i))
              << "rank " << r << " param " << desc_.params[i].name << " step " << step;
        }
      }
    }
  }

  static Daemon* world_[kW];
  static Daemon* local_;
  SessionDesc desc_;
  std::unique_ptr<ShmSession> ranks_[kW], ref_;
};

Daemon* WorldClip::world_[kW] = {nullptr, nullptr};
Daemon* WorldClip::local_ = nullptr;

TEST_F(WorldClip, AverageClipsTheMeanGradientLikeOneDaemon) {
  Create(v1::GRADIENT_SYNC_AVERAGE, "clip-average");
  RunAndCompare(/*average=*/true, 3, /*lopsided=*/false);
}

TEST_F(WorldClip, AverageWithAGradientOnOneRankOnly) {
  Create(v1::GRADIENT_SYNC_AVERAGE, "clip-lopsided");
  RunAndCompare(/*average=*/true, 2, /*lopsided=*/true);
}

TEST_F(WorldClip, ReplicatedClipsEachRanksOwnGradientsAlike) {
  Create(v1::GRADIENT_SYNC_REPLICATED, "clip-replicated");
  RunAndCompare(/*average=*/false, 3, /*lopsided=*/false);
}

TEST_F(WorldClip, ANonFiniteGradientOnOneRankSkipsOnBoth) {
  Create(v1::GRADIENT_SYNC_AVERAGE, "clip-nan");
  const std::string before = ranks_[0]->ParamBytes(0);
  for (int r = 0; r < kW; ++r) {
    for (size_t i = 0; i < desc_.params.size(); ++i) {
      std::vector<float> g = Grad(r, i, 1, false);
      if (r == 1 && i == 2) g[7] = std::nanf("");
      ranks_[r]->WriteGrad(i, g);
    }
  }
  v1::StepResponse resp[kW];
  const std::vector<int32_t> none[kW];
  StepWorld(1, 2.0, resp, none);
  for (int r = 0; r < kW; ++r) {
    EXPECT_TRUE(resp[r].skipped()) << "rank " << r;
    EXPECT_FALSE(std::isfinite(resp[r].grad_norm())) << "rank " << r;
  }
  EXPECT_EQ(ranks_[0]->ParamBytes(0), before);
}

TEST_F(WorldClip, DionCompressedIsRefusedWithNothingApplied) {
  desc_.groups[0] = MakeGroup("m", AlgorithmKind::kDion, 0.02);
  v1::CreateSessionRequest req = desc_.Request();
  req.set_world_key("clip-compressed");
  req.set_gradient_sync(v1::GRADIENT_SYNC_DION_COMPRESSED);
  std::thread t([&] { ranks_[1] = CreateShmSession(world_[1]->stub(), req); });
  ranks_[0] = CreateShmSession(world_[0]->stub(), req);
  t.join();
  ASSERT_NE(ranks_[0], nullptr);
  ASSERT_NE(ranks_[1], nullptr);
  for (int r = 0; r < kW; ++r) {
    v1::StepResponse resp;
    grpc::Status st = ClippedStep(world_[r]->stub(), ranks_[r]->id, 1, 1.0, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find("DION_COMPRESSED"), std::string::npos) << st.error_message();
  }
  // Nothing was applied: step 1 is still the next one, and it runs unclipped.
  v1::StepResponse resp[kW];
  const std::vector<int32_t> none[kW];
  StepWorld(1, 0.0, resp, none);
  EXPECT_EQ(resp[0].step_index(), 1);
}

// The same on device daemons: each owner norms its averaged gradients on the device, the squares
// are all-gathered, and each owner scales its own on the device; the reference is a local device
// session.
class WorldClipDevice : public WorldClip {
 protected:
  static void SetUpTestSuite() { StartAll(DIOND_TESTDEVICE_BINARY); }
};

TEST_F(WorldClipDevice, AverageClipsTheMeanGradientLikeOneDaemon) {
  Create(v1::GRADIENT_SYNC_AVERAGE, "dev-clip-average");
  RunAndCompare(/*average=*/true, 3, /*lopsided=*/false);
}

TEST_F(WorldClipDevice, AverageWithAGradientOnOneRankOnly) {
  Create(v1::GRADIENT_SYNC_AVERAGE, "dev-clip-lopsided");
  RunAndCompare(/*average=*/true, 2, /*lopsided=*/true);
}

TEST_F(WorldClipDevice, ReplicatedClipsEachRanksOwnGradientsAlike) {
  Create(v1::GRADIENT_SYNC_REPLICATED, "dev-clip-replicated");
  RunAndCompare(/*average=*/false, 3, /*lopsided=*/false);
}

}  // namespace
}  // namespace diond::service_testing
