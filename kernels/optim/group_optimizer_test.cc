// GroupOptimizer API: validation of every rejected input, state access, megabatching
// (bit-identical to one-by-one), missing gradients, lr override, no mutation on failure.
#include "kernels/optim/group_optimizer.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/engine_choice.h"
#include "kernels/optim/validation.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using kernels::testing::RandomVector;  // N(0, 1) from a seed (kernels/cpu/test_util.h)
using ::testing::HasSubstr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

GroupConfig Cfg(AlgorithmKind k) {
  GroupConfig c;
  c.algorithm = k;
  c.hyperparams = DefaultHyperparams(k);
  return c;
}

void ExpectRejected(const GroupConfig& c, std::vector<ParamShape> shapes, const char* msg) {
  EXPECT_THAT(CreateGroupOptimizer(c, std::move(shapes)), StatusIs(kInvalid, HasSubstr(msg)));
}

TEST(ValidationTest, RejectsBadHyperparameters) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  GroupConfig c = Cfg(AlgorithmKind::kMuon);
  c.hyperparams.lr = -1;
  ExpectRejected(c, {{4, 4}}, "lr = -1");
  c = Cfg(AlgorithmKind::kMuon);
  c.hyperparams.lr = nan;
  ExpectRejected(c, {{4, 4}}, "lr = nan");
  c = Cfg(AlgorithmKind::kMuon);
  c.hyperparams.weight_decay = -0.1;
  ExpectRejected(c, {{4, 4}}, "weight_decay");
  c = Cfg(AlgorithmKind::kMuon);
  c.hyperparams.epsilon = -1e-8;
  ExpectRejected(c, {{4, 4}}, "epsilon");
  for (double mu : {-0.1, 1.0, nan}) {
    c = Cfg(AlgorithmKind::kMuon);
    c.hyperparams.mu = mu;
    ExpectRejected(c, {{4, 4}}, "mu");
  }
  c = Cfg(AlgorithmKind::kNorMuon);
  c.hyperparams.muon_beta2 = 1.0;
  ExpectRejected(c, {{4, 4}}, "muon_beta2");
  for (double f : {0.0, 1.5, -0.2}) {
    c = Cfg(AlgorithmKind::kDion2);
    c.hyperparams.fraction = f;
    ExpectRejected(c, {{4, 4}}, "fraction");
  }
  c = Cfg(AlgorithmKind::kDion2);
  c.hyperparams.ef_decay = 1.5;
  ExpectRejected(c, {{4, 4}}, "ef_decay");
  c = Cfg(AlgorithmKind::kDion);
  c.hyperparams.rank_fraction = 0;
  ExpectRejected(c, {{4, 4}}, "rank_fraction");
  c = Cfg(AlgorithmKind::kDion);
  c.hyperparams.rank_multiple_of = 0;
  ExpectRejected(c, {{4, 4}}, "rank_multiple_of");
  c = Cfg(AlgorithmKind::kAdamW);
  c.hyperparams.beta1 = 1.0;
  ExpectRejected(c, {{4}}, "beta1");
  c = Cfg(AlgorithmKind::kLion);
  c.hyperparams.beta2 = -0.5;
  ExpectRejected(c, {{4}}, "beta2");
}

