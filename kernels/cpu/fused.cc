// Fused optimizer-step kernels of kernels/ops.h: CautiousWeightDecay, AdamWStep, LionStep.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
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
        const float xi = xp[i];
        if (xi * cpu::ToF32(dp[i]) >= 0.0f) xp[i] = xi - decay * xi;
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
  const float decay = static_cast<float>(1.0 - lr * wd);
  const float lr_wd = static_cast<float>(lr * wd);
  const float one_minus_b1 = static_cast<float>(1.0 - b1);
  const float one_minus_b2 = static_cast<float>(1.0 - b2);
  const float beta2 = p.beta2;
  const float step_size = static_cast<float>(-lr / bc1);
  const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  const float eps = p.epsilon;
  const bool cautious = p.cautious;
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float x0 = xp[i], g = gp[i];
      float xi = x0 * decay;
      const float mi = std::fma(one_minus_b1, g - mp[i], mp[i]);
      const float vi = vp[i] * beta2 + (one_minus_b2 * g) * g;
      xi += (step_size * mi) / (std::sqrt(vi) / sqrt_bc2 + eps);
      if (cautious && mi * x0 < 0.0f) xi += lr_wd * x0;
      mp[i] = mi;
      vp[i] = vi;
      xp[i] = xi;
    }
  });
  return absl::OkStatus();
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  cpu::ApplyThreadPolicy(ctx);
  // f32 arithmetic on f32 hyperparameters (ALGORITHMS.md §0: 0-d f32 tensors).
  const float w1 = 1.0f - p.beta1, w2 = 1.0f - p.beta2;
  const float lr_wd = p.lr * p.weight_decay;
  const float decay = 1.0f - lr_wd;
  const float lr = p.lr;
  const bool cautious = p.cautious;
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float g = gp[i], mi = mp[i];
      const float c = cpu::LerpF32(mi, g, w1);
      const float u = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
      mp[i] = cpu::LerpF32(mi, g, w2);
      float xi = xp[i];
      if (cautious) {
        if (xi * u >= 0.0f) xi = xi - lr_wd * xi;
      } else {
        xi = xi * decay;
      }
      xp[i] = xi - lr * u;
    }
  });
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
