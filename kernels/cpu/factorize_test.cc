// Tests of ThinQr, CholeskyQr and RandomizedCholeskyQr: orthonormal Q, Q·R = A, and the same
// bits as LAPACKE's row-major wrappers (the ops call the column-major routines on their own
// transposed copies).
#include <cblas.h>
#include <lapacke.h>

#include <cmath>
#include <cstring>
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

// RandomizedCholeskyQr of a random m×n matrix (seed) with an (n + 8)×m sketch (seed + 1):
// fills *a, *sketch and returns Q.
std::vector<float> RunRandomizedCholeskyQr(const Context& ctx, int64_t m, int64_t n, uint32_t seed,
                                           std::vector<float>* a, std::vector<float>* sketch) {
  *a = RandomVector(m * n, seed);
  const int64_t s = n + 8;
  *sketch = RandomVector(s * m, seed + 1, 1.0f / std::sqrt(static_cast<float>(s)));
  std::vector<float> q(m * n);
  EXPECT_THAT(RandomizedCholeskyQr(ctx, MakeView(a->data(), {m, n}),
                                   MakeView(sketch->data(), {s, m}), MakeView(q.data(), {m, n})),
              IsOk());
  return q;
}

TEST_P(QrTest, RandomizedCholeskyQrIsOrthonormal) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  std::vector<float> a, sketch;
  const std::vector<float> q = RunRandomizedCholeskyQr(*ctx, m, n, 43, &a, &sketch);
  ASSERT_FALSE(::testing::Test::HasFailure());
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

// The ops call LAPACK column-major on transposed copies (factorize.cc); the reference here is
// the straightforward row-major call through LAPACKE's wrappers, bit for bit.
class QrBitsTest : public ::testing::TestWithParam<QrShape> {};

TEST_P(QrBitsTest, ThinQrIsBitForBitTheRowMajorLapackeCall) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(m * n, 61);
  // Through a row stride wider than the matrix, as the rules' views can have.
  const int64_t ld = n + 3;
  std::vector<float> padded(m * ld, -7.0f);
  for (int64_t i = 0; i < m; ++i) std::memcpy(&padded[i * ld], &a[i * n], n * sizeof(float));
  std::vector<float> q(m * ld, -7.0f), r(n * n, 9.0f);
  ASSERT_THAT(ThinQr(*ctx, ConstTensorView(MakeView(padded.data(), {m, ld})).ColRange(0, n),
                     MakeView(q.data(), {m, ld}).ColRange(0, n), MakeView(r.data(), {n, n})),
              IsOk());

  std::vector<float> want = a, tau(n), want_r(n * n, 0.0f);
  ASSERT_EQ(LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, m, n, want.data(), n, tau.data()), 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) want_r[i * n + j] = want[i * n + j];
  }
  ASSERT_EQ(LAPACKE_sorgqr(LAPACK_ROW_MAJOR, m, n, n, want.data(), n, tau.data()), 0);
  for (int64_t i = 0; i < m; ++i) {
    ASSERT_EQ(std::memcmp(&q[i * ld], &want[i * n], n * sizeof(float)), 0) << "Q row " << i;
    for (int64_t j = n; j < ld; ++j) ASSERT_EQ(q[i * ld + j], -7.0f) << "wrote past the row";
  }
  EXPECT_EQ(std::memcmp(r.data(), want_r.data(), r.size() * sizeof(float)), 0) << "R";
}

// Cholesky QR as it was computed before: the Gram matrix from the op, LAPACKE's row-major
// spotrf, then the row-major triangular solve.
void RowMajorCholeskyQr(const Context& ctx, std::vector<float>& q, int64_t m, int64_t n,
                        std::vector<float>* r) {
  std::vector<float> g(n * n);
  ASSERT_THAT(SymmetricProduct(ctx, GramSide::kAtA, 1.0f, MakeView(q.data(), {m, n}), 0.0f,
                               MakeView(g.data(), {n, n})),
              IsOk());
  ASSERT_EQ(LAPACKE_spotrf(LAPACK_ROW_MAJOR, 'U', n, g.data(), n), 0);
  cblas_strsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, m, n, 1.0f,
              g.data(), n, q.data(), n);
  if (r != nullptr) {
    r->assign(n * n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = i; j < n; ++j) (*r)[i * n + j] = g[i * n + j];
    }
  }
}

TEST_P(QrBitsTest, CholeskyQrIsBitForBitTheRowMajorLapackeCall) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(m * n, 62);
  std::vector<float> q(m * n), r(n * n);
  ASSERT_THAT(CholeskyQr(*ctx, MakeView(a.data(), {m, n}), MakeView(q.data(), {m, n}),
                         MakeView(r.data(), {n, n})),
              IsOk());
  std::vector<float> want = a, want_r;
  RowMajorCholeskyQr(*ctx, want, m, n, &want_r);
  EXPECT_EQ(std::memcmp(q.data(), want.data(), q.size() * sizeof(float)), 0) << "Q";
  EXPECT_EQ(std::memcmp(r.data(), want_r.data(), r.size() * sizeof(float)), 0) << "R";
}

TEST_P(QrBitsTest, RandomizedCholeskyQrIsBitForBitTheRowMajorLapackeCalls) {
  const auto [m, n] = GetParam();
  auto ctx = Context::CpuDefault();
  std::vector<float> a, sketch;
  const std::vector<float> q = RunRandomizedCholeskyQr(*ctx, m, n, 63, &a, &sketch);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const int64_t s = n + 8;
  // S·A by the op, R₁ from LAPACKE's row-major sgeqrf, A·R₁⁻¹, then Cholesky QR as above.
  std::vector<float> sa(s * n), tau(n), r1(n * n, 0.0f), want = a;
  ASSERT_THAT(Gemm(*ctx, GemmParams{}, MakeView(sketch.data(), {s, m}), MakeView(a.data(), {m, n}),
                   MakeView(sa.data(), {s, n})),
              IsOk());
  ASSERT_EQ(LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, s, n, sa.data(), n, tau.data()), 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) r1[i * n + j] = sa[i * n + j];
  }
  cblas_strsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, m, n, 1.0f,
              r1.data(), n, want.data(), n);
  RowMajorCholeskyQr(*ctx, want, m, n, nullptr);
  EXPECT_EQ(std::memcmp(q.data(), want.data(), q.size() * sizeof(float)), 0);
}

// Square, tall, thin, odd sizes, and Dion's own (768², 3072×192) at sizes where LAPACK blocks.
INSTANTIATE_TEST_SUITE_P(Shapes, QrBitsTest,
                         ::testing::Values(QrShape{50, 7}, QrShape{33, 33}, QrShape{200, 64},
                                           QrShape{257, 100}, QrShape{9, 1}, QrShape{768, 192},
                                           QrShape{300, 300}));

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
