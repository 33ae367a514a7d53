// The CUDA backend's call descriptors (call_descriptors.h), executed on the CPU: every descriptor
// is run through CBLAS / LAPACKE in COLUMN-MAJOR mode, with exactly the fields the plugin passes
// to cuBLAS / cuSOLVER, and the result is compared with the CPU backend (row-major ops of
// kernels/ops.h) on the same inputs. Shape classes: tall, wide, square, batched, strided (row and
// batch padding), transposed, broadcast, one-row views. A wrong transpose flag, m/n/k, leading
// dimension, triangle or batch stride gives O(1) errors here, far above the tolerances (which
// only absorb a different summation order between the two calls).
//
// Padding elements between rows and matrices hold a sentinel that both paths must leave alone.
#include "kernels/cuda/call_descriptors.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/engine_choice.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using cuda_calls::Fill;
using cuda_calls::GemmCall;
using cuda_calls::Op;
using cuda_calls::RowMajor;
using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

constexpr float kSentinel = 12345.0f;

// A strided row-major stack of matrices in host memory, padding filled with the sentinel.
struct Mat {
  RowMajor shape;
  bool rank3 = false;
  std::vector<float> data;

  static Mat Make(int64_t batch, int64_t rows, int64_t cols, int64_t row_pad, int64_t batch_pad,
                  uint32_t seed, bool rank3) {
    Mat m;
    m.rank3 = rank3 || batch > 1;
    m.shape.rows = rows;
    m.shape.cols = cols;
    m.shape.row_stride = cols + row_pad;
    m.shape.batch = batch;
    m.shape.batch_stride = rows * m.shape.row_stride + batch_pad;
    m.data.assign(static_cast<size_t>(batch * m.shape.batch_stride + 1), kSentinel);
    const auto v = testing::RandomVector(batch * rows * cols, seed);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) m.at(b, i, j) = v[(b * rows + i) * cols + j];
      }
    }
    return m;
  }
  float& at(int64_t b, int64_t i, int64_t j) {
    return data[b * shape.batch_stride + i * shape.row_stride + j];
  }
  float at(int64_t b, int64_t i, int64_t j) const {
    return data[b * shape.batch_stride + i * shape.row_stride + j];
  }
  TensorLayout Layout() const {
    TensorLayout l;
    l.dtype = DType::kF32;
    if (rank3) {
      l.rank = 3;
      l.dims[0] = shape.batch;
      l.dims[1] = shape.rows;
      l.dims[2] = shape.cols;
      l.strides[0] = shape.batch_stride;
      l.strides[1] = shape.row_stride;
      l.strides[2] = 1;
    } else {
      l.rank = 2;
      l.dims[0] = shape.rows;
      l.dims[1] = shape.cols;
      l.strides[0] = shape.row_stride;
      l.strides[1] = 1;
    }
    return l;
  }
  TensorView view() { return TensorView(data.data(), Layout()); }
  ConstTensorView cview() const { return ConstTensorView(data.data(), Layout()); }
  // The RowMajor the backend derives from this view (a rank-2 operand has batch 1).
  RowMajor rm() const { return shape; }
};

bool IsSentinelPadding(const Mat& m) {
  std::vector<bool> logical(m.data.size(), false);
  for (int64_t b = 0; b < m.shape.batch; ++b) {
    for (int64_t i = 0; i < m.shape.rows; ++i) {
      for (int64_t j = 0; j < m.shape.cols; ++j) {
        logical[b * m.shape.batch_stride + i * m.shape.row_stride + j] = true;
      }
    }
  }
  for (size_t i = 0; i < m.data.size(); ++i) {
    if (!logical[i] && m.data[i] != kSentinel) return false;
  }
  return true;
}

double MaxDiff(const Mat& x, const Mat& y) {
  double e = 0.0;
  for (int64_t b = 0; b < x.shape.batch; ++b) {
    for (int64_t i = 0; i < x.shape.rows; ++i) {
      for (int64_t j = 0; j < x.shape.cols; ++j) {
        e = std::max(e, std::fabs(static_cast<double>(x.at(b, i, j)) - y.at(b, i, j)));
      }
    }
  }
  return e;
}

