// Tests of ThinQr, CholeskyQr and RandomizedCholeskyQr: orthonormal Q, Q·R = A.
#include <cmath>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using testing::NaiveGemm;
using testing::RandomVector;

// max |QᵀQ − I| of an m×n Q.
double OrthoError(const std::vector<float>& q, int64_t m, int64_t n) {
  const auto g = NaiveGemm(q, q, n, n, m, /*ta=*/true, /*tb=*/false);
  double e = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) e = std::max(e, std::fabs(g[i * n + j] - (i == j ? 1.0 : 0.0)));
  }
  return e;
}

// max |Q·R − A| / max |A|.
double ReconstructionError(const std::vector<float>& q, const std::vector<float>& r,
                           const std::vector<float>& a, int64_t m, int64_t n) {
  const auto qr = NaiveGemm(q, r, m, n, n, false, false);
  double e = 0.0, amax = 0.0;
  for (int64_t i = 0; i < m * n; ++i) {
    e = std::max(e, std::fabs(qr[i] - a[i]));
    amax = std::max(amax, std::fabs(static_cast<double>(a[i])));
  }
  return e / amax;
}

struct QrShape {
  int64_t m, n;
};
class QrTest : public ::testing::TestWithParam<QrShape> {};

// Householder QR in f32 is backward stable: ‖QᵀQ − I‖ and ‖QR − A‖/‖A‖ are O(m·n·u) in the
// worst case and O(√(mn)·u) typically (Higham, Thm 19.4). With u = 6e-8 and m·n <= 5000 the
// worst-case bound is 3e-4; we allow 1e-4, which the typical behaviour (~1e-6) clears by 100x.
constexpr double kQrTol = 1e-4;

TEST_P(QrTest, HouseholderIsOrthonormalAndReproducesA) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(m * n, 41);
  std::vector<float> q(m * n), r(n * n, 9.0f);
  ASSERT_THAT(ThinQr(*ctx, MakeView(a.data(), {m, n}), MakeView(q.data(), {m, n}),
                     MakeView(r.data(), {n, n})),
              IsOk());
  EXPECT_LT(OrthoError(q, m, n), kQrTol);
  EXPECT_LT(ReconstructionError(q, r, a, m, n), kQrTol);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) EXPECT_EQ(r[i * n + j], 0.0f);
  }
}

TEST_P(QrTest, CholeskyQrIsOrthonormalOnWellConditionedInput) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(m * n, 42);
  std::vector<float> q(m * n), r(n * n);
  ASSERT_THAT(CholeskyQr(*ctx, MakeView(a.data(), {m, n}), MakeView(q.data(), {m, n}),
                         MakeView(r.data(), {n, n})),
              IsOk());
  // Cholesky QR loses orthogonality like cond(A)²·u. Gaussian m×n with m >= 2n has cond < ~6
  // (Marchenko–Pastur: (1+√(n/m))/(1−√(n/m)) <= 5.8), square ones can be worse; 36·u·n·m <=
  // 1e-2 covers both shapes used here with margin, while a wrong Q gives errors of order 1.
  EXPECT_LT(OrthoError(q, m, n), m >= 2 * n ? kQrTol : 1e-2);
  EXPECT_LT(ReconstructionError(q, r, a, m, n), kQrTol);
}

TEST_P(QrTest, RandomizedCholeskyQrIsOrthonormal) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(m * n, 43);
  const int64_t s = n + 8;
  const auto sketch = RandomVector(s * m, 44, 1.0f / std::sqrt(static_cast<float>(s)));
  std::vector<float> q(m * n);
  ASSERT_THAT(RandomizedCholeskyQr(*ctx, MakeView(a.data(), {m, n}),
                                   MakeView(sketch.data(), {s, m}), MakeView(q.data(), {m, n})),
              IsOk());
  // After the sketch preconditioning P₁ is well conditioned (cond ≈ O(1)), so the Cholesky step
  // is as accurate as Householder QR: same bound as kQrTol.
  EXPECT_LT(OrthoError(q, m, n), kQrTol);
  // Q spans the columns of A: Q·(QᵀA) = A.
  const auto qta = NaiveGemm(q, a, n, n, m, true, false);
  std::vector<float> r(qta.begin(), qta.end());
  EXPECT_LT(ReconstructionError(q, r, a, m, n), kQrTol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, QrTest,
                         ::testing::Values(QrShape{50, 7}, QrShape{33, 33}, QrShape{64, 48},
                                           QrShape{9, 1}));

TEST(Qr, BatchedAndAliased) {
  auto ctx = Context::CpuDefault();
  const int64_t b = 2, m = 12, n = 5;
  auto a = RandomVector(b * m * n, 51);
  const auto a0 = a;
  ASSERT_THAT(ThinQr(*ctx, MakeView(a.data(), {b, m, n}), MakeView(a.data(), {b, m, n})), IsOk());
  std::vector<float> q1(m * n);
  ASSERT_THAT(ThinQr(*ctx, MakeView(a0.data() + m * n, {m, n}), MakeView(q1.data(), {m, n})),
              IsOk());
  for (int64_t i = 0; i < m * n; ++i) EXPECT_EQ(a[m * n + i], q1[i]);
}

TEST(Qr, RejectsBadInput) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12), q(12), r(9);
  EXPECT_THAT(ThinQr(*ctx, MakeView(a.data(), {3, 4}), MakeView(q.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("rows >= cols")));
  EXPECT_THAT(ThinQr(*ctx, MakeView(a.data(), {4, 3}), MakeView(q.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("q is")));
  EXPECT_THAT(ThinQr(*ctx, MakeView(a.data(), {4, 3}), MakeView(q.data(), {4, 3}),
                     MakeView(r.data(), {1, 9})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("r is")));
  // Rank-deficient input: Cholesky of the Gram matrix fails, reported, not aborted.
  std::vector<float> z(12, 0.0f);
  EXPECT_THAT(CholeskyQr(*ctx, MakeView(z.data(), {4, 3}), MakeView(q.data(), {4, 3})),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  std::vector<float> sk(8);
  EXPECT_THAT(RandomizedCholeskyQr(*ctx, MakeView(a.data(), {4, 3}), MakeView(sk.data(), {2, 4}),
                                   MakeView(q.data(), {4, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("sketch")));
}

}  // namespace
}  // namespace diond::kernels
