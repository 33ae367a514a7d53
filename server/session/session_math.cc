// The conversions between a trainer's dtype and fp32 outside a Step (registration, SetState,
// restore, hand-over between trainers), and the views a Step's ops take (session_internal.h).
// A Step's own passes are ops of kernels/ops.h.
#include <cstring>

#include "kernels/tensor.h"
#include "server/session/session_internal.h"

namespace diond::session::internal {
namespace {

using kernels::BFloat16;
using kernels::Float16;

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

kernels::ConstTensorView HostView(DType dtype, const void* p, int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(dtype, {n}));
}

kernels::TensorView HostView(DType dtype, void* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(dtype, {n}));
}

}  // namespace diond::session::internal