TEST(ValidationTest, RejectsUnsupportedOptions) {
  GroupConfig c = Cfg(AlgorithmKind::kDion2);
  c.hyperparams.nesterov = true;
  ExpectRejected(c, {{4, 4}}, "nesterov");
  c = Cfg(AlgorithmKind::kNorDion2);
  c.hyperparams.cautious_wd = true;
  ExpectRejected(c, {{4, 4}}, "cautious_wd");
  c = Cfg(AlgorithmKind::kDion);
  c.hyperparams.adjust_lr = AdjustLr::kRmsNorm;
  ExpectRejected(c, {{4, 4}}, "adjust_lr");
  c = Cfg(AlgorithmKind::kAdamW);
  c.hyperparams.orthogonalizer = Orthogonalizer::kNewtonSchulz5;
  ExpectRejected(c, {{4}}, "orthogonalizer");
  c = Cfg(AlgorithmKind::kDion2);
  c.split_sizes = {2, 2};
  ExpectRejected(c, {{4, 4}}, "split_sizes is not supported");
  c = Cfg(AlgorithmKind::kDion);
  c.num_heads = 2;
  ExpectRejected(c, {{4, 4}}, "num_heads");
  c = Cfg(AlgorithmKind::kLion);
  c.flatten = true;
  ExpectRejected(c, {{4, 4, 2}}, "flatten");
  c = Cfg(AlgorithmKind::kMuon);
  c.num_heads = 0;
  ExpectRejected(c, {{4, 4}}, "num_heads = 0");
  c.num_heads = 3;
  ExpectRejected(c, {{4, 4}}, "does not divide");
  c.num_heads = 2;
  c.flatten = true;
  ExpectRejected(c, {{4, 4}}, "flatten");
  c = Cfg(AlgorithmKind::kMuon);
  c.num_heads = 2;
  ExpectRejected(c, {{4, 4, 2}}, "2-D");
  c = Cfg(AlgorithmKind::kMuon);
  c.split_sizes = {4};
  ExpectRejected(c, {{4, 4}}, "at least 2");
  c.split_sizes = {3, 0, 1};
  ExpectRejected(c, {{4, 4}}, "non-positive");
  c.split_sizes = {2, 3};
  ExpectRejected(c, {{4, 4}}, "sum to 5");
  c.split_sizes = {2, 2};
  c.num_heads = 2;
  ExpectRejected(c, {{4, 4}}, "num_heads");
  c = Cfg(AlgorithmKind::kNorMuon);
  c.split_sizes = {2, 2};
  c.flatten = true;
  ExpectRejected(c, {{4, 4}}, "flatten");
}

TEST(ValidationTest, RejectsBadShapes) {
  ExpectRejected(Cfg(AlgorithmKind::kMuon), {{8}}, "rank >= 2");
  ExpectRejected(Cfg(AlgorithmKind::kMuon), {{8, 0}}, "invalid shape");
  ExpectRejected(Cfg(AlgorithmKind::kDion), {{2, 3, 4}}, "2-D parameters only");
  ExpectRejected(Cfg(AlgorithmKind::kAdamW), {{-1}}, "invalid shape");
  ExpectRejected(Cfg(AlgorithmKind::kAdamW), {}, "at least one");
  EXPECT_THAT(CreateGroupOptimizer(Cfg(AlgorithmKind::kAdamW), {{}, {0}, {3, 1, 2, 2}}), IsOk());
  EXPECT_THAT(CreateGroupOptimizer(Cfg(AlgorithmKind::kMuon), {{3, 1, 2, 2}}), IsOk());
}

TEST(ValidationTest, ParsesNamesAndAliases) {
  EXPECT_EQ(*ParseAlgorithm("dion3"), AlgorithmKind::kNorDion2);
  EXPECT_EQ(*ParseAlgorithm("dion_reference"), AlgorithmKind::kDion);
  EXPECT_THAT(ParseAlgorithm("sgd"), StatusIs(kInvalid, HasSubstr("sgd")));
  EXPECT_EQ(*ParseAdjustLr("null"), AdjustLr::kNone);
  EXPECT_THAT(ParseAdjustLr("spectral"), StatusIs(kInvalid));
  EXPECT_THAT(ParsePrecision("fp16"), StatusIs(kInvalid));
  for (Bf16MatmulEngine e :
       {Bf16MatmulEngine::kAuto, Bf16MatmulEngine::kFloat32Gemm, Bf16MatmulEngine::kOneDnn}) {
    EXPECT_EQ(*ParseBf16MatmulEngine(Bf16MatmulEngineName(e)), e);
  }
  EXPECT_THAT(ParseBf16MatmulEngine("mkldnn"), StatusIs(kInvalid, HasSubstr("bf16_matmul")));
  // P2: the double product decides (0.55·100 = 55.000000000000007 → 56).
  EXPECT_EQ(SelectionCount(100, 0.55), 56);
  EXPECT_EQ(SelectionCount(180, 0.35), 63);
  EXPECT_EQ(SelectionCount(3, 0.01), 1);
  EXPECT_EQ(DionRank(64, 48, 0.25, 1), 12);
  EXPECT_EQ(DionRank(64, 48, 0.25, 8), 16);
  EXPECT_EQ(DionRank(10, 6, 1.0, 4), 6);  // 4·ceil(6/4) = 8 capped at min(m, n)
}

