// Polar Express and NS5 orthogonalizers (orthogonalize.h) on top of the ops API.
#include "kernels/optim/orthogonalize.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

// ALGORITHMS.md §3.3 (dion/polar_express.py:10-16): Polar Express, Amsel et al. 2025,
// "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm";
// the first four tuples carry a 1.02 safety factor.
constexpr OrthoCoefficients kPolarExpress[5] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};

// ALGORITHMS.md §3.1 (dion/newton_schulz_triton.py:500-506).
constexpr OrthoCoefficients kNs5[5] = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
    {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012},
};

// Python-float coefficient as the reference applies it to a tensor: converted to f32
// (conformance README §5 item 7).
float F32(double v) { return static_cast<float>(v); }

// ---- f32 mode -----------------------------------------------------------------------------

// One matrix, f32. y: m×n contiguous f32 work buffer holding the input; on return it holds the
// result. `y2` is a second m×n buffer, `ga`/`gb` are g×g buffers (g = the Gram size).
// PE wide/square: A = Y·Yᵀ; tall: A = Yᵀ·Y. NS5 is called on the transposed (wide) matrix.
// Per iteration, with S = b·A + c·A·A:
//   A  ← Y·Yᵀ                 ssyrk (one triangle) + mirror
//   S  ← c·A·Aᵀ + b·A         ssyrk with beta = b on a copy of A (A·A = A·Aᵀ: A symmetric)
//   S  ← S + a·I              so that a·Y + S·Y = (S + aI)·Y is one GEMM without a Y copy
//   Y' ← S·Y (wide) | Y·S (tall)
// Compared with the 4m²n + 2m³ flops of three general GEMMs, this does 3m²n + m³.
absl::Status Fp32Iterations(const Context& ctx, absl::Span<const OrthoCoefficients> coeffs,
                            bool tall, TensorView* y, TensorView* y2, TensorView ga,
                            TensorView gb) {
  const GramSide side = tall ? GramSide::kAtA : GramSide::kAAt;
  GemmParams gp;  // engine kAuto: the measured faster f32 engine (kernels/cpu/gemm.cc)
  for (const OrthoCoefficients& k : coeffs) {
    DIOND_RETURN_IF_ERROR(SymmetricProduct(ctx, side, 1.0f, *y, 0.0f, ga));
    DIOND_RETURN_IF_ERROR(Copy(ctx, ga, gb));
    DIOND_RETURN_IF_ERROR(SymmetricProduct(ctx, GramSide::kAAt, F32(k.c), ga, F32(k.b), gb));
    DIOND_RETURN_IF_ERROR(AddToDiagonal(ctx, F32(k.a), gb));
    if (tall) {
      DIOND_RETURN_IF_ERROR(Gemm(ctx, gp, *y, gb, *y2));
    } else {
      DIOND_RETURN_IF_ERROR(Gemm(ctx, gp, gb, *y, *y2));
    }
    std::swap(*y, *y2);
  }
  return absl::OkStatus();
}

// ---- bf16 reference mode ------------------------------------------------------------------

