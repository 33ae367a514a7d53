// Tests of norms, top-k, IsAllZero, Gather and Scatter.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using testing::RandomVector;

TEST(Norms, MatchNaiveSums) {
  auto ctx = Context::CpuDefault();
  const int64_t b = 2, m = 7, n = 300;
  const auto a = RandomVector(b * m * n, 61);
  std::vector<float> fro(b), rows(b * m), cols(b * n), rl1(b * m), css(b * n);
  ConstTensorView av = MakeView(a.data(), {b, m, n});
  ASSERT_THAT(FrobeniusNorm(*ctx, av, MakeView(fro.data(), {b})), IsOk());
  ASSERT_THAT(AxisNorms(*ctx, av, Axis::kRows, NormType::kL2, MakeView(rows.data(), {b, m})),
              IsOk());
  ASSERT_THAT(AxisNorms(*ctx, av, Axis::kCols, NormType::kL2, MakeView(cols.data(), {b, n})),
              IsOk());
  ASSERT_THAT(AxisNorms(*ctx, av, Axis::kRows, NormType::kL1, MakeView(rl1.data(), {b * m})),
              IsOk());
  ASSERT_THAT(
      AxisNorms(*ctx, av, Axis::kCols, NormType::kSumOfSquares, MakeView(css.data(), {b * n})),
      IsOk());
  // Sums are accumulated in double and rounded once to f32: relative error <= 2^-24 (+ the
  // double accumulation error, ~n·2^-53, negligible). Allow 2 f32 ulps.
  auto near = [](double got, double want) { return std::fabs(got - want) <= 0x1p-23 * want; };
  for (int64_t bi = 0; bi < b; ++bi) {
    double f = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      double s2 = 0.0, s1 = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double v = a[(bi * m + i) * n + j];
        s2 += v * v;
        s1 += std::fabs(v);
      }
      f += s2;
      EXPECT_TRUE(near(rows[bi * m + i], std::sqrt(s2)));
      EXPECT_TRUE(near(rl1[bi * m + i], s1));
    }
    EXPECT_TRUE(near(fro[bi], std::sqrt(f)));
    for (int64_t j = 0; j < n; ++j) {
      double s2 = 0.0;
      for (int64_t i = 0; i < m; ++i)
        s2 += double(a[(bi * m + i) * n + j]) * a[(bi * m + i) * n + j];
      EXPECT_TRUE(near(cols[bi * n + j], std::sqrt(s2)));
      EXPECT_TRUE(near(css[bi * n + j], s2));
    }
  }
}

// The ordering rules, on the L1 norms of the rows of an n×1 matrix (the values themselves).
TEST(TopK, MatchesAStableSortWithTiesByLowerIndex) {
  auto ctx = Context::CpuDefault();
  std::vector<float> s = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, NAN, 9, 0.5f};
  const int64_t n = static_cast<int64_t>(s.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
    if (std::isnan(s[i]) != std::isnan(s[j])) return std::isnan(s[j]);
    return !std::isnan(s[i]) && s[i] > s[j];
  });
  for (int64_t k = 1; k <= n; ++k) {
    std::vector<int64_t> idx(k);
    ASSERT_THAT(TopKByL1Norm(*ctx, MakeView(s.data(), {n, 1}), Axis::kRows, k, absl::MakeSpan(idx)),
                IsOk());
    EXPECT_EQ(idx, std::vector<int64_t>(order.begin(), order.begin() + k)) << "k " << k;
  }
  std::vector<int64_t> idx(2);
  EXPECT_THAT(TopKByL1Norm(*ctx, MakeView(s.data(), {n, 1}), Axis::kRows, 0, absl::MakeSpan(idx)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("k is 0")));
  EXPECT_THAT(TopKByL1Norm(*ctx, MakeView(s.data(), {n, 1}), Axis::kRows, 3, absl::MakeSpan(idx)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(TopK, ByL1NormOfRowsAndColumns) {
  auto ctx = Context::CpuDefault();
  const int64_t m = 6, n = 5;
  const auto a = RandomVector(m * n, 62);
  for (Axis axis : {Axis::kRows, Axis::kCols}) {
    const int64_t len = axis == Axis::kRows ? m : n;
    std::vector<double> l1(len, 0.0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) l1[axis == Axis::kRows ? i : j] += std::fabs(a[i * n + j]);
    }
    std::vector<int64_t> order(len);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t i, int64_t j) { return l1[i] > l1[j]; });
    std::vector<int64_t> idx(3);
    std::vector<float> scores(len);
    ASSERT_THAT(TopKByL1Norm(*ctx, MakeView(a.data(), {m, n}), axis, 3, absl::MakeSpan(idx),
                             MakeView(scores.data(), {len})),
                IsOk());
    EXPECT_EQ(idx, std::vector<int64_t>(order.begin(), order.begin() + 3));
    EXPECT_NEAR(scores[order[0]], l1[order[0]], 1e-5 * l1[order[0]]);
  }
}