// ---- column-major executors of the descriptors (what the plugin does with cuBLAS/cuSOLVER) ---

CBLAS_TRANSPOSE T(Op op) { return op == Op::kT ? CblasTrans : CblasNoTrans; }
CBLAS_UPLO U(Fill f) { return f == Fill::kUpper ? CblasUpper : CblasLower; }
char UChar(Fill f) { return f == Fill::kUpper ? 'U' : 'L'; }

// cublasGemmStridedBatchedEx(transa, transb, m, n, k, alpha, A+offset_a, lda, stride_a, B+..., C)
void RunGemm(const GemmCall& g, const float* lib_a, const float* lib_b, float* c) {
  for (int64_t i = 0; i < g.batch; ++i) {
    cblas_sgemm(CblasColMajor, T(g.transa), T(g.transb), static_cast<int>(g.m),
                static_cast<int>(g.n), static_cast<int>(g.k), g.alpha,
                lib_a + g.offset_a + i * g.stride_a, static_cast<int>(g.lda),
                lib_b + g.offset_b + i * g.stride_b, static_cast<int>(g.ldb), g.beta,
                c + g.offset_c + i * g.stride_c, static_cast<int>(g.ldc));
  }
}

// Mirrors the row-major lower triangle onto the upper one (the backend's mirror kernel).
void MirrorRowMajorLower(float* c, int64_t n, int64_t ldc) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) c[j * ldc + i] = c[i * ldc + j];
  }
}

void RunSyrk(const cuda_calls::SyrkCall& s, const float* a, float* c) {
  for (int64_t i = 0; i < s.batch; ++i) {
    float* ci = c + i * s.stride_c;
    cblas_ssyrk(CblasColMajor, U(s.uplo), T(s.trans), static_cast<int>(s.n), static_cast<int>(s.k),
                s.alpha, a + i * s.stride_a, static_cast<int>(s.lda), s.beta, ci,
                static_cast<int>(s.ldc));
    MirrorRowMajorLower(ci, s.n, s.ldc);
  }
}

// cublasSgeam(T, N, rows, cols, 1, in, ld_in, 0, -, -, out, ld_out)
void RunTranspose(const cuda_calls::TransposeCall& t, const float* in, float* out) {
  cblas_somatcopy(CblasColMajor, CblasTrans, static_cast<int>(t.cols), static_cast<int>(t.rows),
                  1.0f, in, static_cast<int>(t.ld_in), out, static_cast<int>(t.ld_out));
}

void RunTriangleCopy(const cuda_calls::TriangleCopyCall& t, const float* src, float* dst) {
  for (int64_t i = 0; i < t.n; ++i) {
    for (int64_t j = 0; j < t.n; ++j) {
      const float v = t.src_col_major ? src[j * t.ld_src + i] : src[i * t.ld_src + j];
      dst[i * t.ld_dst + j] = j >= i ? v : 0.0f;
    }
  }
}

void RunTrsm(const cuda_calls::TrsmCall& t, const float* a, float* b) {
  cblas_strsm(CblasColMajor, t.side == cuda_calls::Side::kLeft ? CblasLeft : CblasRight, U(t.uplo),
              T(t.trans), t.unit_diag ? CblasUnit : CblasNonUnit, static_cast<int>(t.m),
              static_cast<int>(t.n), t.alpha, a, static_cast<int>(t.lda), b,
              static_cast<int>(t.ldb));
}

// Copies the logical elements of a into q (the backend's Copy before an in-place plan).
void CopyLogical(const Mat& a, Mat* q) {
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    for (int64_t i = 0; i < a.shape.rows; ++i) {
      for (int64_t j = 0; j < a.shape.cols; ++j) q->at(b, i, j) = a.at(b, i, j);
    }
  }
}

