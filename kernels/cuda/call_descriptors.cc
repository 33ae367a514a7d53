// The call descriptors of the CUDA backend (call_descriptors.h): row-major ops → column-major
// cuBLAS / cuSOLVER arguments. Pure arithmetic on shapes; compiled into the plugin and into the
// CPU test that executes the same descriptors through CBLAS / LAPACKE.
#include "kernels/cuda/call_descriptors.h"

#include <algorithm>

namespace diond::cuda_calls {
namespace {

// Batch stride of an operand inside a call over `batch` matrices: 0 broadcasts one matrix.
int64_t BatchStride(const RowMajor& m) { return m.batch <= 1 ? 0 : m.batch_stride; }

RowMajor Single(const RowMajor& m) {
  RowMajor s = m;
  s.batch = 1;
  s.batch_stride = 0;
  return s;
}

}  // namespace

int64_t LeadingDim(const RowMajor& m) {
  const int64_t cols = std::max<int64_t>(m.cols, 1);
  return m.rows <= 1 ? std::max(m.row_stride, cols) : m.row_stride;
}

GemmCall DescribeGemm(bool trans_a, bool trans_b, float alpha, float beta, const RowMajor& a,
                      const RowMajor& b, const RowMajor& c) {
  // C = op(a)·op(b) row-major  ⇔  Cᵀ = op(b)ᵀ·op(a)ᵀ column-major, where each row-major buffer
  // already is its own transpose column-major: so the library multiplies b's buffer by a's, with
  // each operand's transpose flag unchanged.
  GemmCall g;
  g.transa = trans_b ? Op::kT : Op::kN;
  g.transb = trans_a ? Op::kT : Op::kN;
  g.m = c.cols;
  g.n = c.rows;
  g.k = trans_a ? a.rows : a.cols;
  g.alpha = alpha;
  g.beta = beta;
  g.lda = LeadingDim(b);
  g.ldb = LeadingDim(a);
  g.ldc = LeadingDim(c);
  g.batch = c.batch;
  g.stride_a = BatchStride(b);
  g.stride_b = BatchStride(a);
  g.stride_c = BatchStride(c);
  return g;
}

SyrkCall DescribeSymmetricProduct(bool aat, float alpha, float beta, const RowMajor& a,
                                  const RowMajor& c) {
  // a's buffer is X = aᵀ column-major (cols×rows). A·Aᵀ = XᵀX (trans T), AᵀA = XXᵀ (trans N).
  // The row-major lower triangle of c is the column-major upper one.
  SyrkCall s;
  s.uplo = Fill::kUpper;
  s.trans = aat ? Op::kT : Op::kN;
  s.n = aat ? a.rows : a.cols;
  s.k = aat ? a.cols : a.rows;
  s.alpha = alpha;
  s.beta = beta;
  s.lda = LeadingDim(a);
  s.ldc = LeadingDim(c);
  s.batch = c.batch;
  s.stride_a = BatchStride(a);
  s.stride_c = BatchStride(c);
  return s;
}

std::vector<GemmCall> DescribeBlockedGram(const RowMajor& a, int64_t block, const RowMajor& c) {
  std::vector<GemmCall> calls;
  const int64_t n = a.rows;
  if (block < 1) block = 1;
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t ri = std::min(block, n - i0);
    for (int64_t j0 = 0; j0 <= i0; j0 += block) {
      const int64_t rj = std::min(block, n - j0);
      RowMajor ai = a, aj = a, cij = c;
      ai.rows = ri;
      aj.rows = rj;
      cij.rows = ri;
      cij.cols = rj;
      GemmCall g = DescribeGemm(false, true, 1.0f, 0.0f, ai, aj, cij);
      g.offset_a = j0 * a.row_stride;  // library A is the b operand: rows j0.. of a
      g.offset_b = i0 * a.row_stride;  // library B is the a operand: rows i0.. of a
      g.offset_c = i0 * c.row_stride + j0;
      calls.push_back(g);
    }
  }
  return calls;
}

QrPlan DescribeThinQr(const RowMajor& a, const RowMajor& q, const RowMajor& r) {
  QrPlan p;
  p.m = a.rows;
  p.n = a.cols;
  p.ld_w = std::max<int64_t>(1, a.rows);
  p.lda = LeadingDim(a);
  p.ldq = LeadingDim(q);
  p.ldr = r.rows > 0 ? LeadingDim(r) : 1;
  // a's buffer is column-major n×m; W = its transpose, column-major m×n.
  p.to_col_major = TransposeCall{p.m, p.n, p.lda, p.ld_w};
  // Q's buffer is column-major n×m = Wᵀ.
  p.from_col_major = TransposeCall{p.n, p.m, p.ld_w, p.ldq};
  p.r_copy = TriangleCopyCall{p.n, p.ld_w, /*src_col_major=*/true, p.ldr};
  p.batch = a.batch;
  p.stride_a = BatchStride(a);
  p.stride_q = BatchStride(q);
  p.stride_r = r.rows > 0 ? BatchStride(r) : 0;
  return p;
}

CholeskyQrPlan DescribeCholeskyQr(const RowMajor& q, const RowMajor& r) {
  CholeskyQrPlan p;
  p.m = q.rows;
  p.n = q.cols;
  p.ld_g = std::max<int64_t>(1, p.n);
  const RowMajor g{p.n, p.n, p.ld_g, 1, 0};
  p.gram = DescribeSymmetricProduct(/*aat=*/false, 1.0f, 0.0f, Single(q), g);
  p.potrf_uplo = p.gram.uplo;  // the triangle syrk wrote
  p.ldq = LeadingDim(q);
  p.ldr = r.rows > 0 ? LeadingDim(r) : 1;
  // Q (row-major m×n) ← Q·U⁻¹  ⇔  Qᵀ (column-major n×m) ← U⁻ᵀ·Qᵀ.
  p.solve = TrsmCall{Side::kLeft, Fill::kUpper, Op::kT, false, p.n, p.m, 1.0f, p.ld_g, p.ldq};
  p.r_copy = TriangleCopyCall{p.n, p.ld_g, /*src_col_major=*/true, p.ldr};
  p.batch = q.batch;
  p.stride_q = BatchStride(q);
  p.stride_r = r.rows > 0 ? BatchStride(r) : 0;
  return p;
}

RandomizedCholeskyQrPlan DescribeRandomizedCholeskyQr(const RowMajor& q, const RowMajor& sketch) {
  RandomizedCholeskyQrPlan p;
  p.m = q.rows;
  p.n = q.cols;
  p.s = sketch.rows;
  p.ld_w = std::max<int64_t>(1, p.s);
  // W (column-major s×n) is the row-major n×s matrix Wᵀ = Qᵀ·Sᵀ.
  const RowMajor wt{p.n, p.s, p.ld_w, 1, 0};
  p.sketch =
      DescribeGemm(/*trans_a=*/true, /*trans_b=*/true, 1.0f, 0.0f, Single(q), Single(sketch), wt);
  p.ldq = LeadingDim(q);
  p.lds = LeadingDim(sketch);
  // Q ← Q·R₁⁻¹ with R₁ the upper triangle of column-major W (ld s).
  p.solve = TrsmCall{Side::kLeft, Fill::kUpper, Op::kT, false, p.n, p.m, 1.0f, p.ld_w, p.ldq};
  p.cholesky = DescribeCholeskyQr(q, RowMajor{});
  p.batch = q.batch;
  p.stride_q = BatchStride(q);
  p.stride_s = BatchStride(sketch);
  return p;
}

}  // namespace diond::cuda_calls
