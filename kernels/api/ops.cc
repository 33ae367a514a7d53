// The dispatcher of kernels/ops.h: every public op validates its arguments here, once, with the
// checks that do not depend on the device (kernels/backend.h), then calls the Context's backend.
// No arithmetic happens in this file.
#include "kernels/ops.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "kernels/api/validate.h"
#include "kernels/backend.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels {

// ================================ GEMM ========================================================

absl::Status Gemm(const Context& ctx, const GemmParams& p, ConstTensorView a, ConstTensorView b,
                  TensorView c) {
  constexpr const char* kOp = "Gemm";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "b", b));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "c", c));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", p.alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", p.beta));
  const bool ta = p.trans_a == Trans::kYes, tb = p.trans_b == Trans::kYes;
  const int64_t m = ta ? a.Cols() : a.Rows(), ka = ta ? a.Rows() : a.Cols();
  const int64_t kb = tb ? b.Cols() : b.Rows(), n = tb ? b.Rows() : b.Cols();
  if (ka != kb) {
    return Invalid(kOp, "inner dims differ: op(a) is ", m, "x", ka, " (a ", a.DebugString(),
                   "), op(b) is ", kb, "x", n, " (b ", b.DebugString(), ")");
  }
  if (c.Rows() != m || c.Cols() != n) {
    return Invalid(kOp, "c is ", c.DebugString(), ", want [", m, ", ", n, "]");
  }
  const int64_t batch = c.Batch();
  if (a.Batch() != 1 && a.Batch() != batch) {
    return Invalid(kOp, "a has batch ", a.Batch(), ", c has batch ", batch);
  }
  if (b.Batch() != 1 && b.Batch() != batch) {
    return Invalid(kOp, "b has batch ", b.Batch(), ", c has batch ", batch);
  }
  const bool f32 = a.dtype() == DType::kF32 && b.dtype() == DType::kF32 && c.dtype() == DType::kF32;
  const bool bf16 = a.dtype() == DType::kBf16 && b.dtype() == DType::kBf16 &&
                    (c.dtype() == DType::kF32 || c.dtype() == DType::kBf16);
  if (!f32 && !bf16) {
    return Invalid(kOp, "unsupported dtypes a ", DTypeName(a.dtype()), ", b ", DTypeName(b.dtype()),
                   ", c ", DTypeName(c.dtype()), " (want f32,f32->f32 or bf16,bf16->f32|bf16)");
  }
  return ctx.backend().gemm(ctx, p, a, b, c);
}

absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c) {
  constexpr const char* kOp = "SymmetricProduct";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "c", c));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "a", a.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "c", c.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", beta));
  if (side != GramSide::kAAt && side != GramSide::kAtA) {
    return Invalid(kOp, "unknown side ", static_cast<int>(side));
  }
  const bool aat = side == GramSide::kAAt;
  const int64_t n = aat ? a.Rows() : a.Cols();
  if (c.Rows() != n || c.Cols() != n) {
    return Invalid(kOp, "c is ", c.DebugString(), ", want [", n, ", ", n, "]");
  }
  if (a.Batch() != c.Batch()) {
    return Invalid(kOp, "a has batch ", a.Batch(), ", c has batch ", c.Batch());
  }
  return ctx.backend().symmetric_product(ctx, side, alpha, a, beta, c);
}

absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c) {
  constexpr const char* kOp = "SymmetricProductBf16";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "c", c));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "a", a.layout(), DType::kBf16));
  if (c.dtype() != DType::kF32 && c.dtype() != DType::kBf16) {
    return Invalid(kOp, "c has dtype ", DTypeName(c.dtype()), ", want f32 or bf16");
  }
  if (block < 1) return Invalid(kOp, "block is ", block, ", want >= 1");
  if (c.Rows() != a.Rows() || c.Cols() != a.Rows()) {
    return Invalid(kOp, "c is ", c.DebugString(), ", want [", a.Rows(), ", ", a.Rows(), "]");
  }
  if (a.Batch() != c.Batch()) {
    return Invalid(kOp, "a has batch ", a.Batch(), ", c has batch ", c.Batch());
  }
  return ctx.backend().symmetric_product_bf16(ctx, a, block, c);
}

