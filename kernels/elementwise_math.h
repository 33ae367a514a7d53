// The per-element arithmetic of the elementwise and fused ops, written once for every backend.
//
// Each function here is the whole math of one element of one op. The CPU backend's loops
// (kernels/cpu/) call these functions, and the CUDA backend's kernels (kernels/cuda/) call the
// same ones, so the CPU tests and the conformance vectors cover the arithmetic of every GPU
// kernel (docs/KERNELS.md). Nothing here allocates, branches on a device or touches memory other
// than its arguments. Scalars that an op forms once per call (bias corrections, step sizes) are
// made by the op's host code, in the order the reference forms them, and passed in a struct.
//
// Rules for an entry: plain float arithmetic with the rounding the op documents (std::fma only
// where the reference fuses); no library calls but the <cmath> ones CUDA also provides as device
// functions (sqrtf, fabsf, fmaf); marked DIOND_HD.
#ifndef DIOND_KERNELS_ELEMENTWISE_MATH_H_
#define DIOND_KERNELS_ELEMENTWISE_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DIOND_HD __host__ __device__ __forceinline__
#else
#define DIOND_HD inline
#endif

namespace diond::kernels::math {

// PyTorch's lerp (aten/src/ATen/native/Lerp.h): two branches so that weight 1 returns `end`
// exactly and large weights lose less precision.
DIOND_HD float Lerp(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? start + weight * (end - start)
                              : end - (end - start) * (1.0f - weight);
}

DIOND_HD float Sign(float v) { return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f); }

// ---- DecayScatterWithChange (Dion2's parameter write, ALGORITHMS.md §7.2 steps 10-11) -------
// An element outside the selected slices decays; a selected one takes the update on top of the
// decayed value: alpha·s + decay·x, the values of Scale(decay) then Scatter(alpha, beta = 1).
DIOND_HD float DecayElement(float decay, float x) { return decay * x; }
DIOND_HD float DecayScatterElement(float decay, float alpha, float x, float s) {
  const float d = decay * x;
  return alpha * s + d;
}

// ---- AdamW (ALGORITHMS.md §20.6) ----------------------------------------------------------
// The per-call scalars, as PyTorch 2.x's fused CPU AdamW forms them (double arithmetic on the f32
// hyperparameters, cast to f32 at use); the CPU backend's AdamWStep (kernels/cpu/fused.cc)
// builds them.
struct AdamWScalars {
  float decay;         // 1 - lr*wd
  float lr_wd;         // lr*wd (cautious undo)
  float one_minus_b1;  // 1 - beta1
  float one_minus_b2;  // 1 - beta2
  float beta2;
  float step_size;  // -lr / (1 - beta1^t)
  float sqrt_bc2;   // sqrt(1 - beta2^t)
  float eps;
  bool cautious;
};

// One element: x, m, v are read and written in place; g is the gradient.
DIOND_HD void AdamWElement(const AdamWScalars& s, float g, float& x, float& m, float& v) {
  const float x0 = x;
  float xi = x0 * s.decay;
  const float mi = fmaf(s.one_minus_b1, g - m, m);
  const float vi = v * s.beta2 + (s.one_minus_b2 * g) * g;
  xi += (s.step_size * mi) / (sqrtf(vi) / s.sqrt_bc2 + s.eps);
  if (s.cautious && mi * x0 < 0.0f) xi += s.lr_wd * x0;
  m = mi;
  v = vi;
  x = xi;
}

// ---- Lion (ALGORITHMS.md §20.7) -----------------------------------------------------------
// f32 arithmetic on the f32 hyperparameters (ALGORITHMS.md §0: 0-d f32 tensors).
struct LionScalars {
  float w1;     // 1 - beta1
  float w2;     // 1 - beta2
  float lr_wd;  // lr*wd
  float decay;  // 1 - lr*wd
  float lr;
  bool cautious;
};