TEST(GroupOptimizerTest, StepRejectsBadArgumentsWithoutMutation) {
  auto ctx = kernels::Context::CpuDefault(1);
  auto opt = CreateGroupOptimizer(Cfg(AlgorithmKind::kMuon), {{4, 3}});
  ASSERT_THAT(opt, IsOk());
  std::vector<float> x = RandomVector(12, 1), x0 = x, g = RandomVector(12, 2);
  float* xp = x.data();
  const float* gp = g.data();
  float* none = nullptr;
  EXPECT_THAT((*opt)->Step(*ctx, {}, {}), StatusIs(kInvalid, HasSubstr("0 params")));
  EXPECT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&none, 1), absl::MakeSpan(&gp, 1)),
              StatusIs(kInvalid, HasSubstr("null")));
  const float* alias = x.data();
  EXPECT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&alias, 1)),
              StatusIs(kInvalid, HasSubstr("aliases")));
  StepOptions bad;
  bad.lr = -0.5;
  EXPECT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1), bad),
              StatusIs(kInvalid, HasSubstr("-0.5")));
  bad = {};
  bad.weight_decay = std::numeric_limits<double>::infinity();
  EXPECT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1), bad),
              StatusIs(kInvalid, HasSubstr("weight_decay")));
  EXPECT_EQ(x, x0);
  std::vector<float> m(12);
  ASSERT_THAT((*opt)->GetState(0, "momentum", absl::MakeSpan(m)), IsOk());
  EXPECT_EQ(m, std::vector<float>(12, 0.0f));
  EXPECT_EQ((*opt)->steps_taken(), 0);
}

TEST(GroupOptimizerTest, StateAccess) {
  auto opt = CreateGroupOptimizer(Cfg(AlgorithmKind::kNorMuon), {{4, 3}, {2, 5, 3}});
  ASSERT_THAT(opt, IsOk());
  EXPECT_EQ((*opt)->StateNames(), (std::vector<std::string>{"momentum", "variance_neuron"}));
  EXPECT_EQ(*(*opt)->StateShape(1, "variance_neuron"), (std::vector<int64_t>{2, 5, 1}));
  EXPECT_THAT((*opt)->StateShape(0, "Q"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*opt)->StateShape(2, "momentum"), StatusIs(absl::StatusCode::kOutOfRange));
  std::vector<float> v = RandomVector(10, 3), back(10);
  EXPECT_THAT((*opt)->SetState(1, "variance_neuron", absl::MakeSpan(v).subspan(0, 9)),
              StatusIs(kInvalid));
  ASSERT_THAT((*opt)->SetState(1, "variance_neuron", v), IsOk());
  ASSERT_THAT((*opt)->GetState(1, "variance_neuron", absl::MakeSpan(back)), IsOk());
  EXPECT_EQ(v, back);
  auto adam = CreateGroupOptimizer(Cfg(AlgorithmKind::kAdamW), {{3}});
  EXPECT_EQ(*(*adam)->StateShape(0, "step_dev"), std::vector<int64_t>{});
  // Dion's Q is seeded: the same seed gives the same Q, another seed another Q.
  GroupConfig d = Cfg(AlgorithmKind::kDion);
  std::vector<float> q1(9), q2(9), q3(9);  // Q is [3, 3]
  ASSERT_THAT((*CreateGroupOptimizer(d, {{4, 3}}))->GetState(0, "Q", absl::MakeSpan(q1)), IsOk());
  ASSERT_THAT((*CreateGroupOptimizer(d, {{4, 3}}))->GetState(0, "Q", absl::MakeSpan(q2)), IsOk());
  d.seed = 5;
  ASSERT_THAT((*CreateGroupOptimizer(d, {{4, 3}}))->GetState(0, "Q", absl::MakeSpan(q3)), IsOk());
  EXPECT_EQ(q1, q2);
  EXPECT_NE(q1, q3);
}

