// ThinQr, CholeskyQr and RandomizedCholeskyQr (kernels/ops.h) with LAPACKE and CBLAS.
#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/threading.h"

namespace diond::kernels::cpu {

namespace {

float* F32(TensorView v) { return static_cast<float*>(v.data()); }

int64_t Ld(const TensorLayout& l) {
  return l.Rows() <= 1 ? std::max<int64_t>(std::max<int64_t>(l.Cols(), 1), l.RowStride())
                       : l.RowStride();
}

// Copies the n×n upper triangle of src (row stride lds) to dst (row stride ldd), zeros below.
void CopyUpper(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) dst[i * ldd + j] = j >= i ? src[i * lds + j] : 0.0f;
  }
}

// LAPACK is column-major. LAPACKE's row-major wrappers transpose every matrix argument into a
// fresh column-major buffer and back, with a plain double loop, around every call; for sgeqrf +
// sorgqr that is four transposes and two allocations per matrix, a quarter to a third of
// ThinQr's time at Dion's sizes (docs/BENCHMARKS.md "LAPACK without the row-major wrappers").
// The ops instead transpose once into scratch and once back with OpenBLAS's somatcopy and call
// the column-major wrappers, which pass the same arguments to the same Fortran routines as the
// row-major wrappers do (leading dimension max(1, m), the same workspace query): the results are
// those of the row-major calls bit for bit (factorize_test checks it against them).

// t (m×n, column-major, leading dimension m) ← a (m×n, row-major, row stride lda).
void ToColMajor(const float* a, int64_t m, int64_t n, int64_t lda, float* t) {
  cblas_somatcopy(CblasRowMajor, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n), 1.0f,
                  a, static_cast<blasint>(lda), t, static_cast<blasint>(m));
}

// a (m×n, row-major, row stride lda) ← t (m×n, column-major, leading dimension m).
void FromColMajor(const float* t, int64_t m, int64_t n, float* a, int64_t lda) {
  cblas_somatcopy(CblasRowMajor, CblasTrans, static_cast<blasint>(n), static_cast<blasint>(m), 1.0f,
                  t, static_cast<blasint>(m), a, static_cast<blasint>(lda));
}

// r (n×n, row-major, ldr) ← the upper triangle of the column-major t (leading dimension ldt),
// zeros below.
void CopyUpperFromColMajor(const float* t, int64_t ldt, float* r, int64_t ldr, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) r[i * ldr + j] = j >= i ? t[j * ldt + i] : 0.0f;
  }
}

// In-place Householder QR of the m×n matrix w (row-major, ld): on return w holds Q (m×n) and,
// when r != nullptr, r (ldr) holds R. t: m·n floats of scratch (the column-major copy).
absl::Status HouseholderQrInPlace(const char* op, int64_t index, float* w, int64_t m, int64_t n,
                                  int64_t ld, float* r, int64_t ldr, float* tau, float* t) {
  ToColMajor(w, m, n, ld, t);
  lapack_int info = LAPACKE_sgeqrf(LAPACK_COL_MAJOR, static_cast<lapack_int>(m),
                                   static_cast<lapack_int>(n), t, static_cast<lapack_int>(m), tau);
  if (info != 0) {
    return absl::InternalError(
        absl::StrCat(op, ": sgeqrf failed on matrix ", index, " (info ", info, ")"));
  }
  if (r != nullptr) CopyUpperFromColMajor(t, m, r, ldr, n);
  info = LAPACKE_sorgqr(LAPACK_COL_MAJOR, static_cast<lapack_int>(m), static_cast<lapack_int>(n),
                        static_cast<lapack_int>(n), t, static_cast<lapack_int>(m), tau);
  if (info != 0) {
    return absl::InternalError(
        absl::StrCat(op, ": sorgqr failed on matrix ", index, " (info ", info, ")"));
  }
  FromColMajor(t, m, n, w, ld);
  return absl::OkStatus();
}

// q ← q·R⁻¹ where R = chol(qᵀq) (upper); R written to r (ldr) if non-null. g is n×n scratch.
// The Gram matrix is SymmetricProduct's (kAuto: the lower block triangle of oneDNN GEMMs above
// ~2·128³ multiply-adds, ssyrk below; both triangles filled): qᵀq of a 3072×768 q took 0.47 of
// ssyrk's time (docs/BENCHMARKS.md "f32 engines").
absl::Status CholeskyQrInPlace(const Context& ctx, const char* op, int64_t index, TensorView qv,
                               float* g, float* r, int64_t ldr) {
  const int64_t m = qv.Rows(), n = qv.Cols(), ldq = Ld(qv.layout());
  float* q = F32(qv);
  DIOND_RETURN_IF_ERROR(
      cpu::SymmetricProduct(ctx, GramSide::kAtA, 1.0f, qv, 0.0f, MakeView(g, {n, n})));
  // g is exactly symmetric (SymmetricProduct mirrors one triangle onto the other), so read as a
  // column-major matrix it is the transpose LAPACKE's row-major wrapper would build: spotrf's
  // upper factor lands in g's row-major lower triangle, and the mirror puts it where the
  // row-major call leaves it (bit for bit; the lower triangle is not read below).
  const lapack_int info = LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', static_cast<lapack_int>(n), g,
                                         static_cast<lapack_int>(n));
  if (info != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": matrix ", index, " (", m, "x", n,
                     ") is numerically rank-deficient: the Gram "
                     "matrix is not positive definite (spotrf info ",
                     info, ")"));
  }
  MirrorLowerToUpper(g, n, n);
  cblas_strsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit,
              static_cast<int>(m), static_cast<int>(n), 1.0f, g, static_cast<int>(n), q,
              static_cast<int>(ldq));
  if (r != nullptr) CopyUpper(g, n, r, ldr, n);
  return absl::OkStatus();
}

}  // namespace