// The Cholesky QR plan on matrix b of q; returns potrf's info (> 0: not positive definite).
int RunCholeskyQrMatrix(const cuda_calls::CholeskyQrPlan& p, int64_t b, float* q, float* r) {
  std::vector<float> g(static_cast<size_t>(p.ld_g * p.n), kSentinel);
  float* qb = q + b * p.stride_q;
  cblas_ssyrk(CblasColMajor, U(p.gram.uplo), T(p.gram.trans), static_cast<int>(p.gram.n),
              static_cast<int>(p.gram.k), 1.0f, qb, static_cast<int>(p.gram.lda), 0.0f, g.data(),
              static_cast<int>(p.gram.ldc));
  const int info =
      LAPACKE_spotrf(LAPACK_COL_MAJOR, UChar(p.potrf_uplo), static_cast<lapack_int>(p.n), g.data(),
                     static_cast<lapack_int>(p.ld_g));
  if (info != 0) return info;
  RunTrsm(p.solve, g.data(), qb);
  if (r != nullptr) RunTriangleCopy(p.r_copy, g.data(), r + b * p.stride_r);
  return 0;
}

// ================================ GEMM ========================================================

struct GemmCase {
  const char* name;
  int64_t m, n, k;
  bool ta, tb;
  int64_t batch;  // of C
  bool a_batched, b_batched;
  int64_t row_pad, batch_pad;
};

class DescriptorGemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(DescriptorGemmTest, ColumnMajorCallMatchesCpuBackend) {
  const GemmCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const int64_t ar = c.ta ? c.k : c.m, ac = c.ta ? c.m : c.k;
  const int64_t br = c.tb ? c.n : c.k, bc = c.tb ? c.k : c.n;
  const Mat a = Mat::Make(c.a_batched ? c.batch : 1, ar, ac, c.row_pad, c.batch_pad, 1, false);
  const Mat b = Mat::Make(c.b_batched ? c.batch : 1, br, bc, c.row_pad + 1, c.batch_pad, 2, false);
  Mat want = Mat::Make(c.batch, c.m, c.n, c.row_pad + 2, c.batch_pad, 3, c.batch > 1);
  Mat got = want;

  GemmParams p;
  p.trans_a = c.ta ? Trans::kYes : Trans::kNo;
  p.trans_b = c.tb ? Trans::kYes : Trans::kNo;
  p.alpha = 0.75f;
  p.beta = -0.5f;
  ASSERT_THAT(Gemm(*ctx, p, a.cview(), b.cview(), want.view()), IsOk());

  const GemmCall g =
      cuda_calls::DescribeGemm(c.ta, c.tb, p.alpha, p.beta, a.rm(), b.rm(), got.rm());
  EXPECT_EQ(g.batch, c.batch);
  EXPECT_EQ(g.stride_a == 0, !c.b_batched || c.batch == 1) << "library A comes from b";
  RunGemm(g, b.data.data(), a.data.data(), got.data.data());

  EXPECT_LE(MaxDiff(got, want), 1e-5 * std::sqrt(static_cast<double>(c.k) + 1.0)) << c.name;
  EXPECT_TRUE(IsSentinelPadding(got)) << c.name << ": the call wrote outside C";
}

INSTANTIATE_TEST_SUITE_P(
    ShapeClasses, DescriptorGemmTest,
    ::testing::Values(GemmCase{"tall", 96, 8, 16, false, false, 1, false, false, 0, 0},
                      GemmCase{"wide", 8, 96, 16, false, false, 1, false, false, 0, 0},
                      GemmCase{"square", 33, 33, 33, false, false, 1, false, false, 0, 0},
                      GemmCase{"trans_a", 40, 24, 17, true, false, 1, false, false, 0, 0},
                      GemmCase{"trans_b", 24, 40, 17, false, true, 1, false, false, 0, 0},
                      GemmCase{"trans_ab", 19, 23, 29, true, true, 1, false, false, 0, 0},
                      GemmCase{"strided", 21, 13, 11, false, false, 1, false, false, 5, 0},
                      GemmCase{"strided_trans_ab", 21, 13, 11, true, true, 1, false, false, 3, 0},
                      GemmCase{"one_row", 1, 31, 9, false, false, 1, false, false, 4, 0},
                      GemmCase{"one_col", 31, 1, 9, false, true, 1, false, false, 4, 0},
                      GemmCase{"batched", 12, 10, 8, false, false, 3, true, true, 0, 0},
                      GemmCase{"batched_strided", 12, 10, 8, true, false, 4, true, true, 3, 7},
                      GemmCase{"broadcast_a", 9, 14, 6, false, true, 3, false, true, 2, 5},
                      GemmCase{"broadcast_b", 14, 9, 6, true, false, 3, true, false, 1, 3},
                      GemmCase{"megabatch_tall", 64, 4, 32, false, true, 5, true, true, 0, 0}),
    [](const ::testing::TestParamInfo<GemmCase>& i) { return std::string(i.param.name); });

