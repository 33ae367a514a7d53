// Tests of the elementwise and fused ops: eager-PyTorch rounding, lerp, broadcasting, AdamW, Lion.
#include <cfloat>
#include <cmath>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using testing::RandomVector;

TEST(Axpby, RoundsOnceToBf16) {
  auto ctx = Context::CpuDefault();
  const auto x = RandomVector(1000, 71), y = RandomVector(1000, 72);
  const auto x16 = testing::ToBf16(x), y16 = testing::ToBf16(y);
  std::vector<BFloat16> out(1000);
  ASSERT_THAT(Axpby(*ctx, 0.3f, MakeView(x16.data(), {1000}), -1.7f, MakeView(y16.data(), {1000}),
                    MakeView(out.data(), {1000})),
              IsOk());
  for (int i = 0; i < 1000; ++i) {
    const float want = RoundToBf16(0.3f * Bf16ToFloat(x16[i]) + -1.7f * Bf16ToFloat(y16[i]));
    ASSERT_EQ(Bf16ToFloat(out[i]), want);
  }
  // Scale in place, f32.
  std::vector<float> v = x;
  ASSERT_THAT(Scale(*ctx, 2.0f, MakeView(v.data(), {10, 100}), MakeView(v.data(), {10, 100})),
              IsOk());
  EXPECT_EQ(v[5], 2.0f * x[5]);
}

// The lerp of Lion's per-element math (elementwise_math.h).
TEST(Lerp, UsesPyTorchsTwoBranchFormula) {
  std::vector<float> s = {1.0f, -3.0f, 1e8f}, e = {2.0f, 5.0f, 1.0f}, out(3);
  for (float w : {0.05f, 0.5f, 0.95f, 1.0f}) {
    for (int i = 0; i < 3; ++i) out[i] = math::Lerp(s[i], e[i], w);
    for (int i = 0; i < 3; ++i) {
      const float want = w < 0.5f ? s[i] + w * (e[i] - s[i]) : e[i] - (e[i] - s[i]) * (1.0f - w);
      EXPECT_EQ(out[i], want) << "w " << w;
    }
  }
  EXPECT_EQ(out[2], 1.0f);  // weight 1 returns `end` exactly (the reason for the second branch)
}

TEST(Unary, SignAbsSqrtNanToNum) {
  auto ctx = Context::CpuDefault();
  std::vector<float> x = {-2.0f, -0.0f, 0.0f, 3.0f, NAN, INFINITY, -INFINITY}, out(7);
  ASSERT_THAT(Unary(*ctx, UnaryOp::kSign, MakeView(x.data(), {7}), MakeView(out.data(), {7})),
              IsOk());
  EXPECT_EQ(out, (std::vector<float>{-1, 0, 0, 1, 0, 1, -1}));
  ASSERT_THAT(Unary(*ctx, UnaryOp::kNanToNum, MakeView(x.data(), {7}), MakeView(out.data(), {7})),
              IsOk());
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_EQ(out[5], FLT_MAX);
  EXPECT_EQ(out[6], -FLT_MAX);
  ASSERT_THAT(Unary(*ctx, UnaryOp::kAbs, MakeView(x.data(), {7}), MakeView(out.data(), {7})),
              IsOk());
  EXPECT_EQ(out[0], 2.0f);
}

TEST(Binary, BroadcastsRowScalesAndScalars) {
  auto ctx = Context::CpuDefault();
  const int64_t m = 3, n = 4;
  const auto x = RandomVector(m * n, 73);
  std::vector<float> rs = {1.0f, 2.0f, 4.0f}, out(m * n);
  ASSERT_THAT(Binary(*ctx, BinaryOp::kDiv, MakeView(x.data(), {m, n}), MakeView(rs.data(), {m, 1}),
                     MakeView(out.data(), {m, n})),
              IsOk());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(out[i * n + j], x[i * n + j] / rs[i]);
  }
  float two = 2.0f;
  ASSERT_THAT(Binary(*ctx, BinaryOp::kMul, MakeView(x.data(), {m, n}), MakeView(&two, {1, 1}),
                     MakeView(out.data(), {m, n})),
              IsOk());
  EXPECT_EQ(out[7], 2.0f * x[7]);
  EXPECT_THAT(Binary(*ctx, BinaryOp::kAdd, MakeView(x.data(), {m, n}), MakeView(rs.data(), {1, 3}),
                     MakeView(out.data(), {m, n})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("broadcast")));
}

