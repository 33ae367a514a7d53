// Fused optimizer-step kernels of kernels/ops.h: CautiousWeightDecay, AdamWStep, LionStep.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"
#include "kernels/cpu/backend.h"

namespace diond::kernels::cpu {

absl::Status CautiousWeightDecay(const Context& ctx, float decay, ConstTensorView direction,
                                 TensorView x) {
  cpu::ApplyThreadPolicy(ctx);
  float* xp = x.As<float>();
  cpu::DispatchDType(direction.dtype(), [&](auto dt) {
    using D = decltype(dt);
    const D* dp = static_cast<const D*>(direction.data());
    cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        xp[i] = math::CautiousDecayElement(decay, xp[i], cpu::ToF32(dp[i]));
      }
    });
  });
  return absl::OkStatus();
}

absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                       TensorView x, TensorView m, TensorView v) {
  cpu::ApplyThreadPolicy(ctx);
  // Scalars as PyTorch 2.x's fused CPU AdamW forms them (conformance README §5 item 6): double
  // arithmetic on the f32 hyperparameters, cast to f32 at use.
  const double lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(p.step));
  math::AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.lr_wd = static_cast<float>(lr * wd);
  s.one_minus_b1 = static_cast<float>(1.0 - b1);
  s.one_minus_b2 = static_cast<float>(1.0 - b2);
  s.beta2 = p.beta2;
  s.step_size = static_cast<float>(-lr / bc1);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  s.eps = p.epsilon;
  s.cautious = p.cautious;
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) math::AdamWElement(s, gp[i], xp[i], mp[i], vp[i]);
  });
  return absl::OkStatus();
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  cpu::ApplyThreadPolicy(ctx);
  // f32 arithmetic on f32 hyperparameters (ALGORITHMS.md §0: 0-d f32 tensors).
  math::LionScalars s;
  s.w1 = 1.0f - p.beta1;
  s.w2 = 1.0f - p.beta2;
  s.lr_wd = p.lr * p.weight_decay;
  s.decay = 1.0f - s.lr_wd;
  s.lr = p.lr;
  s.cautious = p.cautious;
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) math::LionElement(s, gp[i], xp[i], mp[i]);
  });
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
