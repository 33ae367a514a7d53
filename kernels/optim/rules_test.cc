// Every option of every rule against the independent double-precision reference in
// testing/reference.cc. Each test also checks that the option changes the result by far more
// than the tolerance, so the test would fail if the option were ignored.
//
// Tolerance (STYLE C6): the production fp32 path rounds every op to f32 (unit roundoff
// 6e-8); Polar Express / NS5 apply 5 polynomial iterations with coefficients up to ~22 to
// reductions of length <= 64, so the f32 orthogonalized update differs from the double one by
// O(1e-6) relative (the conformance vectors measure 1e-6..6e-6 on the update after 6 steps).
// kTol = 1e-4 on the relative Frobenius error of the *update* (x1 − x0) leaves a 15x margin,
// while every option below changes the update by > 1e-2 relative (checked: kOptionEffect).
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/optim/testing/reference.h"
#include "kernels/tensor.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using testing::Mat;
using testing::RefOptions;

constexpr double kTol = 1e-4;
constexpr double kOptionEffect = 1e-2;

Mat Random(int64_t r, int64_t c, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  Mat m(r, c);
  for (double& e : m.v) e = static_cast<float>(scale * nd(gen));  // exactly f32-representable
  return m;
}

std::vector<float> ToF(const Mat& m) { return std::vector<float>(m.v.begin(), m.v.end()); }

double RelDelta(const std::vector<float>& x1, const Mat& x0, const Mat& ref1) {
  double num = 0, den = 0;
  for (size_t e = 0; e < x1.size(); ++e) {
    const double d = (x1[e] - x0.v[e]) - (ref1.v[e] - x0.v[e]);
    num += d * d;
    den += (ref1.v[e] - x0.v[e]) * (ref1.v[e] - x0.v[e]);
  }
  return std::sqrt(num / den);
}

// ‖a − b‖_F / ‖b − x0‖_F: difference of two trajectories relative to b's update.
double RelDiff(const Mat& a, const Mat& b, const Mat& x0) {
  double num = 0, den = 0;
  for (size_t e = 0; e < a.v.size(); ++e) {
    num += (a.v[e] - b.v[e]) * (a.v[e] - b.v[e]);
    den += (b.v[e] - x0.v[e]) * (b.v[e] - x0.v[e]);
  }
  return std::sqrt(num / den);
}

RefOptions FromConfig(const GroupConfig& c) {
  RefOptions o;
  const Hyperparams& h = c.hyperparams;
  o.lr = h.lr;
  o.wd = h.weight_decay;
  o.eps = h.epsilon;
  o.mu = h.mu;
  o.muon_beta2 = h.muon_beta2;
  o.fraction = h.fraction;
  o.ef_decay = h.ef_decay;
  o.rank_fraction = h.rank_fraction;
  o.rank_multiple_of = h.rank_multiple_of;
  o.beta1 = h.beta1;
  o.beta2 = h.beta2;
  o.nesterov = h.nesterov;
  o.cautious = h.cautious_wd;
  o.ns5 = h.orthogonalizer == Orthogonalizer::kNewtonSchulz5;
  o.adjust = h.adjust_lr == AdjustLr::kSpectralNorm ? 0 : h.adjust_lr == AdjustLr::kRmsNorm ? 1 : 2;
  if (c.num_heads > 1) {
    // filled by the caller (needs m)
  }
  if (!c.split_sizes.empty()) {
    o.row_blocks = c.split_sizes;
    o.split = true;
  }
  return o;
}

// Runs `steps` production steps on one m×n parameter (fp32 mode unless set) from x0 with
// gradients seeded by `seed`, and the same on the reference. Returns (production, reference).
struct RunResult {
  std::vector<float> x;
  Mat ref;
  Mat x0;
};

