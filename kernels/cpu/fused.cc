// Fused optimizer-step kernels of kernels/ops.h: AdamWStep, LionStep and
// the kops block (tracked AdamW/Lion, MomentumUpdate, ApplyUpdate, NormalizeNeurons).
#include <omp.h>

#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"
#include "kernels/cpu/backend.h"

namespace diond::kernels::cpu {

namespace {

// Scalars as PyTorch 2.x's fused CPU AdamW forms them (conformance README §5 item 6): double
// arithmetic on the f32 hyperparameters, cast to f32 at use.
math::AdamWScalars AdamWScalarsOf(const AdamWParams& p) {
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
  return s;
}

// f32 arithmetic on f32 hyperparameters (ALGORITHMS.md §0: 0-d f32 tensors).
math::LionScalars LionScalarsOf(const LionParams& p) {
  math::LionScalars s;
  s.w1 = 1.0f - p.beta1;
  s.w2 = 1.0f - p.beta2;
  s.lr_wd = p.lr * p.weight_decay;
  s.decay = 1.0f - s.lr_wd;
  s.lr = p.lr;
  s.cautious = p.cautious;
  return s;
}

inline double Sq(float after, float before) {
  const double d = static_cast<double>(after) - static_cast<double>(before);
  return d * d;
}

}  // namespace

absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                       TensorView x, TensorView m, TensorView v) {
  cpu::ApplyThreadPolicy(ctx);
  const math::AdamWScalars s = AdamWScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) math::AdamWElement(s, gp[i], xp[i], mp[i], vp[i]);
  });
  return absl::OkStatus();
}

absl::Status AdamWStepTracked(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                              TensorView x, TensorView m, TensorView v, TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const math::AdamWScalars s = AdamWScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  const double sq = cpu::ParallelSum(x.NumElements(), [&](int64_t b, int64_t e) {
    double acc = 0.0;
    for (int64_t i = b; i < e; ++i) {
      const float before = xp[i];
      math::AdamWElement(s, gp[i], xp[i], mp[i], vp[i]);
      acc += Sq(xp[i], before);
    }
    return acc;
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  cpu::ApplyThreadPolicy(ctx);
  const math::LionScalars s = LionScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) math::LionElement(s, gp[i], xp[i], mp[i]);
  });
  return absl::OkStatus();
}

absl::Status LionStepTracked(const Context& ctx, const LionParams& p, ConstTensorView grad,
                             TensorView x, TensorView m, TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const math::LionScalars s = LionScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  const double sq = cpu::ParallelSum(x.NumElements(), [&](int64_t b, int64_t e) {
    double acc = 0.0;
    for (int64_t i = b; i < e; ++i) {
      const float before = xp[i];
      math::LionElement(s, gp[i], xp[i], mp[i]);
      acc += Sq(xp[i], before);
    }
    return acc;
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u) {
  cpu::ApplyThreadPolicy(ctx);
  const float* gp = grad.As<float>();
  const float* ip = m_in.As<float>();
  float* mp = m.As<float>();
  float* up = u.As<float>();
  cpu::ParallelRange(m.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mi = ip[i];
      up[i] = nesterov ? math::MomentumElement(mu, true, gp[i], mi)
                       : math::MomentumElement(mu, false, gp[i], mi);
      mp[i] = mi;
    }
  });
  return absl::OkStatus();
}

absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x) {
  cpu::ApplyThreadPolicy(ctx);
  math::ApplyUpdateScalars s;
  s.alpha = p.alpha;
  s.lr_wd = p.lr_wd;
  s.decay = 1.0f - p.lr_wd;
  s.cautious = p.cautious;
  s.round_bf16 = p.round_bf16;
  const float* up = update.As<float>();
  const float* ip = x_in.As<float>();
  float* xp = x.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) xp[i] = math::ApplyUpdateElement(s, ip[i], up[i]);
  });
  return absl::OkStatus();
}

absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v) {
  cpu::ApplyThreadPolicy(ctx);
  const int r = o.rank();
  const int64_t batch = r == 3 ? o.dim(0) : 1;
  const int64_t rows = o.dim(r - 2), cols = o.dim(r - 1);
  const float fcols = static_cast<float>(cols);
  float* const op = o.As<float>();
  float* const vp = v.As<float>();
  // One unit per iteration; within a unit every sum runs in element order.
  auto unit = [&](int64_t b) {
    float* u = op + b * rows * cols;
    float* vu = vp + b * rows;
    double f2 = 0.0;
    for (int64_t e = 0; e < rows * cols; ++e) f2 += static_cast<double>(u[e]) * u[e];
    for (int64_t i = 0; i < rows; ++i) {
      const float* row = u + i * cols;
      double ss = 0.0;
      for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(row[c]) * row[c];
      vu[i] = math::NeuronVarianceElement(vu[i], ss, fcols, w);
    }
    double d2 = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
      const float denom = math::NeuronDenominator(vu[i]);
      float* row = u + i * cols;
      for (int64_t c = 0; c < cols; ++c) {
        row[c] = row[c] / denom;
        d2 += static_cast<double>(row[c]) * row[c];
      }
    }
    const float scale = math::NeuronRescale(f2, d2);
    for (int64_t e = 0; e < rows * cols; ++e) u[e] *= scale;
  };
  if (batch > 1 && omp_get_max_threads() > 1 && rows * cols * batch >= cpu::kParallelGrain) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < batch; ++b) unit(b);
  } else {
    for (int64_t b = 0; b < batch; ++b) unit(b);
  }
  return absl::OkStatus();
}

absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const float* sp = src.As<float>();
  float* dp = dst.As<float>();
  const double sq = cpu::ParallelSum(dst.NumElements(), [&](int64_t b, int64_t e) {
    double acc = 0.0;
    for (int64_t i = b; i < e; ++i) {
      acc += Sq(sp[i], dp[i]);
      dp[i] = sp[i];
    }
    return acc;
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
