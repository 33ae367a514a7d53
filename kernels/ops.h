// The ops API: the numerical building blocks of the update rules (kernels/optim) and their
// orthogonalizers, behind one device-agnostic header (ARCHITECTURE.md §3, STYLE.md R3).
//
// Conventions shared by every op below:
//   * Signature `absl::Status Op(const Context& ctx, ...)`. Inputs are ConstTensorView, outputs
//     TensorView. All views must be on ctx.device() (only the CPU exists today).
//   * Errors: every op validates ranks, shapes, dtypes, strides, devices and scalar arguments
//     first and returns INVALID_ARGUMENT naming the argument and its value (e.g. "Gemm: c is
//     [64, 47] f32, want [64, 48]"); on such an error no output byte has been written. Nothing
//     aborts on bad input. INTERNAL means a backend library failed (our bug or theirs); outputs
//     are then unspecified.
//   * Arithmetic is f32. Inputs of dtype bf16/f16 are widened exactly; a result stored to a
//     bf16/f16 output is rounded once, round-to-nearest-even, from the f32 value. This is the
//     PyTorch eager rule for low-precision elementwise ops (conformance README §3.3, §5 item 7):
//     a Python-float scalar is applied in f32 and the result rounded once.
//   * Matrix ops take rank-2 [rows, cols] or rank-3 [batch, rows, cols] views with unit column
//     stride and any row stride >= cols ("row-major matrices"). Rank-3 ops loop over the batch
//     running the same per-matrix kernel, so a batched call is bit-identical to one call per
//     matrix.
//   * Elementwise ops need contiguous views of equal shape (except where broadcasting is stated).
//     An output may alias an input exactly (same pointer and layout); partial overlap is
//     undefined.
//   * Determinism: for a fixed thread count every op is deterministic (fixed reduction order).
//   * Threading: see the policy in context.h.
#ifndef DIOND_KERNELS_OPS_H_
#define DIOND_KERNELS_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace diond::kernels {

// ================================ GEMM ========================================================

enum class Trans : uint8_t { kNo, kYes };

struct GemmParams {
  Trans trans_a = Trans::kNo;
  Trans trans_b = Trans::kNo;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: C is not read (NaN/garbage in C is ignored)
  // f32 inputs only: which library (kAuto follows the context's Fp32GemmEngine; kAuto there
  // picks by shape: small and matrix-vector products stay on OpenBLAS, the others take the
  // engine of kernels/engine_choice.h: oneDNN, or what the start-up calibration measured faster;
  // kernels/cpu/gemm.cc, docs/BENCHMARKS.md "f32 engines").
  Fp32GemmEngine engine = Fp32GemmEngine::kAuto;
};

// C ← alpha·op(A)·op(B) + beta·C, op(X) = X or Xᵀ (the last two dims).
// Shapes: op(A) is m×k, op(B) is k×n, C is m×n. Rank 2, or rank 3 with a batch dim; a rank-2
// A or B (or batch 1) is broadcast against a batched C. Row-major matrices (unit column stride).
// Dtypes:
//   A,B f32  → C f32: cblas_sgemm or oneDNN f32 matmul.
//   A,B bf16 → C f32: oneDNN bf16 matmul, f32 accumulation, alpha/beta applied in f32.
//   A,B bf16 → C bf16: as above, the f32 value alpha·AB + beta·C rounded once to bf16 (RNE).
// k == 0 is allowed (C ← beta·C). Other dtype combinations: INVALID_ARGUMENT.
absl::Status Gemm(const Context& ctx, const GemmParams& params, ConstTensorView a,
                  ConstTensorView b, TensorView c);

enum class GramSide : uint8_t {
  kAAt,  // C = A·Aᵀ (rows×rows)
  kAtA,  // C = Aᵀ·A (cols×cols)
};

// Symmetric product C ← alpha·A·Aᵀ + beta·C (or Aᵀ·A): one triangle is computed, then mirrored
// so the whole C is written (C is exactly symmetric). The triangle: with the context's
// Fp32GemmEngine kOpenBlas, cblas_ssyrk; kOneDnn, the lower block triangle from oneDNN f32
// GEMMs on column panels (about half the flops at the GEMM rate); kAuto, small products on
// ssyrk, the others on kernels/engine_choice.h's fp32_symmetric (kernels/cpu/gemm.cc).
// A f32, C f32 square of the right size; rank 2 or 3 (same batch). beta != 0 reads only C's
// lower triangle (C is assumed symmetric).
absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c);