RunResult RunBoth(GroupConfig cfg, int64_t m, int64_t n, int steps, uint32_t seed,
                  Mat* q_init = nullptr) {
  auto ctx = kernels::Context::CpuDefault(1);
  RunResult run;
  run.x0 = Random(m, n, seed, 0.1);
  auto opt = CreateGroupOptimizer(cfg, {{m, n}});
  EXPECT_THAT(opt, IsOk());
  RefOptions o = FromConfig(cfg);
  if (cfg.num_heads > 1) o.row_blocks.assign(cfg.num_heads, m / cfg.num_heads);
  Mat x = run.x0, mom(m, n), q;
  std::vector<double> v(m, 0.0);
  Mat vv(m, n);
  if (cfg.algorithm == AlgorithmKind::kDion) {
    auto shape = (*opt)->StateShape(0, "Q");
    EXPECT_THAT(shape, IsOk());
    q = Random((*shape)[0], (*shape)[1], seed + 99);
    EXPECT_THAT((*opt)->SetState(0, "Q", ToF(q)), IsOk());
    if (q_init) *q_init = q;
  }
  run.x = ToF(run.x0);
  for (int t = 1; t <= steps; ++t) {
    Mat g = Random(m, n, seed + t);
    std::vector<float> gf = ToF(g);
    float* xp = run.x.data();
    const float* gp = gf.data();
    EXPECT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
    switch (cfg.algorithm) {
      case AlgorithmKind::kMuon:
        testing::RefMuonStep(o, false, x, mom, v, g);
        break;
      case AlgorithmKind::kNorMuon:
        testing::RefMuonStep(o, true, x, mom, v, g);
        break;
      case AlgorithmKind::kDion2:
        testing::RefDion2Step(o, false, x, mom, v, g);
        break;
      case AlgorithmKind::kNorDion2:
        testing::RefDion2Step(o, true, x, mom, v, g);
        break;
      case AlgorithmKind::kDion:
        testing::RefDionStep(o, x, mom, q, g);
        break;
      case AlgorithmKind::kAdamW:
        testing::RefAdamWStep(o, t, x, mom, vv, g);
        break;
      case AlgorithmKind::kLion:
        testing::RefLionStep(o, x, mom, g);
        break;
    }
  }
  run.ref = x;
  return run;
}

GroupConfig Cfg(AlgorithmKind k) {
  GroupConfig c;
  c.algorithm = k;
  c.hyperparams = DefaultHyperparams(k);
  c.hyperparams.lr = 0.02;
  return c;
}

// Checks that production with `with` matches the reference with `with`, and that the
// reference without the option (`without`) differs by much more than the tolerance.
void ExpectOptionMatters(const GroupConfig& with, const GroupConfig& without, int64_t m, int64_t n,
                         int steps = 3) {
  RunResult a = RunBoth(with, m, n, steps, 7);
  EXPECT_LT(RelDelta(a.x, a.x0, a.ref), kTol);
  RunResult b = RunBoth(without, m, n, steps, 7);
  EXPECT_LT(RelDelta(b.x, b.x0, b.ref), kTol);
  EXPECT_GT(RelDiff(b.ref, a.ref, a.x0), kOptionEffect) << "option has no visible effect";
}

TEST(RulesTest, MuonTallAndWideMatchReference) {
  for (auto [m, n] : {std::pair<int64_t, int64_t>{37, 23}, {23, 37}, {16, 16}}) {
    RunResult r = RunBoth(Cfg(AlgorithmKind::kMuon), m, n, 4, 3);
    EXPECT_LT(RelDelta(r.x, r.x0, r.ref), kTol) << m << "x" << n;
  }
}

TEST(RulesTest, MuonNesterov) {
  GroupConfig with = Cfg(AlgorithmKind::kMuon), without = with;
  with.hyperparams.nesterov = true;
  ExpectOptionMatters(with, without, 24, 17);
}

TEST(RulesTest, MuonAdjustLrModes) {
  GroupConfig spectral = Cfg(AlgorithmKind::kMuon), rms = spectral, none = spectral;
  rms.hyperparams.adjust_lr = AdjustLr::kRmsNorm;
  none.hyperparams.adjust_lr = AdjustLr::kNone;
  ExpectOptionMatters(rms, spectral, 40, 17);
  ExpectOptionMatters(none, spectral, 40, 17);
}

TEST(RulesTest, MuonCautiousWeightDecay) {
  GroupConfig with = Cfg(AlgorithmKind::kMuon);
  with.hyperparams.weight_decay = 5.0;  // large, so the mask is visible in the update
  with.hyperparams.lr = 0.05;
  GroupConfig without = with;
  with.hyperparams.cautious_wd = true;
  ExpectOptionMatters(with, without, 20, 12, 2);
}