TEST(Copy, TransposesAndConverts) {
  auto ctx = Context::CpuDefault();
  const int64_t m = 5, n = 3;
  const auto x = RandomVector(m * n, 74);
  std::vector<BFloat16> t(m * n);
  ASSERT_THAT(Copy(*ctx, MakeView(x.data(), {m, n}).Transposed(), MakeView(t.data(), {n, m})),
              IsOk());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(t[j * m + i].bits, FloatToBf16(x[i * n + j]).bits);
  }
  EXPECT_THAT(Copy(*ctx, MakeView(x.data(), {m, n}), MakeView(t.data(), {m, n - 1})),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Elementwise, RejectsMismatchedShapesAndNonContiguousViews) {
  auto ctx = Context::CpuDefault();
  std::vector<float> x(12), y(12), out(12);
  EXPECT_THAT(Axpby(*ctx, 1.0f, MakeView(x.data(), {3, 4}), 1.0f, MakeView(y.data(), {4, 3}),
                    MakeView(out.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("y is [4, 3]")));
  EXPECT_THAT(Binary(*ctx, BinaryOp::kAdd, MakeView(x.data(), {3, 4}).Transposed(),
                     MakeView(y.data(), {4, 3}), MakeView(out.data(), {4, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("contiguous")));
  EXPECT_THAT(AddScalar(*ctx, 1.0f, MakeView(x.data(), {12}), NAN, MakeView(out.data(), {12})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("beta")));
}

TEST(AdamWStep, MatchesHandComputedFirstSteps) {
  auto ctx = Context::CpuDefault();
  std::vector<float> x = {0.5f, -0.25f}, g = {0.1f, -2.0f}, m = {0, 0}, v = {0, 0};
  AdamWParams p;
  p.lr = 0.001f;
  p.beta1 = 0.9f;
  p.beta2 = 0.95f;
  p.epsilon = 1e-8f;
  p.weight_decay = 0.01f;
  std::vector<double> xd(x.begin(), x.end()), md(2, 0.0), vd(2, 0.0);
  for (int64_t t = 1; t <= 3; ++t) {
    p.step = t;
    ASSERT_THAT(AdamWStep(*ctx, p, MakeView(g.data(), {2}), MakeView(x.data(), {2}),
                          MakeView(m.data(), {2}), MakeView(v.data(), {2})),
                IsOk());
    // Closed form in double (ALGORITHMS.md §20.6) with the same f32 hyperparameters.
    const double lr = p.lr, b1 = p.beta1, b2 = p.beta2, eps = p.epsilon, wd = p.weight_decay;
    for (int i = 0; i < 2; ++i) {
      xd[i] *= 1.0 - lr * wd;
      md[i] = b1 * md[i] + (1 - b1) * g[i];
      vd[i] = b2 * vd[i] + (1 - b2) * g[i] * g[i];
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      xd[i] -= lr / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + eps);
      // f32 evaluation of ~10 operations per step, 3 steps: relative error ~30·2^-24 ≈ 2e-6 of
      // the values involved (|x| <= 0.5); 1e-6 absolute covers it.
      EXPECT_NEAR(x[i], xd[i], 1e-6) << "step " << t << " i " << i;
      EXPECT_NEAR(m[i], md[i], 1e-6 * std::fabs(md[i]) + 1e-12);
    }
  }
  p.step = 0;
  EXPECT_THAT(AdamWStep(*ctx, p, MakeView(g.data(), {2}), MakeView(x.data(), {2}),
                        MakeView(m.data(), {2}), MakeView(v.data(), {2})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("step")));
}

TEST(LionStep, MatchesRecipe) {
  auto ctx = Context::CpuDefault();
  std::vector<float> x = {0.5f, -0.25f, 1.0f}, g = {0.1f, -2.0f, 0.0f}, m = {0.2f, 0.3f, 0.0f};
  LionParams p;
  p.lr = 0.001f;
  p.beta1 = 0.9f;
  p.beta2 = 0.99f;
  p.weight_decay = 0.1f;
  const auto x0 = x, m0 = m;
  ASSERT_THAT(
      LionStep(*ctx, p, MakeView(g.data(), {3}), MakeView(x.data(), {3}), MakeView(m.data(), {3})),
      IsOk());
  for (int i = 0; i < 3; ++i) {
    const float c = m0[i] + (1.0f - p.beta1) * (g[i] - m0[i]);
    const float u = c > 0 ? 1.0f : (c < 0 ? -1.0f : 0.0f);
    EXPECT_EQ(x[i], x0[i] * (1.0f - p.lr * p.weight_decay) - p.lr * u);
    EXPECT_EQ(m[i], m0[i] + (1.0f - p.beta2) * (g[i] - m0[i]));
  }
}

}  // namespace
}  // namespace diond::kernels
