// GEMM, symmetric products and factorizations of the CUDA backend: cuBLAS and cuSOLVER called
// with exactly the fields of the call descriptors (kernels/cuda/call_descriptors.h), which the
// CPU test call_descriptors_test executes through CBLAS / LAPACKE column-major.
//
// fp32: CUBLAS_COMPUTE_32F in CUBLAS_DEFAULT_MATH (no TF32). bf16 inputs: tensor-core GEMMs with
// fp32 accumulation (CUBLAS_COMPUTE_32F), C f32, or bf16 rounded once from the f32 value.
// Factorizations read back one small array per op (potrf's info, R₁'s zero diagonals) to
// report FAILED_PRECONDITION exactly like the CPU: one sync point per CholeskyQr /
// RandomizedCholeskyQr call, none for ThinQr.
#include <vector>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {
namespace {

using cuda_calls::Fill;
using cuda_calls::GemmCall;
using cuda_calls::Op;

cublasOperation_t CuOp(Op op) { return op == Op::kT ? CUBLAS_OP_T : CUBLAS_OP_N; }
cublasFillMode_t CuFill(Fill f) {
  return f == Fill::kUpper ? CUBLAS_FILL_MODE_UPPER : CUBLAS_FILL_MODE_LOWER;
}
cudaDataType_t CuType(int dtype) {
  return dtype == DIOND_DT_F32 ? CUDA_R_32F : (dtype == DIOND_DT_BF16 ? CUDA_R_16BF : CUDA_R_16F);
}
int I(int64_t v) { return static_cast<int>(v); }

const char* At(const void* p, int64_t elements, int dtype) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(DtypeBytes(dtype));
}