// ============================= symmetric products =============================================

struct SyrkCase {
  const char* name;
  bool aat;
  int64_t batch, rows, cols, row_pad, batch_pad;
  float beta;
};
class DescriptorSyrkTest : public ::testing::TestWithParam<SyrkCase> {};

TEST_P(DescriptorSyrkTest, ColumnMajorSyrkMatchesCpuBackend) {
  const SyrkCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const Mat a = Mat::Make(c.batch, c.rows, c.cols, c.row_pad, c.batch_pad, 4, c.batch > 1);
  const int64_t n = c.aat ? c.rows : c.cols;
  Mat want = Mat::Make(c.batch, n, n, c.row_pad + 1, c.batch_pad, 5, c.batch > 1);
  Mat got = want;
  const float alpha = 1.25f;
  ASSERT_THAT(SymmetricProduct(*ctx, c.aat ? GramSide::kAAt : GramSide::kAtA, alpha, a.cview(),
                               c.beta, want.view()),
              IsOk());
  RunSyrk(cuda_calls::DescribeSymmetricProduct(c.aat, alpha, c.beta, a.rm(), got.rm()),
          a.data.data(), got.data.data());
  const int64_t k = c.aat ? c.cols : c.rows;
  EXPECT_LE(MaxDiff(got, want), 1e-5 * std::sqrt(static_cast<double>(k) + 1.0)) << c.name;
  EXPECT_TRUE(IsSentinelPadding(got)) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    ShapeClasses, DescriptorSyrkTest,
    ::testing::Values(SyrkCase{"aat_wide", true, 1, 12, 70, 0, 0, 0.0f},
                      SyrkCase{"ata_tall", false, 1, 70, 12, 0, 0, 0.0f},
                      SyrkCase{"aat_tall", true, 1, 30, 7, 3, 0, 0.5f},
                      SyrkCase{"ata_square_beta", false, 1, 17, 17, 2, 0, -1.0f},
                      SyrkCase{"batched_strided_aat", true, 3, 9, 20, 4, 11, 0.0f},
                      SyrkCase{"batched_strided_ata", false, 3, 20, 9, 1, 5, 2.0f}),
    [](const ::testing::TestParamInfo<SyrkCase>& i) { return std::string(i.param.name); });

// bf16 half-work Gram: the block list, run as f32 GEMMs on the widened bf16 inputs (products of
// bf16 values are exact in f32, so only the summation order differs from oneDNN's).
struct BlockCase {
  int64_t batch, rows, cols, block;
};
class DescriptorBlockedGramTest : public ::testing::TestWithParam<BlockCase> {};