// Same-shape parameters are processed as one batch; the result must be bit-identical to
// running each parameter in its own group (the ops run the same per-matrix kernel).
TEST(GroupOptimizerTest, BatchedEqualsOneByOneBitForBit) {
  auto ctx = kernels::Context::CpuDefault(1);
  for (AlgorithmKind k :
       {AlgorithmKind::kMuon, AlgorithmKind::kNorMuon, AlgorithmKind::kDion, AlgorithmKind::kDion2,
        AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW, AlgorithmKind::kLion}) {
    for (Precision p : {Precision::kFp32, Precision::kBf16Reference}) {
      GroupConfig cfg = Cfg(k);
      cfg.precision = p;
      const ParamShape s = {13, 9};
      auto batched = CreateGroupOptimizer(cfg, {s, s, s});
      ASSERT_THAT(batched, IsOk());
      std::vector<std::vector<float>> xb, gb;
      for (int i = 0; i < 3; ++i) {
        xb.push_back(RandomVector(117, 10 + i));
        gb.push_back(RandomVector(117, 20 + i));
      }
      std::vector<std::vector<float>> xs = xb;
      for (int t = 0; t < 2; ++t) {
        float* xp[3] = {xb[0].data(), xb[1].data(), xb[2].data()};
        const float* gp[3] = {gb[0].data(), gb[1].data(), gb[2].data()};
        ASSERT_THAT((*batched)->Step(*ctx, absl::MakeSpan(xp, 3), absl::MakeSpan(gp, 3)), IsOk());
      }
      for (int i = 0; i < 3; ++i) {
        auto single = CreateGroupOptimizer(cfg, {s});
        if (k == AlgorithmKind::kDion) {  // same initial Q as the batched member
          std::vector<float> q(9 * 9);
          ASSERT_THAT((*batched)->GetState(i, "Q", absl::MakeSpan(q)), IsOk());
          auto fresh = CreateGroupOptimizer(cfg, {s, s, s});
          ASSERT_THAT((*fresh)->GetState(i, "Q", absl::MakeSpan(q)), IsOk());
          ASSERT_THAT((*single)->SetState(0, "Q", q), IsOk());
        }
        for (int t = 0; t < 2; ++t) {
          float* xp = xs[i].data();
          const float* gp = gb[i].data();
          ASSERT_THAT((*single)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)),
                      IsOk());
        }
        EXPECT_EQ(xs[i], xb[i]) << AlgorithmName(k) << " " << PrecisionName(p) << " param " << i;
      }
    }
  }
}

TEST(GroupOptimizerTest, MissingGradientSkipsParameter) {
  auto ctx = kernels::Context::CpuDefault(1);
  auto opt = CreateGroupOptimizer(Cfg(AlgorithmKind::kAdamW), {{5}, {5}});
  std::vector<float> a = RandomVector(5, 1), b = RandomVector(5, 2), b0 = b, g = RandomVector(5, 3);
  float* xp[2] = {a.data(), b.data()};
  const float* gp[2] = {g.data(), nullptr};
  ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(xp, 2), absl::MakeSpan(gp, 2)), IsOk());
  EXPECT_EQ(b, b0);
  float s0 = -1, s1 = -1;
  ASSERT_THAT((*opt)->GetState(0, "step_dev", absl::MakeSpan(&s0, 1)), IsOk());
  ASSERT_THAT((*opt)->GetState(1, "step_dev", absl::MakeSpan(&s1, 1)), IsOk());
  EXPECT_EQ(s0, 1.0f);
  EXPECT_EQ(s1, 0.0f);  // P17: the per-parameter counter advances only with a gradient
}