DIOND_HD void LionElement(const LionScalars& s, float g, float& x, float& m) {
  const float mi = m;
  const float u = Sign(Lerp(mi, g, s.w1));
  m = Lerp(mi, g, s.w2);
  float xi = x;
  if (s.cautious) {
    if (xi * u >= 0.0f) xi = xi - s.lr_wd * xi;
  } else {
    xi = xi * s.decay;
  }
  x = xi - s.lr * u;
}

// ---- kops: the fused phases of the matrix rules (Muon, NorMuon, Dion2, NorDion2) -------------

// RNE rounding of an f32 value to the bf16 grid, kept in f32 (NaN stays NaN, quieted); the same
// bits as kernels::RoundToBf16 (kernels/tensor.h), written here so device code can call it.
DIOND_HD float RoundToBf16Grid(float f) {
  unsigned int u;
  memcpy(&u, &f, 4);
  const unsigned int rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const unsigned int quiet_nan = (u & 0xffff0000u) | 0x00400000u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  const unsigned int r = is_nan ? quiet_nan : rounded;
  float out;
  memcpy(&out, &r, 4);
  return out;
}

// Momentum (ALGORITHMS.md §20.1 steps 1-2): m ← μ·m + g, then the direction
// u = μ·m + g (Nesterov, with the new m) or u = m. f32 arithmetic, no fused multiply-add.
DIOND_HD float MomentumElement(float mu, bool nesterov, float g, float& m) {
  const float mi = mu * m + g;
  m = mi;
  return nesterov ? mu * mi + g : mi;
}

// Weight decay and update apply (§20.1 steps 5-7): decay with the base lr, then x ← x − α·u,
// where the product α·u is rounded to bf16 first when `round_bf16` (Muon's bf16 O times an f32
// 0-d α stays bf16, §5.3 step 7).
struct ApplyUpdateScalars {
  float alpha;  // the (adjusted) step size
  float decay;  // 1 − lr·wd, formed in f32
  float lr_wd;  // lr·wd (cautious decay)
  bool cautious;
  bool round_bf16;
};

DIOND_HD float ApplyUpdateElement(const ApplyUpdateScalars& s, float x, float u) {
  if (s.cautious) {
    if (x * u >= 0.0f) x = x - s.lr_wd * x;
  } else {
    x = x * s.decay;
  }
  float step = s.alpha * u;
  if (s.round_bf16) step = RoundToBf16Grid(step);
  return x - step;
}

// ---- The order of every row sum (AxisNorms by rows, FrobeniusNorm, TopKByL1Norm by rows,
// NormalizeNeurons) ------------------------------------------------------------------------------
// The terms t_0..t_{n-1} of one row are added in double into kRowSumLanes interleaved lanes
// (term j into lane j % kRowSumLanes, in increasing j), and the lanes are then folded pairwise:
// for h = 16, 8, 4, 2, 1, lane l += lane l + h for every l < h; the sum is lane 0. A CUDA warp
// is exactly that (lane = thread; the fold is __shfl_down_sync by 16, 8, 4, 2, 1), and the CPU
// runs it with 32 accumulators per row, so the two agree bit for bit for every row length: a
// fixed order that a warp reads coalesced. Column sums stay in row order (one chain per column:
// adjacent GPU threads already read adjacent columns).
inline constexpr int kRowSumLanes = 32;
DIOND_HD double FoldRowSumLanes(double* lanes) {
  for (int h = kRowSumLanes / 2; h > 0; h /= 2) {
    for (int l = 0; l < h; ++l) lanes[l] += lanes[l + h];
  }
  return lanes[0];
}

