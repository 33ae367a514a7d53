// Tests of the kops block of kernels/ops.h: the tracked AdamW/Lion steps, MomentumUpdate,
// ApplyUpdate, NormalizeNeurons, CopyWithChange and DecayScatterWithChange, each against an
// independent scalar formulation written here (or, for the tracked steps, against the untracked op
// and a double sum of the changes).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;
using testing::RandomVector;

// Large enough that the elementwise loops split over the threads of a 2-thread context.
constexpr int64_t kN = 300001;

double SumSqDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return s;
}

TEST(AdamWStepTracked, SameResultAsTheUntrackedOpAndReportsTheChange) {
  for (int threads : {1, 2}) {
    auto ctx = Context::CpuDefault(threads);
    const auto g = RandomVector(kN, 1), x0 = RandomVector(kN, 2, 0.1f);
    auto m0 = RandomVector(kN, 3, 0.01f), v0 = RandomVector(kN, 4, 0.01f);
    for (float& e : v0) e = e * e;
    AdamWParams p;
    p.lr = 0.01f;
    p.weight_decay = 0.1f;
    p.step = 3;
    p.cautious = threads == 2;
    std::vector<float> xa = x0, ma = m0, va = v0, xb = x0, mb = m0, vb = v0;
    ASSERT_THAT(AdamWStep(*ctx, p, MakeView(g.data(), {kN}), MakeView(xa.data(), {kN}),
                          MakeView(ma.data(), {kN}), MakeView(va.data(), {kN})),
                IsOk());
    float sq = -1.0f;
    ASSERT_THAT(AdamWStep(*ctx, p, MakeView(g.data(), {kN}), MakeView(xb.data(), {kN}),
                          MakeView(mb.data(), {kN}), MakeView(vb.data(), {kN}), MakeView(&sq, {1})),
                IsOk());
    EXPECT_EQ(xa, xb);
    EXPECT_EQ(ma, mb);
    EXPECT_EQ(va, vb);
    const double want = SumSqDiff(xa, x0);
    ASSERT_GT(want, 0.0);
    EXPECT_NEAR(sq, want, 1e-6 * want) << threads << " threads";
  }
}

TEST(LionStepTracked, SameResultAsTheUntrackedOpAndReportsTheChange) {
  auto ctx = Context::CpuDefault(2);
  const auto g = RandomVector(kN, 5), x0 = RandomVector(kN, 6), m0 = RandomVector(kN, 7);
  LionParams p;
  p.lr = 0.001f;
  p.weight_decay = 0.1f;
  std::vector<float> xa = x0, ma = m0, xb = x0, mb = m0;
  ASSERT_THAT(LionStep(*ctx, p, MakeView(g.data(), {kN}), MakeView(xa.data(), {kN}),
                       MakeView(ma.data(), {kN})),
              IsOk());
  float sq = -1.0f;
  ASSERT_THAT(LionStep(*ctx, p, MakeView(g.data(), {kN}), MakeView(xb.data(), {kN}),
                       MakeView(mb.data(), {kN}), MakeView(&sq, {1})),
              IsOk());
  EXPECT_EQ(xa, xb);
  EXPECT_EQ(ma, mb);
  const double want = SumSqDiff(xa, x0);
  EXPECT_NEAR(sq, want, 1e-6 * want);
}

TEST(TrackedSteps, RejectABadUpdateSqView) {
  auto ctx = Context::CpuDefault();
  std::vector<float> x(8, 1.0f), g(8, 0.5f), m(8), v(8), two(2);
  AdamWParams p;
  p.lr = 0.1f;
  EXPECT_THAT(
      AdamWStep(*ctx, p, MakeView(g.data(), {8}), MakeView(x.data(), {8}), MakeView(m.data(), {8}),
                MakeView(v.data(), {8}), MakeView(two.data(), {2})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("update_sq")));
  EXPECT_THAT(LionStep(*ctx, LionParams{}, MakeView(g.data(), {8}), MakeView(x.data(), {8}),
                       MakeView(m.data(), {8}), MakeView(x.data() + 3, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps x")));
  EXPECT_EQ(x, std::vector<float>(8, 1.0f));  // nothing written
}

TEST(MomentumUpdate, MatchesTheRecipeWithAndWithoutNesterov) {
  auto ctx = Context::CpuDefault(2);
  const auto g = RandomVector(kN, 8), m0 = RandomVector(kN, 9);
  const float mu = 0.95f;
  for (bool nesterov : {false, true}) {
    // In place, and out of place from m0 (the input left untouched): the same values.
    std::vector<float> m = m0, u(kN), in = m0, out(kN), u2(kN);
    ASSERT_THAT(
        MomentumUpdate(*ctx, mu, nesterov, MakeView(g.data(), {kN}), MakeView(m.data(), {kN}),
                       MakeView(m.data(), {kN}), MakeView(u.data(), {kN})),
        IsOk());
    ASSERT_THAT(
        MomentumUpdate(*ctx, mu, nesterov, MakeView(g.data(), {kN}), MakeView(in.data(), {kN}),
                       MakeView(out.data(), {kN}), MakeView(u2.data(), {kN})),
        IsOk());
    EXPECT_EQ(in, m0);
    EXPECT_EQ(out, m);
    EXPECT_EQ(u2, u);
    for (int64_t i = 0; i < kN; i += 997) {
      const float want_m = mu * m0[i] + g[i];
      ASSERT_EQ(m[i], want_m) << i;
      ASSERT_EQ(u[i], nesterov ? mu * want_m + g[i] : want_m) << i;
    }
  }
  std::vector<float> m = m0;
  EXPECT_THAT(MomentumUpdate(*ctx, mu, true, MakeView(g.data(), {kN}), MakeView(m.data(), {kN}),
                             MakeView(m.data(), {kN}), MakeView(m.data(), {kN})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("u overlaps")));
  std::vector<float> u(kN - 1);
  EXPECT_THAT(
      MomentumUpdate(*ctx, mu, true, MakeView(g.data(), {kN - 1}), MakeView(m.data() + 1, {kN - 1}),
                     MakeView(m.data(), {kN - 1}), MakeView(u.data(), {kN - 1})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("partly overlaps")));
  EXPECT_EQ(m, m0);
}

TEST(ApplyUpdate, DecaysThenSubtractsTheRoundedStep) {
  auto ctx = Context::CpuDefault(2);
  const auto u = RandomVector(kN, 10), x0 = RandomVector(kN, 11);
  ApplyUpdateParams p;
  p.alpha = 0.0123f;
  p.lr_wd = 0.02f * 0.1f;
  for (bool cautious : {false, true}) {
    for (bool round : {false, true}) {
      p.cautious = cautious;
      p.round_bf16 = round;
      std::vector<float> x = x0, out(kN);
      ASSERT_THAT(ApplyUpdate(*ctx, p, MakeView(u.data(), {kN}), MakeView(x.data(), {kN}),
                              MakeView(x.data(), {kN})),
                  IsOk());
      ASSERT_THAT(ApplyUpdate(*ctx, p, MakeView(u.data(), {kN}), MakeView(x0.data(), {kN}),
                              MakeView(out.data(), {kN})),
                  IsOk());
      ASSERT_EQ(out, x);  // out of place from x0: the same values
      for (int64_t i = 0; i < kN; i += 991) {
        float want = x0[i];
        if (!cautious) {
          want = want * (1.0f - p.lr_wd);
        } else if (want * u[i] >= 0.0f) {
          want = want - p.lr_wd * want;
        }
        const float step = round ? RoundToBf16(p.alpha * u[i]) : p.alpha * u[i];
        ASSERT_EQ(x[i], want - step) << i << " cautious " << cautious << " round " << round;
      }
    }
  }
}

// The NorMuon recipe of ALGORITHMS.md §6.2 in double, for one unit.
void NormalizeReference(std::vector<double>& o, std::vector<double>& v, int64_t rows, int64_t cols,
                        double w) {
  double f2 = 0, d2 = 0;
  for (double e : o) f2 += e * e;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += o[r * cols + c] * o[r * cols + c];
    v[r] = v[r] + w * (ss / cols - v[r]);
    for (int64_t c = 0; c < cols; ++c) {
      o[r * cols + c] /= std::sqrt(v[r]) + 1e-8;
      d2 += o[r * cols + c] * o[r * cols + c];
    }
  }
  const double scale = std::sqrt(f2) / std::max(std::sqrt(d2), 1e-8);
  for (double& e : o) e *= scale;
}

TEST(NormalizeNeurons, MatchesTheRecipeAndBatchesBitForBit) {
  auto ctx = Context::CpuDefault(2);
  const int64_t batch = 3, rows = 40, cols = 24;
  const auto o0 = RandomVector(batch * rows * cols, 12);
  auto v0 = RandomVector(batch * rows, 13, 0.1f);
  for (float& e : v0) e = e * e;
  const float w = 1.0f - 0.95f;
  std::vector<float> o = o0, v = v0;
  ASSERT_THAT(NormalizeNeurons(*ctx, w, MakeView(o.data(), {batch, rows, cols}),
                               MakeView(v.data(), {batch * rows})),
              IsOk());
  for (int64_t b = 0; b < batch; ++b) {
    // Against the double recipe.
    std::vector<double> od(o0.begin() + b * rows * cols, o0.begin() + (b + 1) * rows * cols);
    std::vector<double> vd(v0.begin() + b * rows, v0.begin() + (b + 1) * rows);
    NormalizeReference(od, vd, rows, cols, w);
    for (int64_t i = 0; i < rows * cols; ++i) {
      ASSERT_NEAR(o[b * rows * cols + i], od[i], 1e-5 * std::fabs(od[i]) + 1e-6) << b << " " << i;
    }
    for (int64_t r = 0; r < rows; ++r) ASSERT_NEAR(v[b * rows + r], vd[r], 1e-6 * vd[r]);
    // One unit at a time gives the same bits as the batched call.
    std::vector<float> one(o0.begin() + b * rows * cols, o0.begin() + (b + 1) * rows * cols);
    std::vector<float> vone(v0.begin() + b * rows, v0.begin() + (b + 1) * rows);
    ASSERT_THAT(NormalizeNeurons(*ctx, w, MakeView(one.data(), {rows, cols}),
                                 MakeView(vone.data(), {rows})),
                IsOk());
    for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(one[i], o[b * rows * cols + i]);
    for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(vone[r], v[b * rows + r]);
  }
  std::vector<float> short_v(rows);
  EXPECT_THAT(NormalizeNeurons(*ctx, w, MakeView(o.data(), {batch, rows, cols}),
                               MakeView(short_v.data(), {rows})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("v is")));
}

// The f32 recipe with every sum in the documented order (ops.h NormalizeNeurons): each row's Σo²
// and ΣD² in the warp order (testing::WarpOrderSum), a unit's ‖O‖² and ‖D‖² as those row sums
// added in row order; the CUDA backend's order, so this pins what a GPU must reproduce.
void NormalizeInWarpOrder(std::vector<float>& o, std::vector<float>& v, int64_t rows, int64_t cols,
                          float w) {
  double f2 = 0.0, d2 = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = o.data() + r * cols;
    std::vector<double> sq;
    for (int64_t c = 0; c < cols; ++c) sq.push_back(static_cast<double>(row[c]) * row[c]);
    const double ss = testing::WarpOrderSum(sq);
    f2 += ss;
    const float nu = static_cast<float>(ss) / static_cast<float>(cols);
    v[r] = w < 0.5f ? v[r] + w * (nu - v[r]) : nu - (nu - v[r]) * (1.0f - w);
    const float denom = std::sqrt(v[r]) + 1e-8f;
    sq.clear();
    for (int64_t c = 0; c < cols; ++c) {
      row[c] = row[c] / denom;
      sq.push_back(static_cast<double>(row[c]) * row[c]);
    }
    d2 += testing::WarpOrderSum(sq);
  }
  const float f = static_cast<float>(std::sqrt(f2)), d = static_cast<float>(std::sqrt(d2));
  const float scale = f / (d < 1e-8f ? 1e-8f : d);
  for (float& e : o) e *= scale;
}

// Bit for bit against that recipe, on units whose rows straddle the 32 lanes and on a unit with
// a row (testing::OrderProbeRow) whose Σo² rounds differently in index order: its V then shows
// the order.
TEST(NormalizeNeurons, SumsInTheWarpOrderBitForBit) {
  auto ctx = Context::CpuDefault(2);
  struct Shape {
    int64_t batch, rows, cols;
  };
  for (const Shape sh : {Shape{1, 1, 1}, Shape{3, 7, 31}, Shape{2, 5, 32}, Shape{2, 9, 33},
                         Shape{1, 4, 160}, Shape{2, 40, 65}}) {
    auto o = RandomVector(sh.batch * sh.rows * sh.cols, 70 + static_cast<uint32_t>(sh.cols));
    if (sh.cols == 160) {
      const std::vector<float> probe = testing::OrderProbeRow(sh.cols, /*squares=*/true);
      std::copy(probe.begin(), probe.end(), o.begin() + sh.cols);  // row 1 of unit 0
    }
    auto v = RandomVector(sh.batch * sh.rows, 71, 0.1f);
    for (float& e : v) e = e * e;
    for (const float w : {0.05f, 0.75f, 1.0f}) {
      std::vector<float> got = o, gv = v;
      ASSERT_THAT(NormalizeNeurons(*ctx, w, MakeView(got.data(), {sh.batch, sh.rows, sh.cols}),
                                   MakeView(gv.data(), {sh.batch * sh.rows})),
                  IsOk());
      for (int64_t b = 0; b < sh.batch; ++b) {
        std::vector<float> want(o.begin() + b * sh.rows * sh.cols,
                                o.begin() + (b + 1) * sh.rows * sh.cols);
        std::vector<float> wv(v.begin() + b * sh.rows, v.begin() + (b + 1) * sh.rows);
        NormalizeInWarpOrder(want, wv, sh.rows, sh.cols, w);
        for (int64_t r = 0; r < sh.rows; ++r) {
          ASSERT_EQ(gv[b * sh.rows + r], wv[r]) << sh.cols << " unit " << b << " row " << r;
        }
        for (int64_t e = 0; e < sh.rows * sh.cols; ++e) {
          ASSERT_EQ(got[b * sh.rows * sh.cols + e], want[e]) << sh.cols << " unit " << b;
        }
      }
      if (sh.cols == 160 && w == 1.0f) {
        // w = 1: V is the probe row's ν, (1 + 2^-23)/160 in this order (1/160 in index order).
        EXPECT_EQ(gv[1], (1.0f + 0x1p-23f) / 160.0f);
        EXPECT_NE(gv[1], 1.0f / 160.0f);
      }
    }
  }
}

TEST(CopyWithChange, CopiesAndReportsTheSquaredChange) {
  auto ctx = Context::CpuDefault(2);
  const auto src = RandomVector(kN, 14), dst0 = RandomVector(kN, 15);
  std::vector<float> dst = dst0;
  float sq = -1.0f;
  ASSERT_THAT(CopyWithChange(*ctx, MakeView(src.data(), {kN}), MakeView(dst.data(), {kN}),
                             MakeView(&sq, {1})),
              IsOk());
  EXPECT_EQ(dst, src);
  const double want = SumSqDiff(src, dst0);
  EXPECT_NEAR(sq, want, 1e-6 * want);
  EXPECT_THAT(CopyWithChange(*ctx, MakeView(src.data(), {kN}), MakeView(dst.data(), {kN}),
                             MakeView(dst.data() + 7, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
}

// Dion2's deferred parameter write against the two ops it replaces (Scale by the decay, then a
// Scatter of alpha·src with beta 1, matrix by matrix), bit for bit, and a double sum of the
// changes; both axes, one matrix and a batch with its own indices per matrix.
TEST(DecayScatterWithChange, IsScaleThenScatterBitForBitAndReportsTheChange) {
  for (int threads : {1, 2}) {
    auto ctx = Context::CpuDefault(threads);
    for (const Axis axis : {Axis::kRows, Axis::kCols}) {
      for (const int64_t batch : {int64_t{1}, int64_t{3}}) {
        const int64_t rows = 97, cols = 389;  // not multiples of the vector width
        const int64_t len = axis == Axis::kRows ? rows : cols, k = len / 4 + 1;
        const int64_t sr = axis == Axis::kRows ? k : rows, sc = axis == Axis::kRows ? cols : k;
        const auto x0 = RandomVector(batch * rows * cols, 40 + batch, 0.1f);
        const auto src = RandomVector(batch * sr * sc, 41 + batch);
        std::vector<int64_t> idx;
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t j = 0; j < k; ++j) idx.push_back((j * 7 + 3 * b + 1) % len);  // distinct
        }
        const float decay = 0.99f, alpha = -0.0123f;
        std::vector<float> want = x0;
        for (int64_t b = 0; b < batch; ++b) {
          TensorView xm = MakeView(want.data() + b * rows * cols, {rows, cols});
          ASSERT_THAT(Scale(*ctx, decay, xm, xm), IsOk());
          ASSERT_THAT(Scatter(*ctx, MakeView(src.data() + b * sr * sc, {sr, sc}), axis,
                              absl::MakeConstSpan(idx.data() + b * k, static_cast<size_t>(k)),
                              alpha, 1.0f, xm),
                      IsOk());
        }
        std::vector<float> x = x0;
        float sq = -1.0f;
        const ConstTensorView sv =
            batch == 1 ? MakeView(src.data(), {sr, sc}) : MakeView(src.data(), {batch, sr, sc});
        const TensorView xv =
            batch == 1 ? MakeView(x.data(), {rows, cols}) : MakeView(x.data(), {batch, rows, cols});
        ASSERT_THAT(
            DecayScatterWithChange(*ctx, decay, sv, axis, idx, alpha, xv, MakeView(&sq, {1})),
            IsOk());
        ASSERT_EQ(x, want) << "axis " << static_cast<int>(axis) << " batch " << batch;
        const double change = SumSqDiff(x, x0);
        EXPECT_NEAR(sq, change, 1e-6 * change);
      }
    }
  }
}

TEST(DecayScatterWithChange, RefusesBadIndicesShapesAndOverlaps) {
  auto ctx = Context::CpuDefault(2);
  std::vector<float> x(2 * 8 * 6, 1.0f), src(2 * 2 * 6, 0.5f);
  float sq = 0.0f;
  const ConstTensorView good = MakeView(src.data(), {2, 2, 6});
  auto call = [&](std::vector<int64_t> idx, ConstTensorView s, TensorView out_sq) {
    return DecayScatterWithChange(*ctx, 0.9f, s, Axis::kRows, idx, -1.0f,
                                  MakeView(x.data(), {2, 8, 6}), out_sq);
  };
  EXPECT_THAT(call({0, 1, 2, 3}, good, MakeView(&sq, {1})), IsOk());
  EXPECT_THAT(call({0, 0, 2, 3}, good, MakeView(&sq, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than once")));
  // The same index in two matrices is fine: each matrix has its own selection.
  EXPECT_THAT(call({0, 1, 0, 1}, good, MakeView(&sq, {1})), IsOk());
  EXPECT_THAT(call({0, 8, 2, 3}, good, MakeView(&sq, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(call({0, 1, 2}, good, MakeView(&sq, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("per matrix")));
  EXPECT_THAT(call({0, 1, 2, 3}, MakeView(src.data(), {2, 3, 4}), MakeView(&sq, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("src is")));
  EXPECT_THAT(call({0, 1, 2, 3}, good, MakeView(x.data() + 5, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
  EXPECT_THAT(DecayScatterWithChange(*ctx, 0.9f, MakeView(x.data() + 10, {2, 2, 6}), Axis::kRows,
                                     std::vector<int64_t>{0, 1, 2, 3}, -1.0f,
                                     MakeView(x.data(), {2, 8, 6}), MakeView(&sq, {1})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("src overlaps x")));
}

// ---- kbw: the ISA clones of the fused loops (loops.h DIOND_CPU_CLONES) give the bits of the
// formula of ops.h, element by element, whichever clone the CPU runs (sizes not a multiple of
// the vector width or of the tracked block, cautious on and off, both moments far from zero).
TEST(AdamWStep, EveryElementIsTheOpsHFormulaBitForBit) {
  auto ctx = Context::CpuDefault(2);
  for (const bool cautious : {false, true}) {
    const int64_t n = kN;
    const auto g = RandomVector(n, 11), x0 = RandomVector(n, 12, 0.1f);
    const auto m0 = RandomVector(n, 13, 0.01f);
    auto v0 = RandomVector(n, 14, 0.01f);
    for (float& e : v0) e = std::fabs(e);
    AdamWParams p;
    p.lr = 0.01f;
    p.weight_decay = 0.1f;
    p.beta2 = 0.95f;
    p.step = 7;
    p.cautious = cautious;
    std::vector<float> x = x0, m = m0, v = v0;
    float sq = 0.0f;
    ASSERT_THAT(AdamWStep(*ctx, p, MakeView(g.data(), {n}), MakeView(x.data(), {n}),
                          MakeView(m.data(), {n}), MakeView(v.data(), {n}), MakeView(&sq, {1})),
                IsOk());
    // ops.h: the scalars in double from the f32 hyperparameters, cast to f32 at use.
    const double lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2;
    const float decay = static_cast<float>(1.0 - lr * wd);
    const float lr_wd = static_cast<float>(lr * wd);
    const float omb1 = static_cast<float>(1.0 - b1), omb2 = static_cast<float>(1.0 - b2);
    const float step_size = static_cast<float>(-lr / (1.0 - std::pow(b1, 7.0)));
    const float sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(b2, 7.0)));
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float mi = std::fma(omb1, g[i] - m0[i], m0[i]);
      const float vp = v0[i] * p.beta2;
      const float vq = (omb2 * g[i]) * g[i];
      const float vi = vp + vq;
      float xi = x0[i] * decay;
      const float num = step_size * mi;
      const float den = std::sqrt(vi) / sqrt_bc2 + p.epsilon;
      xi += num / den;
      if (cautious && mi * x0[i] < 0.0f) xi += lr_wd * x0[i];
      wrong += (mi != m[i] || vi != v[i] || xi != x[i]) ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0) << "cautious " << cautious;
    const double want = SumSqDiff(x, x0);
    EXPECT_NEAR(sq, want, 1e-6 * want);
  }
}

}  // namespace
}  // namespace diond::kernels