TEST_P(DescriptorBlockedGramTest, BlockGemmsMatchCpuBackend) {
  if (!CpuHasOneDnnBf16Matmul())
    GTEST_SKIP() << "oneDNN 2.6 has no bf16 matmul on this CPU (no AVX-512 core)";
  const BlockCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const int64_t row_stride = c.cols + 3, batch_stride = c.rows * row_stride + 5;
  std::vector<BFloat16> a16(static_cast<size_t>(c.batch * batch_stride), FloatToBf16(0.0f));
  std::vector<float> a32(a16.size(), 0.0f);
  const auto v = testing::RandomVector(c.batch * c.rows * c.cols, 6);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.rows; ++i) {
      for (int64_t j = 0; j < c.cols; ++j) {
        const size_t at = static_cast<size_t>(b * batch_stride + i * row_stride + j);
        a16[at] = FloatToBf16(v[(b * c.rows + i) * c.cols + j]);
        a32[at] = Bf16ToFloat(a16[at]);
      }
    }
  }
  TensorLayout al;
  al.dtype = DType::kBf16;
  al.rank = 3;
  al.dims[0] = c.batch;
  al.dims[1] = c.rows;
  al.dims[2] = c.cols;
  al.strides[0] = batch_stride;
  al.strides[1] = row_stride;
  al.strides[2] = 1;
  Mat want = Mat::Make(c.batch, c.rows, c.rows, 2, 3, 7, true);
  Mat got = want;
  ASSERT_THAT(SymmetricProductBf16(*ctx, ConstTensorView(a16.data(), al), c.block, want.view()),
              IsOk());
  const RowMajor arm{c.rows, c.cols, row_stride, c.batch, batch_stride};
  const auto calls = cuda_calls::DescribeBlockedGram(arm, c.block, got.rm());
  const int64_t nb = (c.rows + c.block - 1) / c.block;
  EXPECT_EQ(static_cast<int64_t>(calls.size()), nb * (nb + 1) / 2) << "lower block pairs only";
  for (const GemmCall& g : calls) RunGemm(g, a32.data(), a32.data(), got.data.data());
  for (int64_t b = 0; b < c.batch; ++b) {
    MirrorRowMajorLower(&got.at(b, 0, 0), c.rows, got.shape.row_stride);
  }
  EXPECT_LE(MaxDiff(got, want), 1e-4 * std::sqrt(static_cast<double>(c.cols)));
  EXPECT_TRUE(IsSentinelPadding(got));
}

INSTANTIATE_TEST_SUITE_P(Blocks, DescriptorBlockedGramTest,
                         ::testing::Values(BlockCase{1, 20, 33, 1}, BlockCase{2, 20, 33, 3},
                                           BlockCase{3, 21, 8, 7}, BlockCase{1, 16, 40, 16},
                                           BlockCase{2, 9, 50, 64}));

// ============================= factorizations =================================================

struct QrCase {
  const char* name;
  int64_t batch, m, n, row_pad, batch_pad;
  bool with_r;
};
class DescriptorQrTest : public ::testing::TestWithParam<QrCase> {};

TEST_P(DescriptorQrTest, GeqrfOrgqrPlanMatchesCpuBackend) {
  const QrCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const Mat a = Mat::Make(c.batch, c.m, c.n, c.row_pad, c.batch_pad, 8, c.batch > 1);
  Mat q_want = Mat::Make(c.batch, c.m, c.n, c.row_pad + 1, c.batch_pad, 9, c.batch > 1);
  Mat r_want = Mat::Make(c.batch, c.n, c.n, 1, 2, 10, c.batch > 1);
  Mat q_got = q_want, r_got = r_want;
  ASSERT_THAT(ThinQr(*ctx, a.cview(), q_want.view(), c.with_r ? r_want.view() : TensorView()),
              IsOk());

  const cuda_calls::QrPlan p =
      cuda_calls::DescribeThinQr(a.rm(), q_got.rm(), c.with_r ? r_got.rm() : RowMajor{});
  std::vector<float> w(static_cast<size_t>(p.ld_w * p.n)), tau(static_cast<size_t>(p.n));
  for (int64_t b = 0; b < p.batch; ++b) {
    RunTranspose(p.to_col_major, a.data.data() + b * p.stride_a, w.data());
    ASSERT_EQ(
        LAPACKE_sgeqrf(LAPACK_COL_MAJOR, static_cast<lapack_int>(p.m), static_cast<lapack_int>(p.n),
                       w.data(), static_cast<lapack_int>(p.ld_w), tau.data()),
        0);
    if (c.with_r) RunTriangleCopy(p.r_copy, w.data(), r_got.data.data() + b * p.stride_r);
    ASSERT_EQ(LAPACKE_sorgqr(LAPACK_COL_MAJOR, static_cast<lapack_int>(p.m),
                             static_cast<lapack_int>(p.n), static_cast<lapack_int>(p.n), w.data(),
                             static_cast<lapack_int>(p.ld_w), tau.data()),
              0);
    RunTranspose(p.from_col_major, w.data(), q_got.data.data() + b * p.stride_q);
  }
  EXPECT_LE(MaxDiff(q_got, q_want), 1e-5) << c.name;
  EXPECT_TRUE(IsSentinelPadding(q_got)) << c.name;
  if (c.with_r) {
    EXPECT_LE(MaxDiff(r_got, r_want), 1e-4) << c.name;
    EXPECT_TRUE(IsSentinelPadding(r_got)) << c.name;
  } else {
    EXPECT_EQ(r_got.data, r_want.data) << "R not requested: untouched";
  }
}