TEST(RulesTest, MuonNumHeads) {
  GroupConfig with = Cfg(AlgorithmKind::kMuon), without = with;
  with.num_heads = 4;
  ExpectOptionMatters(with, without, 32, 20);
}

TEST(RulesTest, MuonSplitSizes) {
  GroupConfig with = Cfg(AlgorithmKind::kMuon), without = with;
  with.split_sizes = {16, 8, 13};
  ExpectOptionMatters(with, without, 37, 20);
}

TEST(RulesTest, MuonNs5VersusPolarExpress) {
  GroupConfig ns5 = Cfg(AlgorithmKind::kMuon), pe = ns5;
  ns5.hyperparams.orthogonalizer = Orthogonalizer::kNewtonSchulz5;
  ExpectOptionMatters(ns5, pe, 30, 21);
}

TEST(RulesTest, NorMuonWithHeadsSplitAndBeta2) {
  GroupConfig base = Cfg(AlgorithmKind::kNorMuon);
  GroupConfig heads = base, split = base, beta = base;
  heads.num_heads = 2;
  split.split_sizes = {10, 22};
  beta.hyperparams.muon_beta2 = 0.5;
  ExpectOptionMatters(heads, base, 32, 24, 3);
  ExpectOptionMatters(split, base, 32, 24, 3);
  ExpectOptionMatters(beta, base, 32, 24, 3);
}

TEST(RulesTest, Dion2SelectionAxisFractionEfDecayHeads) {
  GroupConfig base = Cfg(AlgorithmKind::kDion2);
  GroupConfig frac = base, ef = base, heads = base;
  frac.hyperparams.fraction = 0.55;
  ef.hyperparams.ef_decay = 0.3;
  heads.num_heads = 2;
  ExpectOptionMatters(frac, base, 37, 23, 3);  // tall: column selection
  ExpectOptionMatters(frac, base, 23, 37, 3);  // wide: row selection
  ExpectOptionMatters(ef, base, 23, 37, 3);
  ExpectOptionMatters(heads, base, 24, 37, 3);
}

TEST(RulesTest, NorDion2MatchesReference) {
  GroupConfig base = Cfg(AlgorithmKind::kNorDion2), frac = base;
  frac.hyperparams.fraction = 0.5;
  ExpectOptionMatters(frac, base, 37, 23, 3);  // tall: still row selection (§8.2)
}

TEST(RulesTest, DionRankAndOrientation) {
  GroupConfig base = Cfg(AlgorithmKind::kDion), low = base, mult = base;
  low.hyperparams.rank_fraction = 0.25;
  mult.hyperparams.rank_fraction = 0.25;
  mult.hyperparams.rank_multiple_of = 4;
  ExpectOptionMatters(low, base, 37, 23, 3);  // r = ceil(5.75) = 6
  ExpectOptionMatters(mult, low, 37, 23, 3);  // r = 4·ceil(5.75/4) = 8
  ExpectOptionMatters(low, base, 23, 37, 3);  // transposed (m < n)
  ExpectOptionMatters(base, low, 24, 24, 3);  // square: a == r, plain QR
  auto opt = CreateGroupOptimizer(mult, {{37, 23}});
  ASSERT_THAT(opt, IsOk());
  EXPECT_EQ(*(*opt)->StateShape(0, "Q"), (std::vector<int64_t>{23, 8}));
  auto opt_t = CreateGroupOptimizer(low, {{23, 37}});
  EXPECT_EQ(*(*opt_t)->StateShape(0, "Q"), (std::vector<int64_t>{23, 6}));
}

