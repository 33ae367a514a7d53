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

absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  const float* yp = static_cast<const float*>(y.data());
  float* op = static_cast<float*>(out.data());
  if (alpha == 0.0f) {
    ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        op[i] = math::Bf16RoundedAxpbyElement(0.0f, 0.0f, beta, yp[i], /*with_x=*/false);
      }
    });
  } else {
    const float* xp = static_cast<const float*>(x.data());
    ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        op[i] = math::Bf16RoundedAxpbyElement(alpha, xp[i], beta, yp[i], /*with_x=*/true);
      }
    });
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