// bf16 symmetric product (the oneDNN bf16 mode of the orthogonalizers, Bf16Matmul::kOneDnnBf16;
// NOT bf16_reference's float32_gemm engine, which reproduces the reference's float32 GEMMs,
// docs/CONFORMANCE.md): C = A·Aᵀ for A bf16 [rows, cols] (rank 2 or 3), C f32 or bf16 [rows,
// rows] (same batch), accumulated in f32; a bf16 C gets each sum rounded once to nearest-even,
// as Gemm with a bf16 C. Only the lower block triangle is computed, in column panels of `block`
// columns (the last may be narrower): panel [j0, j0 + r) is one bf16 GEMM A[j0:]·A[j0:j0+r]ᵀ;
// then the lower triangle is mirrored onto the upper one, so C is exactly symmetric. (nb + 1) /
// (2·nb) of the full GEMM's FLOPs for nb panels (oneDNN has no bf16 SYRK). On the CPU every
// entry is bit for bit the full Gemm(A, A, trans_b)'s (kernels/cpu/gemm.cc says why, and runs a
// shape whose panels would not be, as on oneDNN's AMX kernels, as the full GEMM; gemm_test checks
// it), so the orthogonalizers use it for Y·Yᵀ and A·A = A·Aᵀ of a symmetric A without changing a
// bit; the CUDA backend runs the same lower block triangle as cuBLAS GEMMs of block pairs. `block`
// is a hint: the CPU backend widens panels to at least 16 columns (a one-column product runs on
// another oneDNN kernel). Scratch (CPU): one [rows, max(block, 16)] panel of C's dtype. block >= 1.
absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c);

// ============================= factorizations =================================================

// Thin QR of A (m×n, m >= n, f32): Q (m×n) with orthonormal columns (LAPACKE sgeqrf + sorgqr,
// Householder; column signs as LAPACK returns them) and, if `r` is non-empty, R (n×n, upper
// triangular, zeros below the diagonal) with A = Q·R. Rank 2 or 3. `q` may alias `a`.
absl::Status ThinQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r = {});

// Cholesky QR: R = chol(AᵀA) (upper), Q = A·R⁻¹. A m×n (m >= n) f32. Cheaper than ThinQr but
// loses orthogonality as cond(A)² grows; callers that need robustness use ThinQr or the
// randomized variant. FAILED_PRECONDITION (naming the matrix index and LAPACK's info) when AᵀA
// is not numerically positive definite; q is then unspecified. `q` may alias `a`.
absl::Status CholeskyQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r = {});

// Randomized Cholesky QR (ALGORITHMS.md §20.5 step 4): with the caller's sketch S (s×m, s >= n,
// e.g. N(0, 1/s) entries), R₁ = R of QR(S·A); P₁ = A·R₁⁻¹; R₂ = chol(P₁ᵀP₁); Q = P₁·R₂⁻¹.
// A m×n f32 rank 2 (or rank 3 with a rank-2 sketch shared by all matrices, or a rank-3 sketch).
// FAILED_PRECONDITION as CholeskyQr when P₁ᵀP₁ is not positive definite. `q` may alias `a`.
absl::Status RandomizedCholeskyQr(const Context& ctx, ConstTensorView a, ConstTensorView sketch,
                                  TensorView q);

// ============================= reductions =====================================================

enum class NormType : uint8_t {
  kL1,            // Σ|x|
  kL2,            // √Σx²
  kSumOfSquares,  // Σx²  (e.g. NorMuon's rowmean(U⊙U) = SumOfSquares / cols)
};
enum class Axis : uint8_t {
  kRows,  // one value per row (reduce over columns)
  kCols,  // one value per column (reduce over rows)
};

// Frobenius norm of each matrix: out[b] = ‖A_b‖_F. A any float dtype, rank 1..3; out f32 with
// Batch(A) elements (any rank/shape with that many elements, contiguous). Accumulates in double:
// each row in the row-sum order of elementwise_math.h (FoldRowSumLanes), the rows in order.
absl::Status FrobeniusNorm(const Context& ctx, ConstTensorView a, TensorView out);

// Per-row (axis kRows) or per-column (kCols) norms of each matrix. A any float dtype, rank 1..3
// (row-major); out f32 contiguous with Batch·Rows (kRows) or Batch·Cols (kCols) elements, in
// [batch][index] order. Accumulates in double (a row in the row-sum order of elementwise_math.h,
// FoldRowSumLanes; a column in row order), then rounds to f32.
absl::Status AxisNorms(const Context& ctx, ConstTensorView a, Axis axis, NormType type,
                       TensorView out);

