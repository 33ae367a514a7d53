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
  float w1;      // 1 - beta1
  float w2;      // 1 - beta2
  float lr_wd;   // lr*wd
  float decay;   // 1 - lr*wd
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

// ---- Cautious weight decay: decay only where x and the update direction agree in sign --------
DIOND_HD float CautiousDecayElement(float decay, float x, float direction) {
  return x * direction >= 0.0f ? x - decay * x : x;
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

}  // namespace diond::kernels::math

#endif  // DIOND_KERNELS_ELEMENTWISE_MATH_H_