// last_update_norm is ‖Δx‖_F over the group, whether the rule stages its results (Muon, Dion2)
// or steps in place with the norm computed inside its fused op (AdamW, Lion); a parameter
// without a gradient contributes nothing. Two steps, so the second reuses the buffers.
TEST(GroupOptimizerTest, LastUpdateNormIsTheNormOfTheChange) {
  auto ctx = kernels::Context::CpuDefault(2);
  for (AlgorithmKind k :
       {AlgorithmKind::kAdamW, AlgorithmKind::kLion, AlgorithmKind::kMuon, AlgorithmKind::kDion2}) {
    const std::vector<ParamShape> shapes = {{32, 48}, {32, 48}, {64, 16}};
    auto opt = CreateGroupOptimizer(*ctx, Cfg(k), shapes);
    ASSERT_THAT(opt.status(), IsOk());
    std::vector<std::vector<float>> x, g;
    std::vector<float*> xp;
    std::vector<const float*> gp;
    for (size_t i = 0; i < shapes.size(); ++i) {
      x.push_back(RandomVector(static_cast<size_t>(shapes[i][0] * shapes[i][1]), 10 + i));
      g.push_back(RandomVector(x.back().size(), 20 + i));
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      xp.push_back(x[i].data());
      gp.push_back(g[i].data());
    }
    gp[1] = nullptr;
    for (int step = 1; step <= 2; ++step) {
      const auto before = x;
      ASSERT_THAT((*opt)->Step(*ctx, xp, gp), IsOk());
      double sq = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        for (size_t e = 0; e < x[i].size(); ++e) {
          const double d = static_cast<double>(x[i][e]) - before[i][e];
          sq += d * d;
        }
      }
      EXPECT_EQ(x[1], before[1]);
      ASSERT_GT(sq, 0.0);
      EXPECT_NEAR((*opt)->last_update_norm(), std::sqrt(sq), 1e-6 * std::sqrt(sq))
          << AlgorithmName(k) << " step " << step;
    }
  }
}

TEST(GroupOptimizerTest, LrOverrideReplacesConfiguredLr) {
  auto ctx = kernels::Context::CpuDefault(1);
  GroupConfig a = Cfg(AlgorithmKind::kLion), b = a;
  b.hyperparams.lr = 0.25;
  auto oa = CreateGroupOptimizer(a, {{6}});
  auto ob = CreateGroupOptimizer(b, {{6}});
  std::vector<float> xa = RandomVector(6, 1), xb = xa, g = RandomVector(6, 2);
  float* pa = xa.data();
  float* pb = xb.data();
  const float* gp = g.data();
  StepOptions o;
  o.lr = 0.25;
  ASSERT_THAT((*oa)->Step(*ctx, absl::MakeSpan(&pa, 1), absl::MakeSpan(&gp, 1), o), IsOk());
  ASSERT_THAT((*ob)->Step(*ctx, absl::MakeSpan(&pb, 1), absl::MakeSpan(&gp, 1)), IsOk());
  EXPECT_EQ(xa, xb);
}