// Top-k slices of one matrix A (rank 2, f32 or bf16) by L1 norm: axis kRows selects rows
// (scores Σ_j|A_ij|), kCols selects columns. The k indices are written in descending order of
// score; equal scores are ordered by lower index first, so the result is exact and
// deterministic. NaN scores rank below every number. 1 <= k <= Rows (or Cols). If `scores_out` is
// non-empty (f32, Rows or Cols elements) it receives all the L1 norms.
absl::Status TopKByL1Norm(const Context& ctx, ConstTensorView a, Axis axis, int64_t k,
                          absl::Span<int64_t> indices, TensorView scores_out = {});

// True iff every element of A is +0 or -0 (NaN is not zero). Any float dtype, any rank.
absl::Status IsAllZero(const Context& ctx, ConstTensorView a, bool* all_zero);

// ========================== gather / scatter ==================================================

// out ← the slices `indices` of A along `axis`, in the order given: kRows: out[i,:] = A[idx[i],:]
// (out k×cols); kCols: out[:,i] = A[:,idx[i]] (out rows×k). Rank 2 or 3 (same indices for every
// matrix). Dtype conversion allowed (out rounded RNE). Indices must be in range; duplicates OK.
absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out);

// dst[slices idx] ← alpha·src + beta·dst[slices idx] (f32 arithmetic, rounded to dst's dtype).
// beta == 0 assigns without reading dst (NaN in dst is overwritten). src shaped like Gather's
// out. Indices must be in range and distinct (duplicates: INVALID_ARGUMENT).
// Examples: Dion2 M[I] ← ef·S is (alpha=ef, beta=0); X[I] ← X[I] − α·O is (alpha=−α, beta=1).
absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst);

// ============================== elementwise ===================================================

// dst ← src with dtype conversion (RNE when narrowing), any strides, same shape (so a
// Transposed() view copies a transpose). The only elementwise op that takes strided views.
absl::Status Copy(const Context& ctx, ConstTensorView src, TensorView dst);

// dst ← value (any dtype; value rounded RNE).
absl::Status Fill(const Context& ctx, float value, TensorView dst);

// out ← alpha·x + beta·y. beta == 0 does not read y (pass y = {} or any view). Eager-PyTorch
// rounding: one rounding of the f32 value to out's dtype. (Scale is alpha·x with beta = 0.)
absl::Status Axpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                   ConstTensorView y, TensorView out);

// out ← alpha·x.
absl::Status Scale(const Context& ctx, float alpha, ConstTensorView x, TensorView out);

// out ← alpha·x + beta (scalar add; e.g. √V + 1e-8 with alpha 1).
absl::Status AddScalar(const Context& ctx, float alpha, ConstTensorView x, float beta,
                       TensorView out);

enum class UnaryOp : uint8_t {
  kSign,  // −1, 0 or +1; sign(±0) = 0 and sign(NaN) = 0 (PyTorch CPU)
  kAbs,
  kSqrt,
  kSquare,
  kNeg,
  kNanToNum,  // NaN → 0, +Inf → FLT_MAX, −Inf → −FLT_MAX (torch.nan_to_num defaults)
};
absl::Status Unary(const Context& ctx, UnaryOp op, ConstTensorView x, TensorView out);

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kMax, kMin };
// out ← x op y. x and out: same shape, contiguous. y: contiguous with x's rank, each dim equal
// to x's or 1 (broadcast), e.g. a [rows, 1] column of row scales for x [rows, cols], or [1]
// shaped scalars. Any float dtypes.
absl::Status Binary(const Context& ctx, BinaryOp op, ConstTensorView x, ConstTensorView y,
                    TensorView out);

// Fused AdamW step over one parameter tensor, with the float32 path of PyTorch 2.x's fused
// CPU kernel (conformance README §5 item 6, ALGORITHMS.md §20.6). lr, beta1, beta2, epsilon,
// weight_decay are the f32-rounded hyperparameters; step is the 1-based step count after
// increment; bias corrections are computed in double. All tensors f32, contiguous, same shape.
//   x ← x·f32(1 − lr·wd);  m ← fma(f32(1 − β1), g − m, m);  v ← v·β2 + (f32(1 − β2)·g)·g;
//   x ← x + (f32(−lr/bc1)·m) / (√v / f32(√bc2) + ε)
// cautious (§20.6 step 6, literal order): after the update, x ← x + f32(lr·wd)·x₀·[m·x₀ < 0]
// with x₀ = x before the step and m the updated first moment (undoes the decay where the
// update and the weight disagree in sign).
struct AdamWScalarRecord;  // below ("graph")
struct LionScalarRecord;
struct ApplyUpdateScalarRecord;

struct AdamWParams {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;
  bool cautious = false;
  // Set only by kernels/graph.h between validation and the backend (a caller's non-null value
  // is refused): the op's scalars are the record at this DEVICE address, read when the op runs,
  // and the fields above are ignored by the backend.
  const AdamWScalarRecord* scalars_on_device = nullptr;
};
absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v);

// Fused Lion step (ALGORITHMS.md §20.7): u ← sign(lerp(m, g, 1 − β1)); m ← lerp(m, g, 1 − β2);
// x ← x·(1 − lr·wd) (cautious: x ← x − (lr·wd)·x·[x·u ≥ 0]); x ← x − lr·u.
// lr, beta1, beta2, weight_decay f32-rounded; 1 − β and lr·wd formed in f32. All f32.
struct LionParams {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
  bool cautious = false;
  const LionScalarRecord* scalars_on_device = nullptr;  // as AdamWParams::scalars_on_device
};
absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m);

// ================================ ortho =======================================================
// Ops of the orthogonalizers (kernels/optim/orthogonalize.cc).

// a[i, i] ← a[i, i] + value on every (square) matrix of `a`: f32, rank 2 or 3, rows == cols,
// row-major (unit column stride, any row stride >= cols). E.g. S + a·I in Polar Express, so that
// a·Y + S·Y is one GEMM.
absl::Status AddToDiagonal(const Context& ctx, float value, TensorView a);

// The eager-PyTorch bf16 rounding points of `bf(bf(alpha·x) + bf(beta·bf(y)))` on f32 storage:
//   out ← r(r(alpha·x) + r(beta·r(y)))   with r = round to bf16 precision (RNE), kept in f32;
//   alpha == 0: out ← r(beta·r(y))       (x is not read; pass x = {} or any view).
// x, y, out: contiguous, same shape (any rank), all f32 or all bf16. out may alias x or y. In f32,
// x normally holds bf16-exact values and y the f32 result of a matmul of bf16-exact values, e.g.
// Polar Express's B = bf(bf(b·A) + bf(c·bf(A·A))) and Y = bf(bf(a·Y) + bf(B·Y)), and
// A = bf(Y·Yᵀ) as (alpha 0, beta 1). The value is the one of the bf16 ops sequence, so
// bf16_reference can keep its matrices in f32 (exactly widened) for the f32 GEMMs without
// widening copies. In bf16 (r of a stored value is itself) it is the eager sequence
// Scale(alpha, x), Scale(beta, y), Axpby(1, ·, 1, ·) of bf16 tensors in one pass: the oneDNN bf16
// iterations' B and Y updates.
absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out);
// ================================ end ortho ===================================================
// ================================ kops: fused optimizer phases ================================
// One pass over memory for what the rules did in several: the elementwise phases are bound by
// memory bandwidth, so each pass saved is time saved. The per-element math of each op is in
// kernels/elementwise_math.h (math::MomentumElement, ApplyUpdateElement, the Neuron* functions),
// shared with the device kernels.

// AdamWStep / LionStep that also report the squared Frobenius norm of the change they made to
// x: update_sq (f32, contiguous, one element) ← Σ (x_after − x_before)², accumulated in double
// (fixed order for a fixed thread count) and rounded once. Same x, m, v as the ops above, bit
// for bit; the parameters are read and written once (GroupOptimizer's in-place AdamW/Lion path).
absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v, TensorView update_sq);
absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m, TensorView update_sq);

// Momentum with the Nesterov blend (ALGORITHMS.md §20.1 steps 1-2), in one pass:
//   m ← μ·m_in + g;  u ← nesterov ? μ·m + g : m   (f32, no fused multiply-add).
// grad, m_in, m, u: f32, contiguous, same shape. m_in may be m itself (in place) or another
// buffer (e.g. the persistent state, with m its staged copy); u aliases none of the others.
absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u);

// Weight decay and update apply (§20.1 steps 5-7), in one pass over x and u:
//   x ← decay(x_in) − r(alpha·u),
//   decay(x) = cautious ? (x·u ≥ 0 ? x − lr_wd·x : x) : x·(1 − lr_wd)
//   with 1 − lr_wd formed in f32, r = RNE rounding to bf16 (kept in f32) when round_bf16.
// update, x_in, x: f32, contiguous, same shape; x_in may be x itself (in place).
struct ApplyUpdateParams {
  float alpha = 0.0f;
  float lr_wd = 0.0f;  // lr·weight_decay, f32
  bool cautious = false;
  bool round_bf16 = false;
  const ApplyUpdateScalarRecord* scalars_on_device = nullptr;  // as AdamWParams::scalars_on_device
};
absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x);

// NorMuon's neuron-wise normalization and rescaling (§6.2 steps 5-10, §20.2 steps 5-9) of every
// rows×cols unit of `o` (f32, rank 2 or 3 [batch, rows, cols], contiguous), in place:
//   f = ‖O‖_F; ν = rowmean(O²); V ← lerp(V, ν, w); D = O/(√V + 1e-8); O ← D·f/max(‖D‖_F, 1e-8).
// v: f32 contiguous with batch·rows elements ([batch][row]), updated in place. Sums in double:
// each row's in the row-sum order of elementwise_math.h (FoldRowSumLanes), a unit's ‖·‖² as its
// row sums added in row order; so the result does not depend on the thread count, and every
// backend gives the same bits.
absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v);

// Commit of a staged result, in one pass: dst ← src, and update_sq (f32, one element) ← Σ
// (src − dst_before)², accumulated in double as the tracked steps. src, dst: f32, contiguous,
// same shape, not overlapping.
absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq);

// Dion2's deferred parameter write (ALGORITHMS.md §7.2 steps 10-11), in place and in one pass
// over x: every element decays, then the selected slices take the update,
//   x ← decay·x;  x[slices I] ← alpha·src + x[slices I]
// (the values of Scale(decay) followed by Scatter(alpha, beta = 1), bit for bit), and
// update_sq (f32, one element) ← Σ (x_after − x_before)², summed in double as CopyWithChange.
// x: f32 contiguous, rank 2 (one matrix) or rank 3 [batch, rows, cols]; unlike Scatter, each
// matrix has its own k = indices.size() / batch indices (matrix b: indices[b·k, (b+1)·k)), in
// range and distinct within the matrix. src: f32 contiguous [batch,] k×cols (kRows) or
// rows×k (kCols), not overlapping x. GroupOptimizer calls it at commit, after the step's
// fallible phases, so the parameters are never staged for Dion2.
absl::Status DecayScatterWithChange(const Context& ctx, float decay, ConstTensorView src, Axis axis,
                                    absl::Span<const int64_t> indices, float alpha, TensorView x,
                                    TensorView update_sq);

// ================================ steps ======================================================
// The session's per-element passes over a trainer's memory (server/session, one Step).

// *all_finite ← whether no element of x is NaN or ±Inf. Any float dtype, contiguous, any rank.
absl::Status AllFinite(const Context& ctx, ConstTensorView x, bool* all_finite);

// out ← scale·x in f32 (x of any float dtype, widened exactly; one f32 multiplication per
// element, skipped when scale == 1), and *all_finite ← whether every element of out is finite:
// a Step's gradient read, widen + scale + NaN/Inf scan in one pass. x and out contiguous with
// the same element count; out f32; out may alias an f32 x exactly.
absl::Status WidenScaleCheckFinite(const Context& ctx, ConstTensorView x, float scale,
                                   TensorView out, bool* all_finite);

// *checksum ← FNV-1a 64 over the bytes of x, in memory order (f32, contiguous): the world's
// replica comparison. A sync point (the value is read on the host).
absl::Status Fnv1aChecksum(const Context& ctx, ConstTensorView x, uint64_t* checksum);

// ================================ devrules: host <-> device copies ============================
// The explicit copies between host memory and the memory of ctx.device() (docs/KERNELS.md §4.3,
// docs/GPU.md "Sync points"): code above the kernels (kernels/optim, server/) reads or writes
// device memory only through ops and these two. Each is a SYNC POINT: synchronous for the caller
// (a stream backend queues the copy on ctx.stream() and waits for it, so every op queued before
// it has finished). On the CPU context both are plain copies.
//   host side (host_src / host_dst): a CPU view (Device{kCpu}, e.g. MakeView), contiguous;
//   device side (dst / src): on ctx.device(), contiguous; same shape and dtype as the host side.
// INVALID_ARGUMENT naming the argument otherwise (nothing copied); the backend's status for a
// failed copy. An empty tensor copies nothing.
absl::Status CopyFromHost(const Context& ctx, ConstTensorView host_src, TensorView dst);
absl::Status CopyToHost(const Context& ctx, ConstTensorView src, TensorView host_dst);
// ================================ end devrules ================================================

// ================================ asynccopy: stream-ordered copies, device-side flags ==========
// The asynchronous forms of the two copies above and the one wait that completes them
// (docs/GPU.md "Sync points"). Same arguments and checks as CopyFromHost / CopyToHost, but the
// copy is only QUEUED on ctx.stream(), after every op queued before it: when the call returns
// the copy may not have happened yet. Until Synchronize(ctx) (or a synchronous entry of the same
// context: CopyFromHost / CopyToHost, or an op that hands a value to the host) has returned, the
// host memory must stay valid, and the host must not write host_src (the device may read the new
// bytes or the old) nor read host_dst (it may still hold the old bytes). On the CPU context both
// are plain copies and Synchronize does nothing. A failure of a queued copy may be reported by
// the call or by the next sync point of the context.
absl::Status CopyFromHostAsync(const Context& ctx, ConstTensorView host_src, TensorView dst);
absl::Status CopyToHostAsync(const Context& ctx, ConstTensorView src, TensorView host_dst);
// Waits until everything queued on ctx.stream() has run (a SYNC POINT); returns the first failure
// of queued work not reported yet.
absl::Status Synchronize(const Context& ctx);
// The four copies above on raw bytes, for memory a caller holds as bytes rather than as tensors
// (a session's staging, a collective's exchange buffer): `host` is host memory, `device` is
// ctx.device() memory. Same sync rules; INVALID_ARGUMENT for a null pointer with bytes > 0.
// Zero bytes copy nothing.
absl::Status CopyBytesFromHost(const Context& ctx, const void* host, void* device, size_t bytes);
absl::Status CopyBytesToHost(const Context& ctx, const void* device, void* host, size_t bytes);
absl::Status CopyBytesFromHostAsync(const Context& ctx, const void* host, void* device,
                                    size_t bytes);
absl::Status CopyBytesToHostAsync(const Context& ctx, const void* device, void* host, size_t bytes);

// AllFinite / WidenScaleCheckFinite with the answer kept on the device, so that a step scans
// every tensor and reads ONE flag back: `nonfinite` (f32, contiguous, one element, on
// ctx.device(), aliasing neither x nor out) is set to 1 when an element of x (resp. of out) is
// NaN or ±Inf, and left as it was otherwise (an OR of the tensors' non-finiteness, so the caller
// fills it with 0 once per step). Otherwise as the host-bool ops above; not sync points.
absl::Status AllFiniteFlag(const Context& ctx, ConstTensorView x, TensorView nonfinite);
absl::Status WidenScaleCheckFiniteFlag(const Context& ctx, ConstTensorView x, float scale,
                                       TensorView out, TensorView nonfinite);
// ================================ end asynccopy ===============================================

// ================================ graph: device-side scalars ===================================
// The per-call scalars of the fused steps as a device reads them from its own memory, so that a
// captured graph (kernels/graph.h) replays with new hyperparameters: the graph keeps the record's
// address, and the host rewrites the record before each launch. Formed on the host exactly as
// the backends form them for a call by value (kernels/elementwise_math.h), so a replay computes
// the same bits as the eager op. Layout-identical to the plugin ABI's DiondAdamWScalars,
// DiondLionScalars and DiondApplyUpdateScalars (kernels/cuda/plugin_api.h; checked there).
struct AdamWScalarRecord {
  float decay, lr_wd, one_minus_b1, one_minus_b2, beta2, step_size, sqrt_bc2, eps;
  int32_t cautious;
};
struct LionScalarRecord {
  float w1, w2, lr_wd, decay, lr;
  int32_t cautious;
};
struct ApplyUpdateScalarRecord {
  float alpha, decay, lr_wd;
  int32_t cautious, round_bf16;
};
AdamWScalarRecord ScalarRecordOf(const AdamWParams& p);
LionScalarRecord ScalarRecordOf(const LionParams& p);
ApplyUpdateScalarRecord ScalarRecordOf(const ApplyUpdateParams& p);
// ================================ end graph ===================================================

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_OPS_H_
