// AdamW (ALGORITHMS.md §13.1, fused semantics §20.6) and Lion (§13.3, §20.7), any shape.
// The megabatch family's AdamW counts steps per parameter in `step_dev` (advanced only when the
// parameter has a gradient, P17).
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"

namespace diond::optim::internal {
namespace {

class ScalarRule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    if (config.algorithm == AlgorithmKind::kLion) return {{std::string(kStateMomentum), shape}};
    return {{std::string(kStateMomentum), shape},
            {std::string(kStateVariance), shape},
            {std::string(kStateStepDev), {}}};
  }

  // One fused op per parameter, which fails only on arguments that Step has validated.
  bool InPlace() const override { return true; }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& a) const override {
    const GroupConfig& cfg = *a.config;
    const Hyperparams& h = cfg.hyperparams;
    const kernels::Device dev = ctx.device();  // every pointer of `a` is on it
    int64_t numel = 1;
    for (int64_t d : *a.shape) numel *= d;
    for (int64_t p = 0; p < a.count; ++p) {
      const int64_t off = p * numel;
      // step_dev is an f32 counter incremented before the kernel (§13.1). The kernel needs the
      // step on the host (its bias corrections): it comes from the host mirror GroupOptimizer
      // keeps (a.step_count), and the device copy is advanced by an op below, by the same f32
      // addition (1·x + 1 == x + 1), so nothing is read back.
      const bool adamw = cfg.algorithm == AlgorithmKind::kAdamW;
      const float step_dev = adamw ? *a.step_count[static_cast<size_t>(p)] : 0.0f;
      const float next = step_dev + 1.0f;
      if (numel > 0) {
        kernels::TensorView x = Vec(a.x + off, numel, dev);
        kernels::ConstTensorView g = CVec(a.g[p], numel, dev);
        kernels::TensorView m = Vec(a.state[0] + off, numel, dev);
        // Σ(Δx)² of this parameter, in the same pass (GroupOptimizer's in-place path).
        kernels::TensorView sq;
        if (a.update_sq != nullptr) sq = Vec(a.update_sq + p, 1, dev);
        if (cfg.algorithm == AlgorithmKind::kLion) {
          kernels::LionParams lp;
          lp.lr = a.scalars.lr;
          lp.beta1 = F32(h.beta1);
          lp.beta2 = F32(h.beta2);
          lp.weight_decay = a.scalars.weight_decay;
          lp.cautious = h.cautious_wd;
          DIOND_RETURN_IF_ERROR(sq.data() != nullptr ? kernels::LionStep(ctx, lp, g, x, m, sq)
                                                     : kernels::LionStep(ctx, lp, g, x, m));
        } else {
          kernels::TensorView v = Vec(a.state[1] + off, numel, dev);
          kernels::AdamWParams ap;
          ap.lr = a.scalars.lr;
          ap.beta1 = F32(h.beta1);
          ap.beta2 = F32(h.beta2);
          ap.epsilon = F32(h.epsilon);
          ap.weight_decay = a.scalars.weight_decay;
          ap.step = static_cast<int64_t>(next);
          ap.cautious = h.cautious_wd;
          DIOND_RETURN_IF_ERROR(sq.data() != nullptr ? kernels::AdamWStep(ctx, ap, g, x, m, v, sq)
                                                     : kernels::AdamWStep(ctx, ap, g, x, m, v));
        }
      }
      if (adamw) {
        kernels::TensorView sd = Vec(a.state[2] + p, 1, dev);
        DIOND_RETURN_IF_ERROR(kernels::AddScalar(ctx, 1.0f, sd, 1.0f, sd));
        *a.step_count[static_cast<size_t>(p)] = next;
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<UpdateRule> MakeScalarRule() { return std::make_unique<ScalarRule>(); }

}  // namespace diond::optim::internal
