// Fused optimizer-step kernels of kernels/ops.h: CautiousWeightDecay, AdamWStep, LionStep.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/validate.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace cpu {
float LerpF32(float start, float end, float weight);  // elementwise.cc
}  // namespace cpu

namespace {

using cpu::Invalid;

// All views contiguous f32 of x's shape (direction/grad may be any float dtype when allowed).
absl::Status CheckF32Like(const Context& ctx, const char* op, const char* name,
                          ConstTensorView v, ConstTensorView x, bool any_dtype = false) {
  DIOND_RETURN_IF_ERROR(cpu::CheckContiguous(ctx, op, name, v));
  if (!any_dtype) DIOND_RETURN_IF_ERROR(cpu::CheckDType(op, name, v.layout(), DType::kF32));
  if (!cpu::SameShape(v.layout(), x.layout())) {
    return Invalid(op, name, " is ", v.DebugString(), ", want the shape of x ", x.DebugString());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CautiousWeightDecay(const Context& ctx, float decay, ConstTensorView direction,
                                 TensorView x) {
  constexpr const char* kOp = "CautiousWeightDecay";
  DIOND_RETURN_IF_ERROR(cpu::CheckContext(ctx, kOp));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "direction", direction, x, /*any_dtype=*/true));
  DIOND_RETURN_IF_ERROR(cpu::CheckFinite(kOp, "decay", decay));
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
  constexpr const char* kOp = "AdamWStep";
  DIOND_RETURN_IF_ERROR(cpu::CheckContext(ctx, kOp));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "grad", grad, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m", m, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "v", v, x));
  for (auto [name, val] : {std::pair<const char*, float>{"lr", p.lr}, {"beta1", p.beta1},
                           {"beta2", p.beta2}, {"epsilon", p.epsilon},
                           {"weight_decay", p.weight_decay}}) {
    DIOND_RETURN_IF_ERROR(cpu::CheckFinite(kOp, name, val));
  }
  if (p.step < 1) return Invalid(kOp, "step is ", p.step, ", want >= 1");
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f)) {
    return Invalid(kOp, "betas (", p.beta1, ", ", p.beta2, ") must lie in [0, 1)");
  }
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
  constexpr const char* kOp = "LionStep";
  DIOND_RETURN_IF_ERROR(cpu::CheckContext(ctx, kOp));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "grad", grad, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m", m, x));
  for (auto [name, val] : {std::pair<const char*, float>{"lr", p.lr}, {"beta1", p.beta1},
                           {"beta2", p.beta2}, {"weight_decay", p.weight_decay}}) {
    DIOND_RETURN_IF_ERROR(cpu::CheckFinite(kOp, name, val));
  }
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

}  // namespace diond::kernels