TEST(RulesTest, DionZeroMomentumEdgeCase) {
  // G = 0 and M = 0: P ← 0, R ← Q (P13), so X only decays and Q ← colnorm(Q).
  auto ctx = kernels::Context::CpuDefault(1);
  GroupConfig cfg = Cfg(AlgorithmKind::kDion);
  auto opt = CreateGroupOptimizer(cfg, {{6, 4}});
  ASSERT_THAT(opt, IsOk());
  std::vector<float> q0(16);
  ASSERT_THAT((*opt)->GetState(0, "Q", absl::MakeSpan(q0)), IsOk());
  std::vector<float> x(24, 1.5f), g(24, 0.0f);
  float* xp = x.data();
  const float* gp = g.data();
  ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
  const float decay = 1.0f - 0.02f * 0.01f;
  for (float e : x) EXPECT_EQ(e, 1.5f * decay);  // exact: one f32 multiply
  std::vector<float> q1(16);
  ASSERT_THAT((*opt)->GetState(0, "Q", absl::MakeSpan(q1)), IsOk());
  for (int c = 0; c < 4; ++c) {
    double n = 0;
    for (int r = 0; r < 4; ++r) n += double(q0[r * 4 + c]) * q0[r * 4 + c];
    // Column normalization of Q₀ with ε = 1e-8 outside the root; f32 division: 1 ulp.
    for (int r = 0; r < 4; ++r)
      EXPECT_NEAR(q1[r * 4 + c], q0[r * 4 + c] / (std::sqrt(n) + 1e-8), 2e-7);
  }
}

TEST(RulesTest, AdamWAndLionMatchReference) {
  GroupConfig a = Cfg(AlgorithmKind::kAdamW), l = Cfg(AlgorithmKind::kLion);
  a.hyperparams.lr = l.hyperparams.lr = 0.001;
  GroupConfig ac = a, lc = l;
  ac.hyperparams.cautious_wd = lc.hyperparams.cautious_wd = true;
  ac.hyperparams.weight_decay = lc.hyperparams.weight_decay = 50.0;
  GroupConfig a_wd = ac, l_wd = lc;
  a_wd.hyperparams.cautious_wd = l_wd.hyperparams.cautious_wd = false;
  ExpectOptionMatters(ac, a_wd, 9, 7, 3);
  ExpectOptionMatters(lc, l_wd, 9, 7, 3);
}

TEST(RulesTest, AdamWOneStepHandComputed) {
  // x = 1, g = 0.5, lr = 0.1, wd = 0.1, β = (0.9, 0.999), ε = 1e-8, t = 1:
  // x ← 1·(1 − 0.01) = 0.99; m = 0.05; v = 0.00025; bc1 = 0.1, bc2 = 0.001;
  // x ← 0.99 − (0.1/0.1)·0.05/(√0.00025/√0.001 + 1e-8) = 0.99 − 0.05/0.5 = 0.89.
  auto ctx = kernels::Context::CpuDefault(1);
  GroupConfig cfg = Cfg(AlgorithmKind::kAdamW);
  cfg.hyperparams.lr = 0.1;
  cfg.hyperparams.weight_decay = 0.1;
  cfg.hyperparams.beta2 = 0.999;
  auto opt = CreateGroupOptimizer(cfg, {{}});
  ASSERT_THAT(opt, IsOk());
  float x = 1.0f;
  const float g = 0.5f;
  float* xp = &x;
  const float* gp = &g;
  ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
  // f32 hyperparameters and ~10 f32 operations: a few ulps of 0.89 (6e-8 each).
  EXPECT_NEAR(x, 0.89, 5e-7);
  float step = 0;
  ASSERT_THAT((*opt)->GetState(0, "step_dev", absl::MakeSpan(&step, 1)), IsOk());
  EXPECT_EQ(step, 1.0f);
}

TEST(RulesTest, LionOneStepHandComputed) {
  // m = 0, g = -2, β = (0.9, 0.95): u = sign(0 + 0.1·(-2)) = -1; x = 1·(1 − 0.1·0.5) + 0.1 = 1.05;
  // m = 0 + 0.05·(-2) = -0.1.
  auto ctx = kernels::Context::CpuDefault(1);
  GroupConfig cfg = Cfg(AlgorithmKind::kLion);
  cfg.hyperparams.lr = 0.1;
  cfg.hyperparams.weight_decay = 0.5;
  auto opt = CreateGroupOptimizer(cfg, {{1}});
  ASSERT_THAT(opt, IsOk());
  float x = 1.0f;
  const float g = -2.0f;
  float* xp = &x;
  const float* gp = &g;
  ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
  EXPECT_NEAR(x, 1.05, 1e-7);  // two f32 roundings of values near 1
  float m = 0;
  ASSERT_THAT((*opt)->GetState(0, "momentum", absl::MakeSpan(&m, 1)), IsOk());
  EXPECT_NEAR(m, -2.0 * (1 - 0.95), 1e-7);  // 1 − f32(0.95) is 0.05 + 1.2e-8
}

