// Orthogonalizers: approximations of the polar factor U·Vᵀ of a matrix G = U·Σ·Vᵀ, used by
// Muon, NorMuon, Dion2 and Dion3 (ALGORITHMS.md §3.1, §3.3, §20 ORTH-1..4).
//
//   * Polar Express (the reference's default): 5 fixed (a, b, c) tuples (§3.3), input scaled by
//     1/(1.02·‖G‖_F + ε); tall matrices (rows > cols) iterate on AᵀA (cols×cols) without being
//     transposed: Y ← a·Y + Y·(b·A + c·A²); wide/square on A = Y·Yᵀ: Y ← a·Y + (b·A + c·A²)·Y.
//   * NS5: the quintic Newton–Schulz of §3.1: tall inputs are transposed to wide, scaled by
//     1/(‖G‖_F + ε), 5 tuples with A = Y·Yᵀ, transposed back.
//
// Precision modes:
//   * kFp32: everything in f32. Symmetric products (A = Y·Yᵀ and A·A, both symmetric) are
//     computed as one triangle (ssyrk / ssymm) and the elementwise combinations are folded into
//     the GEMMs' alpha/beta. The strict-check mode against the conformance f64 references.
//   * kBf16Reference: emulates the reference's eager PyTorch-2.x bf16 rounding points
//     (conformance README §3.3 and §5 item 7): Y ← bf(G); every matmul takes bf16 inputs,
//     accumulates in f32 and rounds its result to bf16; every elementwise op rounds its result to
//     bf16 with the Python-float coefficient applied in f32. Per iteration (wide; tall mirrors):
//       A = bf(Y·Yᵀ); AA = bf(A·A); B = bf(bf(b·A) + bf(c·AA)); BY = bf(B·Y);
//       Y = bf(bf(a·Y) + BY).
//     The scaling is s = bf(‖Y‖_F) (f32 accumulation); d = bf(bf(1.02·s) + ε) (PE) or
//     d = bf(s + ε) (NS5); Y = bf(Y / d). Matmuls: see Bf16Matmul. With the default
//     kReferenceF32Gemm the matrices live in f32 storage holding bf16 values, and each rounding
//     point above is one fused op (Bf16RoundedAxpby) after each f32 GEMM.
//
// Batching: a rank-3 input [batch, rows, cols] is orthogonalized matrix by matrix with the same
// per-matrix kernel, so batched and one-by-one results are bit-identical.
//
// Thread-safety: as the ops API (one driving thread per Context).
#ifndef DIOND_KERNELS_OPTIM_ORTHOGONALIZE_H_
#define DIOND_KERNELS_OPTIM_ORTHOGONALIZE_H_

#include <array>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace diond::kernels {

enum class OrthoMethod : uint8_t { kPolarExpress, kNewtonSchulz5 };
enum class OrthoPrecision : uint8_t { kFp32, kBf16Reference };

struct OrthoCoefficients {
  double a, b, c;
};
// The 5 Polar Express tuples of ALGORITHMS.md §3.3 (1.02 safety factor baked into the first 4).
absl::Span<const OrthoCoefficients> PolarExpressCoefficients();
// The 5 NS5 tuples of ALGORITHMS.md §3.1.
absl::Span<const OrthoCoefficients> NewtonSchulz5Coefficients();

// How kBf16Reference mode multiplies bf16 matrices (both accumulate in f32 and round once):
//   * kReferenceF32Gemm: the f32 OpenBLAS GEMM of the exactly widened operands, the reference
//     runtime's own GEMM and so its f32 accumulation order (bit-exact with the vectors).
//   * kOneDnnBf16: oneDNN's bf16 matmul (about 2.5x faster; another accumulation order, which on
//     ill-conditioned real gradients moves the update by up to ~3 % from the reference).
enum class Bf16Matmul : uint8_t { kReferenceF32Gemm, kOneDnnBf16 };

struct OrthogonalizeOptions {
  OrthoMethod method = OrthoMethod::kPolarExpress;
  OrthoPrecision precision = OrthoPrecision::kBf16Reference;
  Bf16Matmul bf16_matmul = Bf16Matmul::kReferenceF32Gemm;
  // ε of the normalization; the optimizers pass their group epsilon (default 1e-8, f32).
  float epsilon = 1e-8f;
};

// out ← ORTH(in). `in`: rank 2 [m, n] or rank 3 [batch, m, n], any float dtype, row-major
// matrices. `out`: same shape, f32 or bf16, contiguous matrices; it may alias `in` only if
// both are the same contiguous view. In kBf16Reference mode the result values are bf16 (exact
// when written to an f32 out); in kFp32 mode a bf16 out is rounded once (RNE).
// Any m, n >= 1 (1×n and m×1 included); an all-zero input gives an all-zero output (ε > 0).
// Non-finite input propagates NaN (not checked). INVALID_ARGUMENT names the bad argument
// (rank, shape mismatch, dtype, device, negative ε).
// Any device: in and out are views on ctx.device() (CPU, CUDA, the TEST backend); temporaries,
// including the normalization's scalars, live in ctx.scratch(), and nothing is read back to the
// host (no sync point).
absl::Status Orthogonalize(const Context& ctx, const OrthogonalizeOptions& options,
                           ConstTensorView in, TensorView out);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_OPTIM_ORTHOGONALIZE_H_