// NorMuon's neuron-wise normalization (§6.2 steps 5-10), per row r of one rows×cols unit:
//   ν_r = (Σ_c o²) / cols in f32 (the double row sum rounded first); V_r ← lerp(V_r, ν_r, w);
//   D = O / (√V_r + 1e-8)  (the 1e-8 literals are hard-coded upstream, P9);
//   D ← D · (‖O‖_F / max(‖D‖_F, 1e-8)).
DIOND_HD float NeuronVarianceElement(float v, double row_sum_sq, float cols, float w) {
  const float nu = static_cast<float>(row_sum_sq) / cols;
  return w < 0.5f ? v + w * (nu - v) : nu - (nu - v) * (1.0f - w);
}
DIOND_HD float NeuronDenominator(float v) { return sqrtf(v) + 1e-8f; }
DIOND_HD float NeuronRescale(double o_sum_sq, double d_sum_sq) {
  const float f = static_cast<float>(sqrt(o_sum_sq));
  const float d = static_cast<float>(sqrt(d_sum_sq));
  return f / (d < 1e-8f ? 1e-8f : d);
}

// ---- ortho: bf16 rounding points of the reference's eager bf16 arithmetic, on f32 storage -----
// RoundToBf16Precision(f) is the f32 value of f rounded to bf16, round-to-nearest-even, NaN kept
// a (quiet) NaN: bit for bit what FloatToBf16 followed by Bf16ToFloat (kernels/tensor.h) give.
DIOND_HD float RoundToBf16Precision(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (u & 0xffff0000u) | 0x00400000u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t r = is_nan ? quiet_nan : rounded;
  float out;
  memcpy(&out, &r, 4);
  return out;
}

// One element of Bf16RoundedAxpby (ops.h): r(r(alpha·x) + r(beta·r(y))), r = RoundToBf16Precision;
// with_x false: r(beta·r(y)) (x not read).
DIOND_HD float Bf16RoundedAxpbyElement(float alpha, float x, float beta, float y, bool with_x) {
  const float ry = RoundToBf16Precision(beta * RoundToBf16Precision(y));
  return with_x ? RoundToBf16Precision(RoundToBf16Precision(alpha * x) + ry) : ry;
}

