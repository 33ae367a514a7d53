// The per-element loops of a Step on a trainer's memory (session_internal.h).
#include <cstring>

#include "kernels/tensor.h"
#include "server/session/session_internal.h"

namespace diond::session::internal {
namespace {

using kernels::BFloat16;
using kernels::Float16;

// NaN and ±Inf are exactly the values whose exponent bits are all ones. An integer OR reduction
// over that test vectorizes without -ffast-math (a float sum would not: its order matters).
inline uint32_t NonFiniteBit(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
}

template <typename T, typename Widen>
bool WidenScaleLoop(const T* s, int64_t n, float scale, float* out, Widen widen) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(s[i]) * scale;
    out[i] = v;
    bad |= NonFiniteBit(v);
  }
  return bad == 0;
}

}  // namespace

void WidenToF32(DType dtype, const uint8_t* src, int64_t n, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBf16: {
      const auto* s = reinterpret_cast<const BFloat16*>(src);
      for (int64_t i = 0; i < n; ++i) out[i] = kernels::Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = reinterpret_cast<const Float16*>(src);
      for (int64_t i = 0; i < n; ++i) out[i] = kernels::F16ToFloat(s[i]);
      return;
    }
  }
}

void NarrowFromF32(DType dtype, const float* in, int64_t n, uint8_t* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, in, static_cast<size_t>(n) * 4);
      return;
    case DType::kBf16: {
      auto* d = reinterpret_cast<BFloat16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = kernels::FloatToBf16(in[i]);
      return;
    }
    case DType::kF16: {
      auto* d = reinterpret_cast<Float16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = kernels::FloatToF16(in[i]);
      return;
    }
  }
}

bool WidenScaleCheckFinite(DType dtype, const uint8_t* src, int64_t n, float scale, float* out) {
  switch (dtype) {
    case DType::kF32:
      return WidenScaleLoop(reinterpret_cast<const float*>(src), n, scale, out,
                            [](float v) { return v; });
    case DType::kBf16:
      return WidenScaleLoop(reinterpret_cast<const BFloat16*>(src), n, scale, out,
                            [](BFloat16 v) { return kernels::Bf16ToFloat(v); });
    case DType::kF16:
      return WidenScaleLoop(reinterpret_cast<const Float16*>(src), n, scale, out,
                            [](Float16 v) { return kernels::F16ToFloat(v); });
  }
  return false;
}

bool AllFinite(const float* p, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= NonFiniteBit(p[i]);
  return bad == 0;
}

uint64_t Fnv1a64(const float* p, int64_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  for (int64_t i = 0; i < n * 4; ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace diond::session::internal