// One descriptor through cublasGemmStridedBatchedEx. lib_a / lib_b are the tensors the
// descriptor names as the library's A and B (the ops' b and a).
int RunGemm(const DiondOpsCall* call, const char* op, cublasHandle_t h, const GemmCall& g,
            const void* lib_a, int a_type, const void* lib_b, int b_type, void* c, int c_type) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return DIOND_OPS_OK;
  DIOND_CUBLAS(op, cublasGemmStridedBatchedEx(
                       h, CuOp(g.transa), CuOp(g.transb), I(g.m), I(g.n), I(g.k), &g.alpha,
                       At(lib_a, g.offset_a, a_type), CuType(a_type), I(g.lda), g.stride_a,
                       At(lib_b, g.offset_b, b_type), CuType(b_type), I(g.ldb), g.stride_b, &g.beta,
                       const_cast<char*>(At(c, g.offset_c, c_type)), CuType(c_type), I(g.ldc),
                       g.stride_c, I(g.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return DIOND_OPS_OK;
}

// The row-major lower triangle of each n×n matrix mirrored onto the upper one. T: float, or
// uint16_t for bf16 (the bits are copied).
template <typename T>
int MirrorLower(const DiondOpsCall* call, const char* op, T* c, int64_t n, int64_t ldc,
                int64_t batch, int64_t stride) {
  return Launch(call, op, batch * n * n, [=] __device__(int64_t e) {
    const int64_t j = e % n, r = e / n, i = r % n, b = r / n;
    if (j > i) c[b * stride + i * ldc + j] = c[b * stride + j * ldc + i];
  });
}

int TriangleCopy(const DiondOpsCall* call, const char* op, const cuda_calls::TriangleCopyCall& t,
                 const float* src, float* dst) {
  const cuda_calls::TriangleCopyCall tc = t;
  return Launch(call, op, t.n * t.n, [=] __device__(int64_t e) {
    const int64_t i = e / tc.n, j = e % tc.n;
    const float v = tc.src_col_major ? src[j * tc.ld_src + i] : src[i * tc.ld_src + j];
    dst[i * tc.ld_dst + j] = j >= i ? v : 0.0f;
  });
}

int Transpose(const DiondOpsCall* call, const char* op, cublasHandle_t h,
              const cuda_calls::TransposeCall& t, const float* in, float* out) {
  const float one = 1.0f, zero = 0.0f;
  DIOND_CUBLAS(op, cublasSgeam(h, CUBLAS_OP_T, CUBLAS_OP_N, I(t.rows), I(t.cols), &one, in,
                               I(t.ld_in), &zero, out, I(t.ld_out), out, I(t.ld_out)));
  return DIOND_OPS_OK;
}

int Trsm(const DiondOpsCall* call, const char* op, cublasHandle_t h, const cuda_calls::TrsmCall& t,
         const float* a, float* b) {
  DIOND_CUBLAS(
      op, cublasStrsm(h, t.side == cuda_calls::Side::kLeft ? CUBLAS_SIDE_LEFT : CUBLAS_SIDE_RIGHT,
                      CuFill(t.uplo), CuOp(t.trans),
                      t.unit_diag ? CUBLAS_DIAG_UNIT : CUBLAS_DIAG_NON_UNIT, I(t.m), I(t.n),
                      &t.alpha, a, I(t.lda), b, I(t.ldb)));
  return DIOND_OPS_OK;
}

// The Cholesky QR plan on matrix b of q (G: ld_g·n floats, work: potrf workspace, info: one int).
int CholeskyMatrix(const DiondOpsCall* call, const char* op, cublasHandle_t blas,
                   cusolverDnHandle_t solver, const cuda_calls::CholeskyQrPlan& p, float* qb,
                   float* rb, float* g, float* work, int lwork, int* info) {
  const float one = 1.0f, zero = 0.0f;
  DIOND_CUBLAS(op, cublasSsyrk(blas, CuFill(p.gram.uplo), CuOp(p.gram.trans), I(p.gram.n),
                               I(p.gram.k), &one, qb, I(p.gram.lda), &zero, g, I(p.gram.ldc)));
  DIOND_CUSOLVER(
      op, cusolverDnSpotrf(solver, CuFill(p.potrf_uplo), I(p.n), g, I(p.ld_g), work, lwork, info));
  DIOND_RC(Trsm(call, op, blas, p.solve, g, qb));
  if (rb != nullptr) DIOND_RC(TriangleCopy(call, op, p.r_copy, g, rb));
  return DIOND_OPS_OK;
}

int CopyInto(const DiondOpsCall* call, DiondIn a, DiondOut q) {
  return OpCopy(call, a, q);  // A → Q (a no-op when q aliases a)
}

}  // namespace

int OpGemm(const DiondOpsCall* call, const DiondGemmArgs* args, DiondIn a, DiondIn b, DiondOut c) {
  constexpr const char* kOp = "Gemm";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t h;
  DIOND_RC(Blas(call, kOp, &h));
  cuda_calls::RowMajor ra = AsRowMajor(*a), rb = AsRowMajor(*b), rc = AsRowMajor(*c);
  const GemmCall g = cuda_calls::DescribeGemm(args->trans_a != 0, args->trans_b != 0, args->alpha,
                                              args->beta, ra, rb, rc);
  return RunGemm(call, kOp, h, g, b->data, b->dtype, a->data, a->dtype, c->data, c->dtype);
}

int OpSymmetricProduct(const DiondOpsCall* call, int32_t aat, float alpha, DiondIn a, float beta,
                       DiondOut c) {
  constexpr const char* kOp = "SymmetricProduct";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t h;
  DIOND_RC(Blas(call, kOp, &h));
  const cuda_calls::SyrkCall s =
      cuda_calls::DescribeSymmetricProduct(aat != 0, alpha, beta, AsRowMajor(*a), AsRowMajor(*c));
  if (s.n == 0) return DIOND_OPS_OK;
  const float* ap = static_cast<const float*>(a->data);
  float* cp = static_cast<float*>(c->data);
  for (int64_t i = 0; i < s.batch; ++i) {
    DIOND_CUBLAS(
        kOp, cublasSsyrk(h, CuFill(s.uplo), CuOp(s.trans), I(s.n), I(s.k), &s.alpha,
                         ap + i * s.stride_a, I(s.lda), &s.beta, cp + i * s.stride_c, I(s.ldc)));
  }
  return MirrorLower(call, kOp, cp, s.n, s.ldc, s.batch, s.stride_c);
}

int OpSymmetricProductBf16(const DiondOpsCall* call, DiondIn a, int64_t block, DiondOut c) {
  constexpr const char* kOp = "SymmetricProductBf16";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t h;
  DIOND_RC(Blas(call, kOp, &h));
  const cuda_calls::RowMajor ra = AsRowMajor(*a), rc = AsRowMajor(*c);
  if (ra.rows == 0 || rc.batch == 0) return DIOND_OPS_OK;
  for (const GemmCall& g : cuda_calls::DescribeBlockedGram(ra, block, rc)) {
    DIOND_RC(RunGemm(call, kOp, h, g, a->data, a->dtype, a->data, a->dtype, c->data, c->dtype));
  }
  const int64_t stride = rc.batch <= 1 ? 0 : rc.batch_stride;
  if (c->dtype == DIOND_DT_BF16) {  // each f32 sum rounded once to bf16 by cuBLAS
    return MirrorLower(call, kOp, static_cast<uint16_t*>(c->data), ra.rows, rc.row_stride, rc.batch,
                       stride);
  }
  return MirrorLower(call, kOp, static_cast<float*>(c->data), ra.rows, rc.row_stride, rc.batch,
                     stride);
}

int OpThinQr(const DiondOpsCall* call, DiondIn a, DiondOut q, DiondOut r) {
  constexpr const char* kOp = "ThinQr";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t blas;
  cusolverDnHandle_t solver;
  DIOND_RC(Blas(call, kOp, &blas));
  DIOND_RC(Solver(call, kOp, &solver));
  const bool want_r = !Absent(r);
  const cuda_calls::QrPlan p = cuda_calls::DescribeThinQr(
      AsRowMajor(*a), AsRowMajor(*q), want_r ? AsRowMajor(*r) : cuda_calls::RowMajor{});
  if (p.n == 0 || p.batch == 0) return DIOND_OPS_OK;
  Scratch w, tau, info, work;
  DIOND_RC(w.Allocate(call, kOp, static_cast<size_t>(p.ld_w * p.n) * 4));
  DIOND_RC(tau.Allocate(call, kOp, static_cast<size_t>(p.n) * 4));
  DIOND_RC(info.Allocate(call, kOp, sizeof(int)));
  int lwork_qr = 0, lwork_q = 0;
  DIOND_CUSOLVER(kOp, cusolverDnSgeqrf_bufferSize(solver, I(p.m), I(p.n), w.As<float>(), I(p.ld_w),
                                                  &lwork_qr));
  DIOND_CUSOLVER(kOp, cusolverDnSorgqr_bufferSize(solver, I(p.m), I(p.n), I(p.n), w.As<float>(),
                                                  I(p.ld_w), tau.As<float>(), &lwork_q));
  const int lwork = lwork_qr > lwork_q ? lwork_qr : lwork_q;
  DIOND_RC(work.Allocate(call, kOp, static_cast<size_t>(lwork) * 4));
  const float* ap = static_cast<const float*>(a->data);
  float* qp = static_cast<float*>(q->data);
  float* rp = want_r ? static_cast<float*>(r->data) : nullptr;
  for (int64_t b = 0; b < p.batch; ++b) {
    DIOND_RC(Transpose(call, kOp, blas, p.to_col_major, ap + b * p.stride_a, w.As<float>()));
    DIOND_CUSOLVER(kOp, cusolverDnSgeqrf(solver, I(p.m), I(p.n), w.As<float>(), I(p.ld_w),
                                         tau.As<float>(), work.As<float>(), lwork, info.As<int>()));
    if (rp != nullptr) {
      DIOND_RC(TriangleCopy(call, kOp, p.r_copy, w.As<float>(), rp + b * p.stride_r));
    }
    DIOND_CUSOLVER(kOp, cusolverDnSorgqr(solver, I(p.m), I(p.n), I(p.n), w.As<float>(), I(p.ld_w),
                                         tau.As<float>(), work.As<float>(), lwork, info.As<int>()));
    DIOND_RC(Transpose(call, kOp, blas, p.from_col_major, w.As<float>(), qp + b * p.stride_q));
  }
  // geqrf/orgqr report only invalid arguments in info (never data-dependent failures), and the
  // descriptors are tested: no read-back, no sync point.
  return DIOND_OPS_OK;
}

int OpCholeskyQr(const DiondOpsCall* call, DiondIn a, DiondOut q, DiondOut r) {
  constexpr const char* kOp = "CholeskyQr";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t blas;
  cusolverDnHandle_t solver;
  DIOND_RC(Blas(call, kOp, &blas));
  DIOND_RC(Solver(call, kOp, &solver));
  const bool want_r = !Absent(r);
  const cuda_calls::CholeskyQrPlan p = cuda_calls::DescribeCholeskyQr(
      AsRowMajor(*q), want_r ? AsRowMajor(*r) : cuda_calls::RowMajor{});
  if (p.n == 0 || p.batch == 0) return DIOND_OPS_OK;
  DIOND_RC(CopyInto(call, a, q));
  Scratch g, info, work;
  DIOND_RC(g.Allocate(call, kOp, static_cast<size_t>(p.ld_g * p.n) * 4));
  DIOND_RC(info.Allocate(call, kOp, static_cast<size_t>(p.batch) * sizeof(int)));
  int lwork = 0;
  DIOND_CUSOLVER(kOp, cusolverDnSpotrf_bufferSize(solver, CuFill(p.potrf_uplo), I(p.n),
                                                  g.As<float>(), I(p.ld_g), &lwork));
  DIOND_RC(work.Allocate(call, kOp, static_cast<size_t>(lwork) * 4));
  float* qp = static_cast<float*>(q->data);
  float* rp = want_r ? static_cast<float*>(r->data) : nullptr;
  for (int64_t b = 0; b < p.batch; ++b) {
    DIOND_RC(CholeskyMatrix(call, kOp, blas, solver, p, qp + b * p.stride_q,
                            rp ? rp + b * p.stride_r : nullptr, g.As<float>(), work.As<float>(),
                            lwork, info.As<int>() + b));
  }
  std::vector<int> h(static_cast<size_t>(p.batch));
  DIOND_CU(kOp, cudaMemcpyAsync(h.data(), info.As<int>(), h.size() * sizeof(int),
                                cudaMemcpyDeviceToHost, StreamOf(call)));
  DIOND_RC(Sync(call, kOp));  // sync point: potrf's info decides FAILED_PRECONDITION
  for (int64_t b = 0; b < p.batch; ++b) {
    if (h[b] != 0) {
      return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                  "CholeskyQr: matrix %lld (%lldx%lld) is numerically rank-deficient: the Gram "
                  "matrix is not positive definite (potrf info %d)",
                  static_cast<long long>(b), static_cast<long long>(p.m),
                  static_cast<long long>(p.n), h[b]);
    }
  }
  return DIOND_OPS_OK;
}