// ============================= factorizations =================================================

absl::Status ThinQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  DIOND_RETURN_IF_ERROR(CheckQrArgs(ctx, "ThinQr", a, q, r));
  return ctx.backend().thin_qr(ctx, a, q, r);
}

absl::Status CholeskyQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  DIOND_RETURN_IF_ERROR(CheckQrArgs(ctx, "CholeskyQr", a, q, r));
  return ctx.backend().cholesky_qr(ctx, a, q, r);
}

absl::Status RandomizedCholeskyQr(const Context& ctx, ConstTensorView a, ConstTensorView sketch,
                                  TensorView q) {
  constexpr const char* kOp = "RandomizedCholeskyQr";
  DIOND_RETURN_IF_ERROR(CheckQrArgs(ctx, kOp, a, q, TensorView()));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "sketch", sketch));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "sketch", sketch.layout(), DType::kF32));
  const int64_t m = a.Rows(), n = a.Cols(), s = sketch.Rows();
  if (sketch.Cols() != m || s < n) {
    return Invalid(kOp, "sketch is ", sketch.DebugString(), ", want [s, ", m, "] with s >= ", n);
  }
  if (sketch.Batch() != 1 && sketch.Batch() != a.Batch()) {
    return Invalid(kOp, "sketch has batch ", sketch.Batch(), ", a has batch ", a.Batch());
  }
  return ctx.backend().randomized_cholesky_qr(ctx, a, sketch, q);
}

// ============================= reductions =====================================================

absl::Status FrobeniusNorm(const Context& ctx, ConstTensorView a, TensorView out) {
  constexpr const char* kOp = "FrobeniusNorm";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a, /*allow_vector=*/true));
  DIOND_RETURN_IF_ERROR(CheckF32Out(ctx, kOp, out, a.Batch()));
  return ctx.backend().frobenius_norm(ctx, a, out);
}

absl::Status AxisNorms(const Context& ctx, ConstTensorView a, Axis axis, NormType type,
                       TensorView out) {
  constexpr const char* kOp = "AxisNorms";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a, /*allow_vector=*/true));
  DIOND_RETURN_IF_ERROR(CheckAxis(kOp, axis));
  if (type != NormType::kL1 && type != NormType::kL2 && type != NormType::kSumOfSquares) {
    return Invalid(kOp, "unknown norm type ", static_cast<int>(type));
  }
  const int64_t per = axis == Axis::kRows ? a.Rows() : a.Cols();
  DIOND_RETURN_IF_ERROR(CheckF32Out(ctx, kOp, out, a.Batch() * per));
  return ctx.backend().axis_norms(ctx, a, axis, type, out);
}

absl::Status TopKByL1Norm(const Context& ctx, ConstTensorView a, Axis axis, int64_t k,
                          absl::Span<int64_t> indices, TensorView scores_out) {
  constexpr const char* kOp = "TopKByL1Norm";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a));
  if (a.rank() != 2) return Invalid(kOp, "a is ", a.DebugString(), ", want one matrix (rank 2)");
  DIOND_RETURN_IF_ERROR(CheckAxis(kOp, axis));
  const int64_t n = axis == Axis::kRows ? a.Rows() : a.Cols();
  if (!scores_out.empty()) DIOND_RETURN_IF_ERROR(CheckF32Out(ctx, kOp, scores_out, n));
  DIOND_RETURN_IF_ERROR(CheckTopKCount(kOp, n, k, indices.size()));
  return ctx.backend().top_k_by_l1_norm(ctx, a, axis, k, indices, scores_out);
}

absl::Status IsAllZero(const Context& ctx, ConstTensorView a, bool* all_zero) {
  constexpr const char* kOp = "IsAllZero";
  DIOND_RETURN_IF_ERROR(CheckView(ctx, kOp, "a", a));
  if (all_zero == nullptr) return Invalid(kOp, "all_zero is null");
  return ctx.backend().is_all_zero(ctx, a, all_zero);
}

// ========================== gather / scatter ==================================================

absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out) {
  DIOND_RETURN_IF_ERROR(CheckSlices(ctx, "Gather", a, "a", out, "out", axis, indices, false));
  return ctx.backend().gather(ctx, a, axis, indices, out);
}

absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst) {
  constexpr const char* kOp = "Scatter";
  DIOND_RETURN_IF_ERROR(CheckSlices(ctx, kOp, dst, "dst", src, "src", axis, indices, true));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", beta));
  return ctx.backend().scatter(ctx, src, axis, indices, alpha, beta, dst);
}

// ============================== elementwise ===================================================

absl::Status Copy(const Context& ctx, ConstTensorView src, TensorView dst) {
  constexpr const char* kOp = "Copy";
  DIOND_RETURN_IF_ERROR(CheckView(ctx, kOp, "src", src));
  DIOND_RETURN_IF_ERROR(CheckView(ctx, kOp, "dst", dst));
  if (!SameShape(src.layout(), dst.layout())) {
    return Invalid(kOp, "dst is ", dst.DebugString(), ", want the shape of src ",
                   src.DebugString());
  }
  return ctx.backend().copy(ctx, src, dst);
}

absl::Status Fill(const Context& ctx, float value, TensorView dst) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, "Fill", "dst", dst));
  return ctx.backend().fill(ctx, value, dst);
}

absl::Status Axpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                   ConstTensorView y, TensorView out) {
  constexpr const char* kOp = "Axpby";
  DIOND_RETURN_IF_ERROR(CheckSameShapeContiguous(ctx, kOp, x, "x", out));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", beta));
  if (beta != 0.0f) {
    DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "y", y));
    if (!SameShape(x.layout(), y.layout())) {
      return Invalid(kOp, "y is ", y.DebugString(), ", want the shape of x ", x.DebugString());
    }
  }
  return ctx.backend().axpby(ctx, alpha, x, beta, y, out);
}

absl::Status Scale(const Context& ctx, float alpha, ConstTensorView x, TensorView out) {
  return Axpby(ctx, alpha, x, 0.0f, ConstTensorView(), out);
}

absl::Status AddScalar(const Context& ctx, float alpha, ConstTensorView x, float beta,
                       TensorView out) {
  constexpr const char* kOp = "AddScalar";
  DIOND_RETURN_IF_ERROR(CheckSameShapeContiguous(ctx, kOp, x, "x", out));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", beta));
  return ctx.backend().add_scalar(ctx, alpha, x, beta, out);
}

absl::Status Unary(const Context& ctx, UnaryOp op, ConstTensorView x, TensorView out) {
  constexpr const char* kOp = "Unary";
  DIOND_RETURN_IF_ERROR(CheckSameShapeContiguous(ctx, kOp, x, "x", out));
  if (static_cast<int>(op) > static_cast<int>(UnaryOp::kNanToNum)) {
    return Invalid(kOp, "unknown UnaryOp ", static_cast<int>(op));
  }
  return ctx.backend().unary(ctx, op, x, out);
}

absl::Status Binary(const Context& ctx, BinaryOp op, ConstTensorView x, ConstTensorView y,
                    TensorView out) {
  constexpr const char* kOp = "Binary";
  DIOND_RETURN_IF_ERROR(CheckSameShapeContiguous(ctx, kOp, x, "x", out));
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "y", y));
  if (y.rank() != x.rank()) {
    return Invalid(kOp, "y is ", y.DebugString(), ", want rank ", x.rank(), " like x ",
                   x.DebugString());
  }
  for (int i = 0; i < x.rank(); ++i) {
    if (y.dim(i) != x.dim(i) && y.dim(i) != 1) {
      return Invalid(kOp, "y ", y.DebugString(), " does not broadcast to x ", x.DebugString(),
                     " (dim ", i, ")");
    }
  }
  if (static_cast<int>(op) > static_cast<int>(BinaryOp::kMin)) {
    return Invalid(kOp, "unknown BinaryOp ", static_cast<int>(op));
  }
  return ctx.backend().binary(ctx, op, x, y, out);
}

}  // namespace diond::kernels