// By default (Bf16Matmul::kReferenceF32Gemm) every bf16 matmul is the f32 GEMM (OpenBLAS) of
// the exactly widened bf16 operands, rounded once to bf16: the reference's definition
// (conformance README §5 item 7) with the reference runtime's own float32 GEMM, so the f32
// accumulation order is the reference's too (Debian's PyTorch calls the same BLAS). That order
// matters on real gradients: early-training matrices are so ill-conditioned that one f32 ulp
// in one Gram entry lying on a bf16 rounding tie moves the orthogonalized update by ~3 %
// (measured with oneDNN's bf16 matmul, which accumulates in another order). For the same
// reason neither product uses a symmetric (one-triangle) kernel here: OpenBLAS's sgemm result
// for Y·Yᵀ is not itself exactly symmetric (about 4 % of the entries differ from their mirror
// by an ulp, measured at 768×3072 on 2 threads), and ssyrk agrees with neither triangle.
//
// These iterations keep every matrix in f32 storage: yf (m×n) holds the bf16 values of Y
// exactly widened, so the f32 GEMMs read it directly, and every bf16 rounding point of the
// eager sequence is one Bf16RoundedAxpby (ops.h), which rounds the matmul result and applies
// the elementwise combination in one pass. pf: m×n f32; gf, gf2: g×g f32. Per iteration (wide;
// tall mirrors with A = Yᵀ·Y and Y·B):
//   A  = bf(Y·Yᵀ)                        Gemm, then Bf16RoundedAxpby(0, -, 1, A)
//   B  = bf(bf(b·A) + bf(c·bf(A·A)))     Gemm, then Bf16RoundedAxpby(b, A, c, AA)
//   Y  = bf(bf(a·Y) + bf(B·Y))           Gemm, then Bf16RoundedAxpby(a, Y, 1, BY)
absl::Status Bf16F32StorageIterations(const Context& ctx,
                                      absl::Span<const OrthoCoefficients> coeffs, bool tall,
                                      TensorView yf, TensorView pf, TensorView gf, TensorView gf2) {
  GemmParams gram, plain;
  gram.engine = plain.engine = Fp32GemmEngine::kOpenBlas;  // the reference runtime's GEMM
  if (tall) {
    gram.trans_a = Trans::kYes;  // A = Yᵀ·Y
  } else {
    gram.trans_b = Trans::kYes;  // A = Y·Yᵀ
  }
  for (const OrthoCoefficients& k : coeffs) {
    DIOND_RETURN_IF_ERROR(Gemm(ctx, gram, yf, yf, gf));
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, gf, gf));
    DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, gf, gf, gf2));
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, F32(k.b), gf, F32(k.c), gf2, gf2));
    if (tall) {  // BY = Y·B
      DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, yf, gf2, pf));
    } else {  // BY = B·Y
      DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, gf2, yf, pf));
    }
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, F32(k.a), yf, 1.0f, pf, yf));
  }
  return absl::OkStatus();
}

// Bf16Matmul::kOneDnnBf16: the same rounding points on bf16 storage (y, p: m×n bf16; ga, gaa,
// gb: g×g bf16), every matmul a oneDNN bf16 GEMM with a bf16 result; the elementwise steps of
// eager PyTorch (bf(b·A), bf(c·AA), their sum; bf(a·Y), its sum with P), each rounding its
// result once, are one Bf16RoundedAxpby each on bf16 storage: the same values in one pass.
//
// The two Gram-like products use the half-work SymmetricProductBf16 where it pays (HalfGram):
// A = Y·Yᵀ (wide and square Y) and A·A, computed as A·Aᵀ (A is exactly symmetric: it is the
// mirror of one triangle, or oneDNN's Y·Yᵀ / Yᵀ·Y, which is exactly symmetric). On the CPU both
// are bit for bit the full GEMMs they replace (ops.h; gemm_test and orthogonalize_test check it),
// so the values are the reference's as before. A tall Y's Yᵀ·Y stays a full GEMM: oneDNN's
// panels of a transposed operand are not bit for bit its full product (measured: a few entries in
// 10⁵ differ at 3072×768).
bool HalfGram(int64_t g, int64_t k) {
  // Measured (docs/BENCHMARKS.md "Half-work Gram products"): 1.3-1.7x faster than the full bf16
  // GEMM from g = 768 and from g = 192 with k = 3072, no faster at 192×768, on an AVX-512 EPYC
  // (on AMX cores the CPU backend computes the full GEMM instead: faster there).
  return g >= 128 && g * g * k >= (int64_t{1} << 26);
}
int64_t HalfGramBlock(int64_t g) {  // a fifth of g rounded up to 32, at least 64
  return std::min(g, std::max<int64_t>(64, ((g + 4) / 5 + 31) / 32 * 32));
}