// ---- cuda: the order of TopK / TopKByL1Norm (ops.h), for the CPU and the CUDA radix sort -------
// TopK ranks larger scores first, equal scores by lower index first, NaN below every number
// (and -0 equal to +0). TopKOrderKey maps a score to an unsigned key whose descending order is
// that score order with the ties intact: NaN → 0 (below -Inf's key), ±0 → one key, and otherwise
// the IEEE bits flipped so that unsigned comparison orders like the floats. The CUDA backend
// sorts (key, index) pairs with CUB's stable descending radix sort over indices given in
// ascending order, which keeps lower indices first among equal keys: TopKBefore is that order.
DIOND_HD uint32_t TopKOrderKey(float score) {
  if (score != score) return 0u;
  if (score == 0.0f) score = 0.0f;  // -0 → +0
  uint32_t u;
  memcpy(&u, &score, sizeof(u));
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

// True when (score_a at index_a) ranks before (score_b at index_b).
DIOND_HD bool TopKBefore(float score_a, int64_t index_a, float score_b, int64_t index_b) {
  const uint32_t ka = TopKOrderKey(score_a), kb = TopKOrderKey(score_b);
  return ka != kb ? ka > kb : index_a < index_b;
}

// ---- cuda: storage conversions and the per-element math of Unary / Binary, shared with the GPU --
// bf16 <-> f32 exactly as kernels/tensor.h's FloatToBf16 / Bf16ToFloat (RNE; NaN kept quiet with
// its sign; overflow to ±Inf), on 16-bit patterns so that device code needs no tensor.h.
DIOND_HD uint16_t Bf16BitsFromFloat(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}
DIOND_HD float FloatFromBf16Bits(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Op codes: the values of kernels::UnaryOp / BinaryOp (static_assert'ed in
// kernels/plugin_backend.cc).
enum : int {
  kUnarySign = 0,
  kUnaryAbs = 1,
  kUnarySqrt = 2,
  kUnarySquare = 3,
  kUnaryNeg = 4,
  kUnaryNanToNum = 5,
};
enum : int {
  kBinaryAdd = 0,
  kBinarySub = 1,
  kBinaryMul = 2,
  kBinaryDiv = 3,
  kBinaryMax = 4,
  kBinaryMin = 5
};

DIOND_HD float QuietNan() {
  const uint32_t u = 0x7fc00000u;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// ops.h Unary: sign(±0) = sign(NaN) = 0; nan_to_num maps NaN → 0, ±Inf → ±FLT_MAX.
DIOND_HD float UnaryElement(int op, float v) {
  switch (op) {
    case kUnarySign:
      return Sign(v);
    case kUnaryAbs:
      return fabsf(v);
    case kUnarySqrt:
      return sqrtf(v);
    case kUnarySquare:
      return v * v;
    case kUnaryNeg:
      return -v;
    default: {                            // kUnaryNanToNum
      const float big = 3.40282347e+38f;  // FLT_MAX
      return v != v ? 0.0f : (fabsf(v) == INFINITY ? (v > 0.0f ? big : -big) : v);
    }
  }
}

// ops.h Binary: max/min propagate NaN (torch.maximum / torch.minimum).
DIOND_HD float BinaryElement(int op, float a, float b) {
  switch (op) {
    case kBinaryAdd:
      return a + b;
    case kBinarySub:
      return a - b;
    case kBinaryMul:
      return a * b;
    case kBinaryDiv:
      return a / b;
    case kBinaryMax:
      return (a != a || b != b) ? QuietNan() : (a > b ? a : b);
    default:
      return (a != a || b != b) ? QuietNan() : (a < b ? a : b);  // kBinaryMin
  }
}

// The per-call scalars of AdamW / Lion, formed on the host exactly as kernels/cpu/fused.cc forms
// them (double arithmetic on the f32 hyperparameters for AdamW, f32 for Lion), so that a device
// backend gets the same bits; tested against the CPU AdamWStep / LionStep.
inline AdamWScalars MakeAdamWScalars(float lr_f, float beta1, float beta2, float epsilon,
                                     float weight_decay, int64_t step, bool cautious) {
  const double lr = lr_f, wd = weight_decay, b1 = beta1, b2 = beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.lr_wd = static_cast<float>(lr * wd);
  s.one_minus_b1 = static_cast<float>(1.0 - b1);
  s.one_minus_b2 = static_cast<float>(1.0 - b2);
  s.beta2 = beta2;
  s.step_size = static_cast<float>(-lr / bc1);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  s.eps = epsilon;
  s.cautious = cautious;
  return s;
}
inline LionScalars MakeLionScalars(float lr, float beta1, float beta2, float weight_decay,
                                   bool cautious) {
  LionScalars s;
  s.w1 = 1.0f - beta1;
  s.w2 = 1.0f - beta2;
  s.lr_wd = lr * weight_decay;
  s.decay = 1.0f - s.lr_wd;
  s.lr = lr;
  s.cautious = cautious;
  return s;
}

// ---- steps (server/session: a Step's passes over a trainer's memory) -------------------------
// 1 when v is NaN or ±Inf (all exponent bits set), else 0: an integer test whose OR-reduction
// vectorizes without -ffast-math (a float comparison chain or sum would not).
DIOND_HD unsigned NonFiniteBit(float v) {
  unsigned bits;
  memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
}

// One step of FNV-1a 64 over one byte.
DIOND_HD unsigned long long Fnv1aByte(unsigned long long h, unsigned char b) {
  return (h ^ b) * 0x100000001b3ull;
}

// ---- kops (wire): ApplyUpdate's per-call scalars, formed as kernels/cpu/fused.cc forms them
// (1 − lr·wd in f32), so that a device backend gets the same bits.
inline ApplyUpdateScalars MakeApplyUpdateScalars(float alpha, float lr_wd, bool cautious,
                                                 bool round_bf16) {
  ApplyUpdateScalars s;
  s.alpha = alpha;
  s.lr_wd = lr_wd;
  s.decay = 1.0f - lr_wd;
  s.cautious = cautious;
  s.round_bf16 = round_bf16;
  return s;
}

}  // namespace diond::kernels::math

#endif  // DIOND_KERNELS_ELEMENTWISE_MATH_H_