TEST(GatherScatter, RoundTripRowsAndColumns) {
  auto ctx = Context::CpuDefault();
  const int64_t b = 2, m = 6, n = 7;
  const auto a = RandomVector(b * m * n, 63);
  const std::vector<int64_t> idx = {4, 0, 5};
  for (Axis axis : {Axis::kRows, Axis::kCols}) {
    const int64_t r = axis == Axis::kRows ? 3 : m, c = axis == Axis::kRows ? n : 3;
    std::vector<float> part(b * r * c);
    ASSERT_THAT(
        Gather(*ctx, MakeView(a.data(), {b, m, n}), axis, idx, MakeView(part.data(), {b, r, c})),
        IsOk());
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t t = 0; t < 3; ++t) {
        if (axis == Axis::kRows) {
          EXPECT_EQ(part[(bi * r + t) * c + 2], a[(bi * m + idx[t]) * n + 2]);
        } else {
          EXPECT_EQ(part[(bi * r + 3) * c + t], a[(bi * m + 3) * n + idx[t]]);
        }
      }
    }
    // Scatter back into zeros restores exactly the selected slices; others stay zero.
    std::vector<float> back(b * m * n, 0.0f);
    ASSERT_THAT(Scatter(*ctx, MakeView(part.data(), {b, r, c}), axis, idx, 1.0f, 0.0f,
                        MakeView(back.data(), {b, m, n})),
                IsOk());
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t sel = axis == Axis::kRows ? i : j;
          const bool picked = std::find(idx.begin(), idx.end(), sel) != idx.end();
          const int64_t e = (bi * m + i) * n + j;
          EXPECT_EQ(back[e], picked ? a[e] : 0.0f);
        }
      }
    }
    // Scatter with alpha/beta: dst[I] = 2·src + 0.5·dst[I] (f32, one rounding per term).
    ASSERT_THAT(Scatter(*ctx, MakeView(part.data(), {b, r, c}), axis, idx, 2.0f, 0.5f,
                        MakeView(back.data(), {b, m, n})),
                IsOk());
    const int64_t e = axis == Axis::kRows ? idx[0] * n : idx[0];
    EXPECT_EQ(back[e], 2.0f * a[e] + 0.5f * a[e]);
  }
}

TEST(GatherScatter, RejectsBadIndices) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12), part(8);
  std::vector<int64_t> bad = {0, 3};
  EXPECT_THAT(
      Gather(*ctx, MakeView(a.data(), {3, 4}), Axis::kRows, bad, MakeView(part.data(), {2, 4})),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("indices[1] = 3")));
  std::vector<int64_t> dup = {1, 1};
  EXPECT_THAT(Scatter(*ctx, MakeView(part.data(), {2, 4}), Axis::kRows, dup, 1.0f, 0.0f,
                      MakeView(a.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("more than once")));
  EXPECT_THAT(Gather(*ctx, MakeView(a.data(), {3, 4}), Axis::kRows, std::vector<int64_t>{0},
                     MakeView(part.data(), {2, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("out is")));
}

TEST(IsAllZero, DetectsNonZeroAndNaN) {
  auto ctx = Context::CpuDefault();
  std::vector<float> z(10, 0.0f);
  z[3] = -0.0f;
  bool all = false;
  ASSERT_THAT(IsAllZero(*ctx, MakeView(z.data(), {2, 5}), &all), IsOk());
  EXPECT_TRUE(all);
  z[7] = NAN;
  ASSERT_THAT(IsAllZero(*ctx, MakeView(z.data(), {2, 5}), &all), IsOk());
  EXPECT_FALSE(all);
  EXPECT_THAT(IsAllZero(*ctx, MakeView(z.data(), {2, 5}), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The f32 row sums are the double sums in the row-sum (warp) order of elementwise_math.h, the
// column sums the double sums in row order, rounded once: bit for bit, for row lengths around
// the 32 lanes, a padded row stride and a batch.
TEST(Norms, RowSumsAreInTheWarpOrderColumnSumsInRowOrder) {
  auto ctx = Context::CpuDefault(2);
  for (const int64_t n : {int64_t{1}, int64_t{31}, int64_t{32}, int64_t{33}, int64_t{1500}}) {
    const int64_t b = 3, m = 29, ld = n + 4;
    const auto a = RandomVector(b * m * ld, 21 + static_cast<uint32_t>(n));
    TensorLayout l = ContiguousLayout(DType::kF32, {b, m, n});
    l.strides[1] = ld;
    l.strides[0] = m * ld;
    ConstTensorView av(a.data(), l);
    for (const NormType t : {NormType::kL1, NormType::kSumOfSquares}) {
      std::vector<float> rows(b * m), cols(b * n);
      ASSERT_THAT(AxisNorms(*ctx, av, Axis::kRows, t, MakeView(rows.data(), {b * m})), IsOk());
      ASSERT_THAT(AxisNorms(*ctx, av, Axis::kCols, t, MakeView(cols.data(), {b * n})), IsOk());
      auto term = [&](float v) {
        return t == NormType::kL1 ? std::fabs(static_cast<double>(v))
                                  : static_cast<double>(v) * static_cast<double>(v);
      };
      int64_t wrong = 0;
      for (int64_t bi = 0; bi < b; ++bi) {
        const float* mat = a.data() + bi * m * ld;
        for (int64_t i = 0; i < m; ++i) {
          std::vector<double> terms;
          for (int64_t j = 0; j < n; ++j) terms.push_back(term(mat[i * ld + j]));
          wrong += static_cast<float>(testing::WarpOrderSum(terms)) != rows[bi * m + i] ? 1 : 0;
        }
        for (int64_t j = 0; j < n; ++j) {
          std::vector<double> terms;
          for (int64_t i = 0; i < m; ++i) terms.push_back(term(mat[i * ld + j]));
          wrong += static_cast<float>(testing::IndexOrderSum(terms)) != cols[bi * n + j] ? 1 : 0;
        }
      }
      EXPECT_EQ(wrong, 0) << "n " << n << " norm " << static_cast<int>(t);
    }
  }
}

// Rows on which the order shows in the f32 result (testing::OrderProbeRow: 1 + 2^-23 in the warp
// order, 1 in index order), f32 and bf16, L1 and sum of squares, AxisNorms and TopKByL1Norm's
// scores: the CPU sums rows in the warp order, whatever the row's length.
TEST(Norms, RowSumsTakeTheWarpOrderWhereItChangesTheResult) {
  auto ctx = Context::CpuDefault(2);
  for (const int64_t n : {int64_t{160}, int64_t{768}, int64_t{1000}}) {
    for (const bool squares : {false, true}) {
      const std::vector<float> row = testing::OrderProbeRow(n, squares);
      ASSERT_EQ(static_cast<int64_t>(row.size()), n);
      // Three rows: the probe, then two ordinary rows (the probe is not the last row).
      std::vector<float> a(static_cast<size_t>(3 * n), 0.25f);
      std::copy(row.begin(), row.end(), a.begin());
      const std::vector<BFloat16> abf = testing::ToBf16(a);
      for (const bool bf16 : {false, true}) {
        ConstTensorView av =
            bf16 ? ConstTensorView(abf.data(), ContiguousLayout(DType::kBf16, {3, n}))
                 : MakeView(a.data(), {3, n});
        std::vector<float> norms(3);
        ASSERT_THAT(
            AxisNorms(*ctx, av, Axis::kRows, squares ? NormType::kSumOfSquares : NormType::kL1,
                      MakeView(norms.data(), {3})),
            IsOk());
        EXPECT_EQ(norms[0], 1.0f + 0x1p-23f)
            << "n " << n << (squares ? " Σx²" : " Σ|x|") << (bf16 ? " bf16" : " f32");
        if (!squares) {
          std::vector<int64_t> idx(3);
          std::vector<float> scores(3);
          ASSERT_THAT(TopKByL1Norm(*ctx, av, Axis::kRows, 3, absl::MakeSpan(idx),
                                   MakeView(scores.data(), {3})),
                      IsOk());
          EXPECT_EQ(scores[0], 1.0f + 0x1p-23f) << "n " << n << (bf16 ? " bf16" : " f32");
        }
      }
    }
  }
}

}  // namespace
}  // namespace diond::kernels