absl::Status ThinQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  constexpr const char* kOp = "ThinQr";
  cpu::ApplyThreadPolicy(ctx);
  const int64_t m = a.Rows(), n = a.Cols();
  if (n == 0 || a.Batch() == 0) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(cpu::Copy(ctx, a, q));
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor tau, Tensor::Allocate(DType::kF32, {n}, &ctx.scratch()));
  DIOND_ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(DType::kF32, {m, n}, &ctx.scratch()));
  for (int64_t b = 0; b < a.Batch(); ++b) {
    TensorView qb = q.Matrix(b);
    float* rp = r.empty() ? nullptr : F32(r.Matrix(b));
    DIOND_RETURN_IF_ERROR(HouseholderQrInPlace(kOp, b, F32(qb), m, n, Ld(qb.layout()), rp,
                                               r.empty() ? 0 : Ld(r.layout()), tau.As<float>(),
                                               t.As<float>()));
  }
  return absl::OkStatus();
}

absl::Status CholeskyQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  constexpr const char* kOp = "CholeskyQr";
  cpu::ApplyThreadPolicy(ctx);
  const int64_t n = a.Cols();
  if (n == 0 || a.Batch() == 0) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(cpu::Copy(ctx, a, q));
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor g, Tensor::Allocate(DType::kF32, {n, n}, &ctx.scratch()));
  for (int64_t b = 0; b < a.Batch(); ++b) {
    TensorView qb = q.Matrix(b);
    float* rp = r.empty() ? nullptr : F32(r.Matrix(b));
    DIOND_RETURN_IF_ERROR(
        CholeskyQrInPlace(ctx, kOp, b, qb, g.As<float>(), rp, r.empty() ? 0 : Ld(r.layout())));
  }
  return absl::OkStatus();
}

absl::Status RandomizedCholeskyQr(const Context& ctx, ConstTensorView a, ConstTensorView sketch,
                                  TensorView q) {
  constexpr const char* kOp = "RandomizedCholeskyQr";
  const int64_t m = a.Rows(), n = a.Cols(), s = sketch.Rows();
  cpu::ApplyThreadPolicy(ctx);
  if (n == 0 || a.Batch() == 0) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(cpu::Copy(ctx, a, q));
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor sa, Tensor::Allocate(DType::kF32, {s, n}, &ctx.scratch()));
  DIOND_ASSIGN_OR_RETURN(Tensor r1, Tensor::Allocate(DType::kF32, {n, n}, &ctx.scratch()));
  DIOND_ASSIGN_OR_RETURN(Tensor g, Tensor::Allocate(DType::kF32, {n, n}, &ctx.scratch()));
  DIOND_ASSIGN_OR_RETURN(Tensor tau, Tensor::Allocate(DType::kF32, {n}, &ctx.scratch()));
  DIOND_ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(DType::kF32, {s, n}, &ctx.scratch()));
  for (int64_t b = 0; b < a.Batch(); ++b) {
    TensorView qb = q.Matrix(b);
    ConstTensorView sb = sketch.Matrix(sketch.Batch() == 1 ? 0 : b);
    const int64_t ldq = Ld(qb.layout());
    // S·A (kAuto: oneDNN at Dion's sizes, 1.7x OpenBLAS's sgemm on this machine). The op then
    // runs LAPACK on OpenBLAS's pool: one pool at a time, in sequence (context.h policy).
    DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, GemmParams{}, sb, qb, MakeView(sa.As<float>(), {s, n})));
    ToColMajor(sa.As<float>(), s, n, n, t.As<float>());
    const lapack_int info =
        LAPACKE_sgeqrf(LAPACK_COL_MAJOR, static_cast<lapack_int>(s), static_cast<lapack_int>(n),
                       t.As<float>(), static_cast<lapack_int>(s), tau.As<float>());
    if (info != 0) {
      return absl::InternalError(
          absl::StrCat(kOp, ": sgeqrf failed on matrix ", b, " (info ", info, ")"));
    }
    CopyUpperFromColMajor(t.As<float>(), s, r1.As<float>(), n, n);
    // A zero diagonal entry of R₁ means S·A is rank-deficient; trsm would divide by zero.
    for (int64_t i = 0; i < n; ++i) {
      if (r1.As<float>()[i * n + i] == 0.0f) {
        return absl::FailedPreconditionError(absl::StrCat(
            kOp, ": matrix ", b, " (", m, "x", n, ") is rank-deficient (R1[", i, ",", i, "] = 0)"));
      }
    }
    cblas_strsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit,
                static_cast<int>(m), static_cast<int>(n), 1.0f, r1.As<float>(), static_cast<int>(n),
                F32(qb), static_cast<int>(ldq));
    DIOND_RETURN_IF_ERROR(CholeskyQrInPlace(ctx, kOp, b, qb, g.As<float>(), nullptr, 0));
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