// Sharded state (world sessions): after ReleaseState the kept parameters step bit-identically to
// an optimizer that never released anything, the released ones refuse gradients and state
// access, and the held state shrinks to the kept parameters' share.
TEST(GroupOptimizerTest, ReleaseStateKeepsOwnedParametersExact) {
  for (AlgorithmKind k :
       {AlgorithmKind::kMuon, AlgorithmKind::kDion, AlgorithmKind::kDion2, AlgorithmKind::kAdamW}) {
    SCOPED_TRACE(AlgorithmName(k));
    const std::vector<ParamShape> shapes = {{12, 8}, {12, 8}, {12, 8}, {10, 6}};
    auto full = CreateGroupOptimizer(Cfg(k), shapes);
    auto sharded = CreateGroupOptimizer(Cfg(k), shapes);
    ASSERT_THAT(full, IsOk());
    ASSERT_THAT(sharded, IsOk());
    const int64_t all_floats = (*sharded)->StateFloats();
    const std::vector<bool> keep = {true, false, true, false};
    ASSERT_THAT((*sharded)->ReleaseState(keep), IsOk());
    EXPECT_LT((*sharded)->StateFloats(), all_floats);
    EXPECT_TRUE((*sharded)->StateReleased(1));
    EXPECT_FALSE((*sharded)->StateReleased(2));
    auto ctx = kernels::Context::CpuDefault();
    std::vector<std::vector<float>> xa, xb, g;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const size_t n = static_cast<size_t>(shapes[i][0] * shapes[i][1]);
      xa.push_back(RandomVector(n, 10 + i));
      xb.push_back(xa.back());
      g.push_back(RandomVector(n, 20 + i));
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<float*> pa, pb;
      std::vector<const float*> ga, gb;
      for (size_t i = 0; i < shapes.size(); ++i) {
        pa.push_back(xa[i].data());
        pb.push_back(xb[i].data());
        ga.push_back(keep[i] ? g[i].data() : nullptr);  // the full one steps the same subset
        gb.push_back(keep[i] ? g[i].data() : nullptr);
      }
      ASSERT_THAT((*full)->Step(*ctx, pa, ga), IsOk());
      ASSERT_THAT((*sharded)->Step(*ctx, pb, gb), IsOk());
    }
    for (size_t i = 0; i < shapes.size(); ++i) EXPECT_EQ(xa[i], xb[i]) << "param " << i;
    // A gradient for a released parameter is refused and changes nothing.
    std::vector<float*> pb;
    std::vector<const float*> gb;
    for (size_t i = 0; i < shapes.size(); ++i) {
      pb.push_back(xb[i].data());
      gb.push_back(g[i].data());
    }
    const auto before = xb;
    EXPECT_THAT((*sharded)->Step(*ctx, pb, gb),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("released")));
    EXPECT_EQ(xb, before);
    const std::string st = (*sharded)->StateNames()[0];
    auto shape = (*sharded)->StateShape(1, st);
    ASSERT_THAT(shape, IsOk());
    int64_t n = 1;
    for (int64_t d : *shape) n *= d;
    std::vector<float> buf(static_cast<size_t>(n));
    EXPECT_THAT((*sharded)->GetState(1, st, absl::MakeSpan(buf)),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT((*sharded)->SetState(1, st, buf), StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT((*sharded)->GetState(2, st, absl::MakeSpan(buf)), IsOk());
    EXPECT_THAT((*sharded)->ReleaseState({true}), StatusIs(kInvalid));
  }
}

}  // namespace
}  // namespace diond::optim

namespace diond::optim {
namespace {

// kAuto follows PyTorch's check for oneDNN's bf16 matmul (AVX-512 core); the expectation here
// reads the kernel's CPU flags, independently of the compiler builtins the code uses.
TEST(Bf16MatmulEngineTest, AutoFollowsTheCpuFlags) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  if (!cpuinfo) GTEST_SKIP() << "no /proc/cpuinfo on this system";
  std::string line, flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      flags = line + " ";
      break;
    }
  }
  ASSERT_FALSE(flags.empty());
  bool all = true;
  for (const char* f : {" avx512f ", " avx512bw ", " avx512vl ", " avx512dq "}) {
    all = all && flags.find(f) != std::string::npos;
  }
  EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kAuto),
            all ? Bf16MatmulEngine::kOneDnn : Bf16MatmulEngine::kFloat32Gemm);
  EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kFloat32Gemm), Bf16MatmulEngine::kFloat32Gemm);
  EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kOneDnn), Bf16MatmulEngine::kOneDnn);
  // After a start-up calibration, kAuto is what it measured, whatever the ISA rule says.
  const kernels::AutoEngines before = kernels::CurrentAutoEngines();
  kernels::AutoEngines measured = before;
  measured.bf16_measured = true;
  for (bool onednn : {false, true}) {
    measured.bf16_onednn = onednn;
    kernels::SetAutoEngines(measured);
    EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kAuto),
              onednn ? Bf16MatmulEngine::kOneDnn : Bf16MatmulEngine::kFloat32Gemm);
    EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kFloat32Gemm), Bf16MatmulEngine::kFloat32Gemm);
  }
  kernels::SetAutoEngines(before);
  EXPECT_EQ(ResolveBf16Matmul(Bf16MatmulEngine::kAuto), IsaBf16Matmul());
}

}  // namespace
}  // namespace diond::optim
