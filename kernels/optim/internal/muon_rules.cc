// Muon (ALGORITHMS.md §5.3, §20.1) and NorMuon (§6.2, §20.2) for one shape bucket.
#include <vector>

#include "common/status_macros.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"

namespace diond::optim::internal {
namespace {

class MuonRule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    return MomentumStateSpecs(config.algorithm == AlgorithmKind::kNorMuon, shape);
  }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& a) const override {
    const GroupConfig& cfg = *a.config;
    const Hyperparams& h = cfg.hyperparams;
    const bool normuon = cfg.algorithm == AlgorithmKind::kNorMuon;
    const bool bf16 = cfg.precision == Precision::kBf16Reference;
    const ParamShape eff = EffectiveShape(cfg, *a.shape);
    const MatrixBatch units = TrailingMatrices(a.count, eff);  // heads / trailing matrices
    const int64_t total = units.batch * units.MatrixSize();
    const float mu = F32(h.mu);
    float* m = a.state[0];

    // 1-2. M ← μ·M + G; U = μ·M + G (Nesterov) or M.
    // U lives in the context's scratch arena (rewound on return), so steps after the first
    // reuse its block instead of allocating.
    kernels::ScratchArena::Scope scope(ctx.scratch());
    DIOND_ASSIGN_OR_RETURN(kernels::Tensor u_buf,
                           kernels::Tensor::Allocate(kernels::DType::kF32, {total},
                                                     &ctx.scratch()));
    float* const u = u_buf.As<float>();
    for (int64_t i = 0; i < total; ++i) {
      m[i] = mu * m[i] + a.g[i];
      u[i] = h.nesterov ? mu * m[i] + a.g[i] : m[i];
    }
    // 3-4. O = ORTH(bf(U)) (the bf16 rounding is inside the orthogonalizer's bf16 mode).
    if (!cfg.split_sizes.empty()) {
      const ParamShape& s = *a.shape;
      DIOND_RETURN_IF_ERROR(
          OrthogonalizeSplit(ctx, cfg, a.count, s[0], s[1], u, u));
    } else {
      DIOND_RETURN_IF_ERROR(
          OrthogonalizeBatch(ctx, cfg, u, u, OrthoMatrices(cfg, a.count, eff)));
    }
    // NorMuon normalization per head / trailing matrix, or per row block with split_sizes.
    if (normuon) {
      const float w = 1.0f - F32(h.muon_beta2);  // f32 arithmetic: 0.050000011920928955
      float* v = a.state[1];
      if (!cfg.split_sizes.empty()) {
        const int64_t mm = (*a.shape)[0], n = (*a.shape)[1];
        for (int64_t p = 0; p < a.count; ++p) {
          int64_t start = 0;
          for (int64_t sz : cfg.split_sizes) {
            NormalizeRows(u + p * mm * n + start * n, v + p * mm + start, 1, sz, n, w);
            start += sz;
          }
        }
      } else {
        for (int64_t b = 0; b < units.batch; ++b) {
          NormalizeRows(u + b * units.MatrixSize(), v + b * units.rows, 1, units.rows,
                        units.cols, w);
        }
      }
    }
    // 5-7. Weight decay with the base lr, then X ← X − α·O.
    const auto [fan_out, fan_in] = LrFans(cfg, eff);
    const float alpha = AdjustedLr(a.scalars.lr, h.adjust_lr, fan_out, fan_in);
    const float lw = a.scalars.lr * a.scalars.weight_decay;
    const float decay = DecayFactor(a.scalars.lr, a.scalars.weight_decay);
    // Muon in bf16 mode: the bf16 O times the f32 0-d α stays bf16 (one rounding, §5.3 step 7);
    // NorMuon's D is f32 in both modes.
    const bool round_update = bf16 && !normuon;
    float* x = a.x;
    for (int64_t i = 0; i < total; ++i) {
      if (h.cautious_wd) {
        if (x[i] * u[i] >= 0) x[i] = x[i] - lw * x[i];
      } else {
        x[i] = x[i] * decay;
      }
      float step = alpha * u[i];
      if (round_update) step = kernels::RoundToBf16(step);
      x[i] = x[i] - step;
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<UpdateRule> MakeMuonRule() { return std::make_unique<MuonRule>(); }

}  // namespace diond::optim::internal
