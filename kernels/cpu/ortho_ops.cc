// The orthogonalizers' ops of kernels/ops.h (ortho block): AddToDiagonal, Bf16RoundedAxpby.
#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels::cpu {

absl::Status AddToDiagonal(const Context& ctx, float value, TensorView a) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t n = a.Rows();
  const TensorLayout& l = a.layout();
  float* base = static_cast<float*>(a.data());
  for (int64_t b = 0; b < a.Batch(); ++b) {
    float* m = base + b * l.BatchStride();
    for (int64_t i = 0; i < n; ++i) m[i * l.RowStride() + i] += value;
  }
  return absl::OkStatus();
}

namespace {
// The loops of Bf16RoundedAxpby as cloned range kernels (DIOND_CPU_CLONES, loops.h): integer
// rounding and f32 products only, so every clone gives the same bits.
DIOND_CPU_CLONES void Bf16RoundedScaleRange(float beta, const float* y, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = math::Bf16RoundedAxpbyElement(0.0f, 0.0f, beta, y[i], /*with_x=*/false);
  }
}
DIOND_CPU_CLONES void Bf16RoundedAxpbyRange(float alpha, const float* x, float beta, const float* y,
                                            float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = math::Bf16RoundedAxpbyElement(alpha, x[i], beta, y[i], /*with_x=*/true);
  }
}
// bf16 storage: the same element function on the widened values (exact), narrowed (exact: the
// value is bf16-representable already).
DIOND_CPU_CLONES void Bf16StorageScaleRange(float beta, const BFloat16* y, BFloat16* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = FloatToBf16(math::Bf16RoundedAxpbyElement(0.0f, 0.0f, beta, Bf16ToFloat(y[i]),
                                                     /*with_x=*/false));
  }
}
DIOND_CPU_CLONES void Bf16StorageAxpbyRange(float alpha, const BFloat16* x, float beta,
                                            const BFloat16* y, BFloat16* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = FloatToBf16(math::Bf16RoundedAxpbyElement(alpha, Bf16ToFloat(x[i]), beta,
                                                     Bf16ToFloat(y[i]), /*with_x=*/true));
  }
}
}  // namespace

absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  if (out.dtype() == DType::kBf16) {
    const auto* yb = static_cast<const BFloat16*>(y.data());
    auto* ob = static_cast<BFloat16*>(out.data());
    if (alpha == 0.0f) {
      ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
        Bf16StorageScaleRange(beta, yb + b, ob + b, e - b);
      });
    } else {
      const auto* xb = static_cast<const BFloat16*>(x.data());
      ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
        Bf16StorageAxpbyRange(alpha, xb + b, beta, yb + b, ob + b, e - b);
      });
    }
    return absl::OkStatus();
  }
  const float* yp = static_cast<const float*>(y.data());
  float* op = static_cast<float*>(out.data());
  if (alpha == 0.0f) {
    ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
      Bf16RoundedScaleRange(beta, yp + b, op + b, e - b);
    });
  } else {
    const float* xp = static_cast<const float*>(x.data());
    ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
      Bf16RoundedAxpbyRange(alpha, xp + b, beta, yp + b, op + b, e - b);
    });
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