INSTANTIATE_TEST_SUITE_P(ShapeClasses, DescriptorQrTest,
                         ::testing::Values(QrCase{"tall", 1, 60, 8, 0, 0, true},
                                           QrCase{"square", 1, 13, 13, 0, 0, true},
                                           QrCase{"strided", 1, 30, 7, 5, 0, true},
                                           QrCase{"no_r", 1, 30, 7, 0, 0, false},
                                           QrCase{"batched_strided", 3, 25, 6, 2, 9, true},
                                           QrCase{"one_column", 2, 17, 1, 3, 1, true}),
                         [](const ::testing::TestParamInfo<QrCase>& i) {
                           return std::string(i.param.name);
                         });

class DescriptorCholeskyQrTest : public ::testing::TestWithParam<QrCase> {};

TEST_P(DescriptorCholeskyQrTest, SyrkPotrfTrsmPlanMatchesCpuBackend) {
  const QrCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const Mat a = Mat::Make(c.batch, c.m, c.n, c.row_pad, c.batch_pad, 11, c.batch > 1);
  Mat q_want = Mat::Make(c.batch, c.m, c.n, c.row_pad + 1, c.batch_pad, 12, c.batch > 1);
  Mat r_want = Mat::Make(c.batch, c.n, c.n, 2, 1, 13, c.batch > 1);
  Mat q_got = q_want, r_got = r_want;
  ASSERT_THAT(CholeskyQr(*ctx, a.cview(), q_want.view(), c.with_r ? r_want.view() : TensorView()),
              IsOk());
  const cuda_calls::CholeskyQrPlan p =
      cuda_calls::DescribeCholeskyQr(q_got.rm(), c.with_r ? r_got.rm() : RowMajor{});
  CopyLogical(a, &q_got);
  for (int64_t b = 0; b < p.batch; ++b) {
    ASSERT_EQ(RunCholeskyQrMatrix(p, b, q_got.data.data(), c.with_r ? r_got.data.data() : nullptr),
              0);
  }
  EXPECT_LE(MaxDiff(q_got, q_want), 1e-4) << c.name;
  EXPECT_TRUE(IsSentinelPadding(q_got)) << c.name;
  if (c.with_r) {
    EXPECT_LE(MaxDiff(r_got, r_want), 1e-4) << c.name;
    EXPECT_TRUE(IsSentinelPadding(r_got)) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(ShapeClasses, DescriptorCholeskyQrTest,
                         ::testing::Values(QrCase{"tall", 1, 80, 6, 0, 0, true},
                                           QrCase{"square", 1, 9, 9, 0, 0, true},
                                           QrCase{"strided_no_r", 1, 40, 5, 3, 0, false},
                                           QrCase{"batched_strided", 3, 30, 4, 2, 7, true}),
                         [](const ::testing::TestParamInfo<QrCase>& i) {
                           return std::string(i.param.name);
                         });

// The fallback rule: a rank-deficient matrix fails potrf on both paths (the CPU's
// FAILED_PRECONDITION is what the plugin reports when cusolver's info > 0).
TEST(DescriptorCholeskyQr, RankDeficientFailsOnBothPaths) {
  auto ctx = Context::CpuDefault(1);
  Mat a = Mat::Make(1, 20, 4, 0, 0, 14, false);
  for (int64_t i = 0; i < 20; ++i) a.at(0, i, 3) = 0.0f;  // a zero column
  Mat q_want = a, q_got = a;
  EXPECT_THAT(CholeskyQr(*ctx, a.cview(), q_want.view()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  const auto p = cuda_calls::DescribeCholeskyQr(q_got.rm(), RowMajor{});
  EXPECT_GT(RunCholeskyQrMatrix(p, 0, q_got.data.data(), nullptr), 0);
}

struct RcqrCase {
  const char* name;
  int64_t batch, m, n, s;
  bool batched_sketch;
  int64_t row_pad;
};
class DescriptorRandomizedCholeskyQrTest : public ::testing::TestWithParam<RcqrCase> {};

TEST_P(DescriptorRandomizedCholeskyQrTest, PlanMatchesCpuBackend) {
  const RcqrCase c = GetParam();
  auto ctx = Context::CpuDefault(1);
  const Mat a = Mat::Make(c.batch, c.m, c.n, c.row_pad, 1, 15, c.batch > 1);
  const Mat s =
      Mat::Make(c.batched_sketch ? c.batch : 1, c.s, c.m, c.row_pad + 2, 3, 16, c.batched_sketch);
  Mat q_want = Mat::Make(c.batch, c.m, c.n, c.row_pad, 4, 17, c.batch > 1);
  Mat q_got = q_want;
  ASSERT_THAT(RandomizedCholeskyQr(*ctx, a.cview(), s.cview(), q_want.view()), IsOk());

  const auto p = cuda_calls::DescribeRandomizedCholeskyQr(q_got.rm(), s.rm());
  EXPECT_EQ(p.stride_s == 0, !c.batched_sketch);
  CopyLogical(a, &q_got);
  std::vector<float> w(static_cast<size_t>(p.ld_w * p.n)), tau(static_cast<size_t>(p.n));
  for (int64_t b = 0; b < p.batch; ++b) {
    float* qb = q_got.data.data() + b * p.stride_q;
    RunGemm(p.sketch, s.data.data() + b * p.stride_s, qb, w.data());
    ASSERT_EQ(
        LAPACKE_sgeqrf(LAPACK_COL_MAJOR, static_cast<lapack_int>(p.s), static_cast<lapack_int>(p.n),
                       w.data(), static_cast<lapack_int>(p.ld_w), tau.data()),
        0);
    RunTrsm(p.solve, w.data(), qb);
    ASSERT_EQ(RunCholeskyQrMatrix(p.cholesky, b, q_got.data.data(), nullptr), 0);
  }
  EXPECT_LE(MaxDiff(q_got, q_want), 1e-4) << c.name;
  EXPECT_TRUE(IsSentinelPadding(q_got)) << c.name;
}

INSTANTIATE_TEST_SUITE_P(ShapeClasses, DescriptorRandomizedCholeskyQrTest,
                         ::testing::Values(RcqrCase{"tall", 1, 64, 6, 12, false, 0},
                                           RcqrCase{"strided", 1, 50, 5, 9, false, 3},
                                           RcqrCase{"batched_shared_sketch", 3, 40, 4, 8, false, 1},
                                           RcqrCase{"batched_sketch", 2, 40, 4, 8, true, 2}),
                         [](const ::testing::TestParamInfo<RcqrCase>& i) {
                           return std::string(i.param.name);
                         });

// A property of the descriptors alone: the library never sees a leading dimension below its
// minimum (cuBLAS rejects those with CUBLAS_STATUS_INVALID_VALUE), one-row views included.
TEST(DescriptorGemm, LeadingDimensionsMeetLibraryMinimums) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (int64_t m : {1, 5}) {
        for (int64_t n : {1, 6}) {
          for (int64_t k : {1, 3}) {
            // A one-row view may carry any row stride (here 1); others have row_stride == cols.
            auto make = [](int64_t rows, int64_t cols) {
              return RowMajor{rows, cols, rows <= 1 ? 1 : cols, 1, 0};
            };
            const RowMajor a = make(ta ? k : m, ta ? m : k), b = make(tb ? n : k, tb ? k : n);
            const RowMajor c = make(m, n);
            const GemmCall g = cuda_calls::DescribeGemm(ta, tb, 1, 0, a, b, c);
            EXPECT_GE(g.lda, std::max<int64_t>(1, g.transa == Op::kN ? g.m : g.k));
            EXPECT_GE(g.ldb, std::max<int64_t>(1, g.transb == Op::kN ? g.k : g.n));
            EXPECT_GE(g.ldc, std::max<int64_t>(1, g.m));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace diond::kernels
