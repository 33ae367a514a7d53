// The session's passes of kernels/ops.h ("steps"): AllFinite, WidenScaleCheckFinite,
// Fnv1aChecksum. Memory-bound: one read (and for the widen one write) per element, split over
// the OpenMP threads; the finiteness flag is an integer OR, so the result never depends on the
// split. The checksum is serial by definition (FNV-1a chains every byte).
#include <atomic>
#include <type_traits>

#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels::cpu {
namespace {

// kbw: the f32 scan (a Step's gradients in place), per ISA (DIOND_CPU_CLONES, loops.h): the OR of
// the non-finite bits, which is exact in any order.
DIOND_CPU_CLONES unsigned NonFiniteF32(const float* p, int64_t n) {
  unsigned local = 0;
  for (int64_t i = 0; i < n; ++i) local |= math::NonFiniteBit(p[i]);
  return local;
}

}  // namespace

absl::Status AllFinite(const Context& ctx, ConstTensorView x, bool* all_finite) {
  ApplyThreadPolicy(ctx);
  std::atomic<unsigned> bad{0};
  DispatchDType(x.dtype(), [&](auto xt) {
    using X = decltype(xt);
    const X* p = x.As<X>();
    ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
      unsigned local = 0;
      if constexpr (std::is_same_v<X, float>) {
        local = NonFiniteF32(p + b, e - b);
      } else {
        for (int64_t i = b; i < e; ++i) local |= math::NonFiniteBit(ToF32(p[i]));
      }
      if (local != 0) bad.fetch_or(local, std::memory_order_relaxed);
    });
  });
  *all_finite = bad.load() == 0;
  return absl::OkStatus();
}

absl::Status WidenScaleCheckFinite(const Context& ctx, ConstTensorView x, float scale,
                                   TensorView out, bool* all_finite) {
  ApplyThreadPolicy(ctx);
  std::atomic<unsigned> bad{0};
  float* o = out.As<float>();
  DispatchDType(x.dtype(), [&](auto xt) {
    using X = decltype(xt);
    const X* p = x.As<X>();
    ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
      unsigned local = 0;
      if (scale == 1.0f) {
        for (int64_t i = b; i < e; ++i) {
          const float v = ToF32(p[i]);
          o[i] = v;
          local |= math::NonFiniteBit(v);
        }
      } else {
        for (int64_t i = b; i < e; ++i) {
          const float v = ToF32(p[i]) * scale;
          o[i] = v;
          local |= math::NonFiniteBit(v);
        }
      }
      if (local != 0) bad.fetch_or(local, std::memory_order_relaxed);
    });
  });
  *all_finite = bad.load() == 0;
  return absl::OkStatus();
}

absl::Status Fnv1aChecksum(const Context& ctx, ConstTensorView x, uint64_t* checksum) {
  (void)ctx;
  const auto* p = static_cast<const unsigned char*>(x.data());
  const int64_t n = x.NumElements() * 4;
  unsigned long long h = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < n; ++i) h = math::Fnv1aByte(h, p[i]);
  *checksum = h;
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
