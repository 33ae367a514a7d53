// Call descriptors of the CUDA backend: pure functions that turn a row-major op of kernels/ops.h
// into the column-major arguments of the cuBLAS / cuSOLVER calls that compute it.
//
// Why: the ops API stores matrices row-major (unit column stride, any row stride, any batch
// stride), cuBLAS and cuSOLVER are column-major. Every transpose flag, m/n/k, leading dimension,
// triangle and batch stride the CUDA backend passes to a library is built here, by code that
// needs no CUDA type and no GPU. kernels/cuda/call_descriptors_test.cc executes the very same
// descriptors through CBLAS / LAPACKE in column-major mode and compares with the CPU backend for
// every shape class (tall, wide, square, batched, strided, transposed, broadcast), so a layout
// mistake fails on the CPU instead of only on a GPU. The plugin (kernels/cuda/ops_*.cu) calls the
// libraries with exactly these fields and nothing computed elsewhere.
//
// The one identity used throughout: a row-major r×c matrix with row stride ld is, byte for byte,
// the column-major c×r matrix (its transpose) with leading dimension ld.
//
// Inputs are assumed valid (the ops dispatcher validated them); nothing here allocates except
// the block list of DescribeBlockedGram.
#ifndef DIOND_KERNELS_CUDA_CALL_DESCRIPTORS_H_
#define DIOND_KERNELS_CUDA_CALL_DESCRIPTORS_H_

#include <cstdint>
#include <vector>

namespace diond::cuda_calls {

// A row-major operand as the ops see it: `batch` matrices of rows×cols, unit column stride.
// batch_stride 0 with batch 1 is a single matrix; batch_stride 0 with a batched partner is a
// matrix broadcast against every matrix of the other operands.
struct RowMajor {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements, >= cols
  int64_t batch = 1;
  int64_t batch_stride = 0;  // elements
};

// The leading dimension the libraries accept for `m`: the row stride, but never below
// max(1, cols) (a one-row view may carry any row stride).
int64_t LeadingDim(const RowMajor& m);

// Column-major library enums, spelled like BLAS.
enum class Op : uint8_t { kN, kT };
enum class Fill : uint8_t { kLower, kUpper };
enum class Side : uint8_t { kLeft, kRight };

// ---- GEMM: cublasGemmStridedBatchedEx (cublasSgemm for batch 1) ---------------------------
// C = alpha·op(A)·op(B) + beta·C in the library's column-major terms. The library's A operand is
// the ops' b tensor and the library's B operand the ops' a tensor (C_rm = A·B  ⇔
// C_rmᵀ = Bᵀ·Aᵀ, and a row-major matrix is its transpose column-major). Offsets are in elements
// from the base pointer of the tensor each operand comes from (the library A's from b's pointer).
struct GemmCall {
  Op transa = Op::kN, transb = Op::kN;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  int64_t lda = 1, ldb = 1, ldc = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // 0: the same matrix for every batch entry
  int64_t batch = 1;
  int64_t offset_a = 0, offset_b = 0, offset_c = 0;
};
// Gemm(params, a, b, c) of ops.h: op(a) m×k, op(b) k×n, c m×n (batch = c.batch; a or b with
// batch 1 are broadcast).
GemmCall DescribeGemm(bool trans_a, bool trans_b, float alpha, float beta, const RowMajor& a,
                      const RowMajor& b, const RowMajor& c);

// ---- SYRK: cublasSsyrk (looped over the batch) ---------------------------------------------
// The library writes the `uplo` triangle of the n×n column-major C; in row-major terms that is
// the LOWER triangle of c, which the backend then mirrors onto the upper one (ops.h: C exactly
// symmetric). beta != 0 reads only that triangle.
struct SyrkCall {
  Fill uplo = Fill::kUpper;
  Op trans = Op::kN;
  int64_t n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  int64_t lda = 1, ldc = 1;
  int64_t stride_a = 0, stride_c = 0;
  int64_t batch = 1;
};
// SymmetricProduct(side, alpha, a, beta, c): aat true is A·Aᵀ (n = rows), false Aᵀ·A (n = cols).
SyrkCall DescribeSymmetricProduct(bool aat, float alpha, float beta, const RowMajor& a,
                                  const RowMajor& c);

// ---- bf16 half-work Gram (ops.h SymmetricProductBf16) -------------------------------------
// One strided-batched bf16 GEMM (f32 accumulation) per lower block pair (i >= j): C_ij ← A_i·A_jᵀ.
// The backend then mirrors the lower triangle onto the upper one.
std::vector<GemmCall> DescribeBlockedGram(const RowMajor& a, int64_t block, const RowMajor& c);

// ---- transposes: cublasSgeam(T, N) --------------------------------------------------------
// out (column-major rows×cols, ld_out) ← inᵀ, where `in` is column-major cols×rows with ld_in.
struct TransposeCall {
  int64_t rows = 0, cols = 0;
  int64_t ld_in = 1, ld_out = 1;
};

// ---- triangle extraction (our own kernel) --------------------------------------------------
// dst (row-major n×n, ld_dst) ← the upper triangle of R with zeros below, where R(i, j) is read
// from src as src[i·ld_src + j] (src_col_major false) or src[j·ld_src + i] (true).
struct TriangleCopyCall {
  int64_t n = 0;
  int64_t ld_src = 1;
  bool src_col_major = false;
  int64_t ld_dst = 1;
};

// ---- Householder QR (ops.h ThinQr): cusolverDnSgeqrf + cusolverDnSorgqr, per matrix -------
// Per matrix b: (1) to_col_major: W ← A_b (W column-major m×n, ld m, a workspace);
// (2) geqrf(m, n, W, ld_w, tau); (3) if R is wanted: r_copy (W's upper triangle, column-major);
// (4) orgqr(m, n, n, W, ld_w, tau); (5) from_col_major: Q_b ← W. This is what LAPACKE's
// row-major sgeqrf/sorgqr do around the column-major LAPACK routines, so the CPU and the GPU
// factor the same column-major matrix.
struct QrPlan {
  int64_t m = 0, n = 0;
  int64_t ld_w = 1;              // workspace W: ld_w·n floats per matrix
  TransposeCall to_col_major;    // in = A_b (column-major n×m, ld lda) → W
  TransposeCall from_col_major;  // in = W (column-major m×n, ld_w) → Q_b (column-major n×m)
  TriangleCopyCall r_copy;       // W → R_b
  int64_t lda = 1, ldq = 1, ldr = 1;
  int64_t stride_a = 0, stride_q = 0, stride_r = 0;
  int64_t batch = 1;
};
QrPlan DescribeThinQr(const RowMajor& a, const RowMajor& q, const RowMajor& r);

// ---- Cholesky QR (ops.h CholeskyQr): cublasSsyrk + cusolverDnSpotrf + cublasStrsm ----------
// In place on Q (the backend copies A into Q first). Per matrix b, with G an n×n workspace:
// (1) syrk: G ← QᵀQ (column-major upper triangle); (2) potrf(upper, n, G, ld n): G = Uᵀ·U
// (what LAPACKE's row-major spotrf('U') computes on the CPU), info > 0 is FAILED_PRECONDITION
// exactly as on the CPU (one read-back of info); (3) trsm: Q ← Q·U⁻¹ (column-major
// Qᵀ ← U⁻ᵀ·Qᵀ); (4) r_copy: R = U, read column-major from G.
struct TrsmCall {
  Side side = Side::kLeft;
  Fill uplo = Fill::kLower;
  Op trans = Op::kN;
  bool unit_diag = false;
  int64_t m = 0, n = 0;
  float alpha = 1.0f;
  int64_t lda = 1, ldb = 1;
};
struct CholeskyQrPlan {
  int64_t m = 0, n = 0;
  SyrkCall gram;  // A = Q_b, C = G (batch 1: the backend loops)
  Fill potrf_uplo = Fill::kUpper;
  int64_t ld_g = 1;
  TrsmCall solve;           // A = G, B = Q_b
  TriangleCopyCall r_copy;  // G → R_b
  int64_t ldq = 1, ldr = 1;
  int64_t stride_q = 0, stride_r = 0;
  int64_t batch = 1;
};
CholeskyQrPlan DescribeCholeskyQr(const RowMajor& q, const RowMajor& r);

// ---- randomized Cholesky QR (ops.h RandomizedCholeskyQr) ----------------------------------
// Per matrix b, in place on Q (A copied into Q first), W an s×n column-major workspace (ld s):
// (1) sketch: W ← S_b·Q_b, written straight into column-major W as the row-major GEMM
//     Wᵀ(n×s) = Q_bᵀ·S_bᵀ (no transpose pass); (2) geqrf(s, n, W, ld s, tau): R₁ is W's upper
// triangle; a zero diagonal entry is FAILED_PRECONDITION as on the CPU (one read-back);
// (3) trsm: Q_b ← Q_b·R₁⁻¹ (column-major Q_bᵀ ← R₁⁻ᵀ·Q_bᵀ); (4) the Cholesky QR plan, no R.
struct RandomizedCholeskyQrPlan {
  int64_t m = 0, n = 0, s = 0;
  GemmCall sketch;  // library A = S's pointer, library B = Q's pointer, C = W (batch 1)
  int64_t ld_w = 1;
  TrsmCall solve;  // A = W, B = Q_b
  CholeskyQrPlan cholesky;
  int64_t ldq = 1, lds = 1;
  int64_t stride_q = 0, stride_s = 0;  // stride_s 0: one sketch for every matrix
  int64_t batch = 1;
};
RandomizedCholeskyQrPlan DescribeRandomizedCholeskyQr(const RowMajor& q, const RowMajor& sketch);

}  // namespace diond::cuda_calls

#endif  // DIOND_KERNELS_CUDA_CALL_DESCRIPTORS_H_