int OpRandomizedCholeskyQr(const DiondOpsCall* call, DiondIn a, DiondIn sketch, DiondOut q) {
  constexpr const char* kOp = "RandomizedCholeskyQr";
  DIOND_RC(UseDevice(call, kOp));
  cublasHandle_t blas;
  cusolverDnHandle_t solver;
  DIOND_RC(Blas(call, kOp, &blas));
  DIOND_RC(Solver(call, kOp, &solver));
  const cuda_calls::RandomizedCholeskyQrPlan p =
      cuda_calls::DescribeRandomizedCholeskyQr(AsRowMajor(*q), AsRowMajor(*sketch));
  if (p.n == 0 || p.batch == 0) return DIOND_OPS_OK;
  DIOND_RC(CopyInto(call, a, q));
  Scratch w, tau, g, info, work;
  DIOND_RC(w.Allocate(call, kOp, static_cast<size_t>(p.ld_w * p.n) * 4));
  DIOND_RC(tau.Allocate(call, kOp, static_cast<size_t>(p.n) * 4));
  DIOND_RC(g.Allocate(call, kOp, static_cast<size_t>(p.cholesky.ld_g * p.n) * 4));
  // Per matrix: [0] geqrf info (unused), [1] first zero diagonal of R₁ + 1, [2] potrf info.
  DIOND_RC(info.Allocate(call, kOp, static_cast<size_t>(p.batch) * 3 * sizeof(int)));
  DIOND_CU(kOp, cudaMemsetAsync(info.As<int>(), 0, static_cast<size_t>(p.batch) * 3 * sizeof(int),
                                StreamOf(call)));
  int lwork_qr = 0, lwork_chol = 0;
  DIOND_CUSOLVER(kOp, cusolverDnSgeqrf_bufferSize(solver, I(p.s), I(p.n), w.As<float>(), I(p.ld_w),
                                                  &lwork_qr));
  DIOND_CUSOLVER(kOp, cusolverDnSpotrf_bufferSize(solver, CuFill(p.cholesky.potrf_uplo), I(p.n),
                                                  g.As<float>(), I(p.cholesky.ld_g), &lwork_chol));
  const int lwork = lwork_qr > lwork_chol ? lwork_qr : lwork_chol;
  DIOND_RC(work.Allocate(call, kOp, static_cast<size_t>(lwork) * 4));
  float* qp = static_cast<float*>(q->data);
  const float* sp = static_cast<const float*>(sketch->data);
  for (int64_t b = 0; b < p.batch; ++b) {
    float* qb = qp + b * p.stride_q;
    int* ib = info.As<int>() + 3 * b;
    DIOND_RC(RunGemm(call, kOp, blas, p.sketch, sp + b * p.stride_s, DIOND_DT_F32, qb, DIOND_DT_F32,
                     w.As<float>(), DIOND_DT_F32));
    DIOND_CUSOLVER(kOp, cusolverDnSgeqrf(solver, I(p.s), I(p.n), w.As<float>(), I(p.ld_w),
                                         tau.As<float>(), work.As<float>(), lwork, ib));
    const float* wp = w.As<float>();
    const int64_t n = p.n, ldw = p.ld_w;
    DIOND_RC(Launch(call, kOp, 1, [=] __device__(int64_t) {
      for (int64_t i = 0; i < n; ++i) {
        if (wp[i * ldw + i] == 0.0f) {
          ib[1] = static_cast<int>(i) + 1;
          return;
        }
      }
    }));
    DIOND_RC(Trsm(call, kOp, blas, p.solve, w.As<float>(), qb));
    DIOND_RC(CholeskyMatrix(call, kOp, blas, solver, p.cholesky, qb, nullptr, g.As<float>(),
                            work.As<float>(), lwork, ib + 2));
  }
  std::vector<int> h(static_cast<size_t>(p.batch) * 3);
  DIOND_CU(kOp, cudaMemcpyAsync(h.data(), info.As<int>(), h.size() * sizeof(int),
                                cudaMemcpyDeviceToHost, StreamOf(call)));
  DIOND_RC(Sync(call, kOp));  // sync point: the checks decide FAILED_PRECONDITION
  for (int64_t b = 0; b < p.batch; ++b) {
    if (h[3 * b + 1] != 0) {
      const long long i = h[3 * b + 1] - 1;
      return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                  "RandomizedCholeskyQr: matrix %lld (%lldx%lld) is rank-deficient (R1[%lld,%lld] "
                  "= 0)",
                  static_cast<long long>(b), static_cast<long long>(p.m),
                  static_cast<long long>(p.n), i, i);
    }
    if (h[3 * b + 2] != 0) {
      return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                  "RandomizedCholeskyQr: matrix %lld (%lldx%lld) is numerically rank-deficient: "
                  "the Gram matrix is not positive definite (potrf info %d)",
                  static_cast<long long>(b), static_cast<long long>(p.m),
                  static_cast<long long>(p.n), h[3 * b + 2]);
    }
  }
  return DIOND_OPS_OK;
}

}  // namespace diond::cuda