absl::Status OneDnnBf16Iterations(const Context& ctx, absl::Span<const OrthoCoefficients> coeffs,
                                  bool tall, TensorView y, TensorView p, TensorView ga,
                                  TensorView gaa, TensorView gb) {
  GemmParams gram, plain;
  if (tall) {
    gram.trans_a = Trans::kYes;  // A = Yᵀ·Y
  } else {
    gram.trans_b = Trans::kYes;  // A = Y·Yᵀ
  }
  const int64_t g = ga.Rows(), inner = tall ? y.Rows() : y.Cols();
  const bool half_y = !tall && HalfGram(g, inner), half_a = HalfGram(g, g);
  for (const OrthoCoefficients& k : coeffs) {
    if (half_y) {  // A = bf(Y·Yᵀ)
      DIOND_RETURN_IF_ERROR(SymmetricProductBf16(ctx, y, HalfGramBlock(g), ga));
    } else {  // A = bf(Y·Yᵀ) | bf(Yᵀ·Y)
      DIOND_RETURN_IF_ERROR(Gemm(ctx, gram, y, y, ga));
    }
    if (half_a) {  // AA = bf(A·Aᵀ) = bf(A·A)
      DIOND_RETURN_IF_ERROR(SymmetricProductBf16(ctx, ga, HalfGramBlock(g), gaa));
    } else {  // AA = bf(A·A)
      DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, ga, ga, gaa));
    }
    // B = bf(bf(b·A) + bf(c·AA))
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, F32(k.b), ga, F32(k.c), gaa, gb));
    if (tall) {  // P = bf(Y·B)
      DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, y, gb, p));
    } else {  // P = bf(B·Y)
      DIOND_RETURN_IF_ERROR(Gemm(ctx, plain, gb, y, p));
    }
    // Y = bf(bf(a·Y) + P) (bf(1·P) = P)
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, F32(k.a), y, 1.0f, p, y));
  }
  return absl::OkStatus();
}

absl::Status Validate(const Context& ctx, const OrthogonalizeOptions& o, ConstTensorView in,
                      TensorView out) {
  constexpr const char* kOp = "Orthogonalize";
  auto bad = [&](auto&&... args) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", args...));
  };
  if (o.method != OrthoMethod::kPolarExpress && o.method != OrthoMethod::kNewtonSchulz5) {
    return bad("unknown method ", static_cast<int>(o.method));
  }
  if (o.precision != OrthoPrecision::kFp32 && o.precision != OrthoPrecision::kBf16Reference) {
    return bad("unknown precision ", static_cast<int>(o.precision));
  }
  if (o.bf16_matmul != Bf16Matmul::kReferenceF32Gemm && o.bf16_matmul != Bf16Matmul::kOneDnnBf16) {
    return bad("unknown bf16_matmul ", static_cast<int>(o.bf16_matmul));
  }
  if (!std::isfinite(o.epsilon) || o.epsilon < 0.0f) {
    return bad("epsilon is ", o.epsilon, ", want a finite value >= 0");
  }
  if (in.rank() != 2 && in.rank() != 3) {
    return bad("in is ", in.DebugString(), ", want rank 2 [m, n] or rank 3 [batch, m, n]");
  }
  if (in.device() != ctx.device() || out.device() != ctx.device()) {
    return bad("in/out are not on the context's device");
  }
  for (int i = 0; i < in.rank(); ++i) {
    if (in.dim(i) < 0) return bad("in has a negative dim: ", in.DebugString());
  }
  if (in.Cols() > 1 && in.layout().ColStride() != 1) {
    return bad("in ", in.DebugString(), " has column stride ", in.layout().ColStride(), ", want 1");
  }
  if (in.Rows() > 1 && in.layout().RowStride() < in.Cols()) {
    return bad("in ", in.DebugString(), " has row stride ", in.layout().RowStride(), " < cols");
  }
  if (in.NumElements() > 0 && in.data() == nullptr) return bad("in has a null data pointer");
  if (out.rank() != in.rank()) {
    return bad("out is ", out.DebugString(), ", want the shape of in ", in.DebugString());
  }
  for (int i = 0; i < in.rank(); ++i) {
    if (out.dim(i) != in.dim(i)) {
      return bad("out is ", out.DebugString(), ", want the shape of in ", in.DebugString());
    }
  }
  if (out.dtype() != DType::kF32 && out.dtype() != DType::kBf16) {
    return bad("out has dtype ", DTypeName(out.dtype()), ", want f32 or bf16");
  }
  if (!out.IsContiguous()) return bad("out ", out.DebugString(), " is not contiguous");
  if (out.NumElements() > 0 && out.data() == nullptr) return bad("out has a null data pointer");
  if (in.dtype() != DType::kF32 && in.dtype() != DType::kBf16 && in.dtype() != DType::kF16) {
    return bad("in has an unknown dtype");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Span<const OrthoCoefficients> PolarExpressCoefficients() { return kPolarExpress; }
absl::Span<const OrthoCoefficients> NewtonSchulz5Coefficients() { return kNs5; }

namespace {

// A tensor of ctx's scratch arena as a view on ctx's device (the arena's blocks come from the
// device backend's allocator).
absl::StatusOr<TensorView> ScratchView(const Context& ctx, DType dtype,
                                       std::initializer_list<int64_t> shape) {
  DIOND_ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(dtype, shape, &ctx.scratch()));
  return TensorView(t.data(), t.layout(), ctx.device());
}

// The normalization of ORTH-2 with its scalars kept on the device (no sync point, and nothing a
// CUDA graph could not capture): four [1, 1] f32 scalars of the scratch arena, each step one op
// whose f32 arithmetic is exactly that of the scalar expression it replaces.
struct DeviceScalars {
  TensorView a, b, c, d;  // [1, 1] f32 each
};
absl::StatusOr<DeviceScalars> MakeDeviceScalars(const Context& ctx) {
  DeviceScalars s;
  DIOND_ASSIGN_OR_RETURN(s.a, ScratchView(ctx, DType::kF32, {1, 1}));
  DIOND_ASSIGN_OR_RETURN(s.b, ScratchView(ctx, DType::kF32, {1, 1}));
  DIOND_ASSIGN_OR_RETURN(s.c, ScratchView(ctx, DType::kF32, {1, 1}));
  DIOND_ASSIGN_OR_RETURN(s.d, ScratchView(ctx, DType::kF32, {1, 1}));
  return s;
}

// fp32 mode: y ← y · (1 / (k·‖y‖ + ε)), k = 1.02 (PE) or 1 (NS5), as the host expression
// `1.0f / (k * norm + eps)` and a Scale by it (a·v == v·a).
absl::Status Fp32Normalize(const Context& ctx, bool pe, float eps, const DeviceScalars& s,
                           TensorView y) {
  DIOND_RETURN_IF_ERROR(FrobeniusNorm(ctx, y, s.a.Reshaped({1})));
  DIOND_RETURN_IF_ERROR(AddScalar(ctx, pe ? 1.02f : 1.0f, s.a, eps, s.b));  // denom
  DIOND_RETURN_IF_ERROR(Fill(ctx, 1.0f, s.c));
  DIOND_RETURN_IF_ERROR(Binary(ctx, BinaryOp::kDiv, s.c, s.b, s.d));  // 1 / denom
  return Binary(ctx, BinaryOp::kMul, y, s.d, y);
}

// bf16 modes: s = bf(‖Y‖_F); PE: d = bf(bf(s·1.02) + ε); NS5: d = bf(s + ε); y ← y / d (the
// caller rounds the quotient where its storage does not).
absl::Status Bf16Normalize(const Context& ctx, bool pe, float eps, const DeviceScalars& s,
                           TensorView y) {
  DIOND_RETURN_IF_ERROR(FrobeniusNorm(ctx, y, s.a.Reshaped({1})));
  DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, s.a, s.b));  // s = bf(norm)
  if (pe) {
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.02f, s.b, s.b));  // bf(s·1.02)
  }
  DIOND_RETURN_IF_ERROR(AddScalar(ctx, 1.0f, s.b, eps, s.c));              // · + ε
  DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, s.c, s.d));  // d = bf(·)
  return Binary(ctx, BinaryOp::kDiv, y, s.d, y);
}