TEST(RulesTest, FlattenIsPerMatrix) {
  // A [3, 4, 5] parameter: flatten → one 3×20 matrix, α from (3, 20); else three 4×5
  // matrices, α from (4, 5). Compare one step with the reference on the corresponding views.
  auto ctx = kernels::Context::CpuDefault(1);
  for (bool flatten : {false, true}) {
    GroupConfig cfg = Cfg(AlgorithmKind::kMuon);
    cfg.flatten = flatten;
    auto opt = CreateGroupOptimizer(cfg, {{3, 4, 5}, {3, 4, 5}});
    ASSERT_THAT(opt, IsOk());
    Mat x0 = Random(1, 60, 11, 0.1), g0 = Random(1, 60, 12);
    Mat x1 = Random(1, 60, 13, 0.1), g1 = Random(1, 60, 14);
    std::vector<float> xa = ToF(x0), xb = ToF(x1), ga = ToF(g0), gb = ToF(g1);
    float* xs[2] = {xa.data(), xb.data()};
    const float* gs[2] = {ga.data(), gb.data()};
    ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(xs, 2), absl::MakeSpan(gs, 2)), IsOk());
    RefOptions o = FromConfig(cfg);
    auto ref = [&](const Mat& x, const Mat& g) {
      const int64_t mats = flatten ? 1 : 3, r = flatten ? 3 : 4, c = flatten ? 20 : 5;
      Mat out(1, 60);
      for (int64_t b = 0; b < mats; ++b) {
        Mat xm(r, c), gm(r, c), mm(r, c);
        std::copy_n(x.v.begin() + b * r * c, r * c, xm.v.begin());
        std::copy_n(g.v.begin() + b * r * c, r * c, gm.v.begin());
        std::vector<double> v;
        testing::RefMuonStep(o, false, xm, mm, v, gm);
        std::copy_n(xm.v.begin(), r * c, out.v.begin() + b * r * c);
      }
      return out;
    };
    EXPECT_LT(RelDelta(xa, x0, ref(x0, g0)), kTol) << "flatten " << flatten;
    EXPECT_LT(RelDelta(xb, x1, ref(x1, g1)), kTol) << "flatten " << flatten;
  }
}

TEST(RulesTest, Bf16ReferenceModeRoundsTheMuonUpdate) {
  // With x0 = 0 and wd = 0, x1 = −bf(α·O): every entry is a bf16 value in bf16_reference mode,
  // and (almost surely) not in fp32 mode. Both stay within bf16 noise of the double reference:
  // ~5 bf16 roundings (2^-8 each) per PE iteration give a few % on O; bound 0.1.
  auto ctx = kernels::Context::CpuDefault(1);
  for (Precision p : {Precision::kBf16Reference, Precision::kFp32}) {
    GroupConfig cfg = Cfg(AlgorithmKind::kMuon);
    cfg.hyperparams.weight_decay = 0;
    cfg.precision = p;
    auto opt = CreateGroupOptimizer(cfg, {{24, 16}});
    ASSERT_THAT(opt, IsOk());
    std::vector<float> x(24 * 16, 0.0f);
    Mat g = Random(24, 16, 5);
    std::vector<float> gf = ToF(g);
    float* xp = x.data();
    const float* gp = gf.data();
    ASSERT_THAT((*opt)->Step(*ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
    int bf16_values = 0;
    for (float e : x) bf16_values += kernels::RoundToBf16(e) == e;
    if (p == Precision::kBf16Reference) {
      EXPECT_EQ(bf16_values, 24 * 16);
    } else {
      EXPECT_LT(bf16_values, 24 * 16 / 4);
    }
    Mat x0(24, 16), m(24, 16), ref(24, 16);
    std::vector<double> v;
    RefOptions o = FromConfig(cfg);
    testing::RefMuonStep(o, false, ref, m, v, g);
    EXPECT_LT(RelDelta(x, x0, ref), p == Precision::kFp32 ? kTol : 0.1);
    EXPECT_GT(RelDelta(x, x0, ref), p == Precision::kFp32 ? 0.0 : 1e-4);
  }
}

}  // namespace
}  // namespace diond::optim