// The per-matrix kernel; Orthogonalize loops over the batch with it, so a batched call and
// one call per matrix are bit-identical. Buffers come from ctx.scratch() (rewound by the caller).
absl::Status OrthogonalizeOne(const Context& ctx, const OrthogonalizeOptions& o, ConstTensorView in,
                              TensorView out) {
  const int64_t m = in.Rows(), n = in.Cols();
  const bool pe = o.method == OrthoMethod::kPolarExpress;
  const bool tall = m > n;
  // NS5 transposes tall inputs and iterates on the wide matrix; PE keeps the orientation.
  const bool transpose = !pe && tall;
  const bool gram_tall = pe && tall;
  const int64_t wm = transpose ? n : m, wn = transpose ? m : n;  // working shape
  const int64_t g = std::min(m, n);
  auto coeffs = pe ? PolarExpressCoefficients() : NewtonSchulz5Coefficients();
  ConstTensorView src = transpose ? in.Transposed() : in;
  // The normalization's scalars, on the device.
  DIOND_ASSIGN_OR_RETURN(const DeviceScalars scalars, MakeDeviceScalars(ctx));

  if (o.precision == OrthoPrecision::kFp32) {
    DIOND_ASSIGN_OR_RETURN(TensorView y, ScratchView(ctx, DType::kF32, {wm, wn}));
    DIOND_ASSIGN_OR_RETURN(TensorView yb, ScratchView(ctx, DType::kF32, {wm, wn}));
    DIOND_ASSIGN_OR_RETURN(TensorView ga, ScratchView(ctx, DType::kF32, {g, g}));
    DIOND_ASSIGN_OR_RETURN(TensorView gb, ScratchView(ctx, DType::kF32, {g, g}));
    DIOND_RETURN_IF_ERROR(Copy(ctx, src, y));
    DIOND_RETURN_IF_ERROR(Fp32Normalize(ctx, pe, o.epsilon, scalars, y));
    DIOND_RETURN_IF_ERROR(Fp32Iterations(ctx, coeffs, gram_tall, &y, &yb, ga, gb));
    return Copy(ctx, transpose ? ConstTensorView(y).Transposed() : ConstTensorView(y), out);
  }

  // kBf16Reference: ORTH-1 Y ← bf(G) (a transposed copy for tall NS5: X.mT is a view, the
  // matmuls then read it transposed; the values are the same).
  // ORTH-2: s = bf(‖Y‖_F); PE: d = bf(bf(s·1.02) + ε); NS5: d = bf(s + ε); Y = bf(Y / d)
  // (Bf16Normalize).
  if (o.bf16_matmul == Bf16Matmul::kReferenceF32Gemm) {
    DIOND_ASSIGN_OR_RETURN(TensorView y, ScratchView(ctx, DType::kF32, {wm, wn}));
    DIOND_ASSIGN_OR_RETURN(TensorView pf, ScratchView(ctx, DType::kF32, {wm, wn}));
    DIOND_ASSIGN_OR_RETURN(TensorView gf, ScratchView(ctx, DType::kF32, {g, g}));
    DIOND_ASSIGN_OR_RETURN(TensorView gf2, ScratchView(ctx, DType::kF32, {g, g}));
    DIOND_RETURN_IF_ERROR(Copy(ctx, src, y));
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, y, y));  // bf(G)
    DIOND_RETURN_IF_ERROR(Bf16Normalize(ctx, pe, o.epsilon, scalars, y));
    DIOND_RETURN_IF_ERROR(Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, y, y));  // bf(Y / d)
    DIOND_RETURN_IF_ERROR(Bf16F32StorageIterations(ctx, coeffs, gram_tall, y, pf, gf, gf2));
    ConstTensorView result = y;
    return Copy(ctx, transpose ? result.Transposed() : result, out);  // exact (bf16 values)
  }
  DIOND_ASSIGN_OR_RETURN(TensorView y, ScratchView(ctx, DType::kBf16, {wm, wn}));
  DIOND_ASSIGN_OR_RETURN(TensorView p, ScratchView(ctx, DType::kBf16, {wm, wn}));
  DIOND_ASSIGN_OR_RETURN(TensorView ga, ScratchView(ctx, DType::kBf16, {g, g}));
  DIOND_ASSIGN_OR_RETURN(TensorView gaa, ScratchView(ctx, DType::kBf16, {g, g}));
  DIOND_ASSIGN_OR_RETURN(TensorView gb, ScratchView(ctx, DType::kBf16, {g, g}));
  DIOND_RETURN_IF_ERROR(Copy(ctx, src, y));
  DIOND_RETURN_IF_ERROR(Bf16Normalize(ctx, pe, o.epsilon, scalars, y));
  DIOND_RETURN_IF_ERROR(OneDnnBf16Iterations(ctx, coeffs, gram_tall, y, p, ga, gaa, gb));
  ConstTensorView result = y;
  return Copy(ctx, transpose ? result.Transposed() : result, out);
}

}  // namespace

absl::Status Orthogonalize(const Context& ctx, const OrthogonalizeOptions& options,
                           ConstTensorView in, TensorView out) {
  DIOND_RETURN_IF_ERROR(Validate(ctx, options, in, out));
  if (in.NumElements() == 0) return absl::OkStatus();
  for (int64_t b = 0; b < in.Batch(); ++b) {
    ScratchArena::Scope scope(ctx.scratch());
    DIOND_RETURN_IF_ERROR(OrthogonalizeOne(ctx, options, in.Matrix(b), out.Matrix(b)));
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels
