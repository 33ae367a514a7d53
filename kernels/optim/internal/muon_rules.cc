// Muon (ALGORITHMS.md §5.3, §20.1) and NorMuon (§6.2, §20.2) for one shape bucket.
#include <vector>

#include "common/status_macros.h"
#include "kernels/ops.h"
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
    const kernels::Device dev = ctx.device();  // every pointer of `a` is on it
    const bool normuon = cfg.algorithm == AlgorithmKind::kNorMuon;
    const bool bf16 = cfg.precision == Precision::kBf16Reference;
    const ParamShape eff = EffectiveShape(cfg, *a.shape);
    const MatrixBatch units = TrailingMatrices(a.count, eff);  // heads / trailing matrices
    const int64_t total = units.batch * units.MatrixSize();
    const float mu = F32(h.mu);
    float* m = a.state[0];

    // 1-2. M ← μ·M + G; U = μ·M + G (Nesterov) or M: one pass (MomentumUpdate).
    // U lives in the context's scratch arena (rewound on return), so steps after the first
    // reuse its block instead of allocating.
    kernels::ScratchArena::Scope scope(ctx.scratch());
    DIOND_ASSIGN_OR_RETURN(float* const u, ScratchFloats(ctx, total));
    // Per parameter: its gradient is the caller's buffer (GroupOptimizer stages no gradient).
    const int64_t numel = total / a.count;
    // The persistent momentum is read once, the staged one written (out of place).
    for (int64_t p = 0; p < a.count; ++p) {
      DIOND_RETURN_IF_ERROR(kernels::MomentumUpdate(
          ctx, mu, h.nesterov, CVec(a.g[p], numel, dev), CVec(a.state_in[0][p], numel, dev),
          Vec(m + p * numel, numel, dev), Vec(u + p * numel, numel, dev)));
    }
    // 3-4. O = ORTH(bf(U)) (the bf16 rounding is inside the orthogonalizer's bf16 mode).
    if (!cfg.split_sizes.empty()) {
      const ParamShape& s = *a.shape;
      DIOND_RETURN_IF_ERROR(OrthogonalizeSplit(ctx, cfg, a.count, s[0], s[1], u, u));
    } else {
      DIOND_RETURN_IF_ERROR(OrthogonalizeBatch(ctx, cfg, u, u, OrthoMatrices(cfg, a.count, eff)));
    }
    // NorMuon normalization per head / trailing matrix (one batched call), or per row block
    // with split_sizes.
    if (normuon) {
      const float w = 1.0f - F32(h.muon_beta2);  // f32 arithmetic: 0.050000011920928955
      float* v = a.state[1];
      // V is small (one value per row): staged by a copy, then normalized in place.
      const int64_t vsize = numel / a.shape->back();
      for (int64_t p = 0; p < a.count; ++p) {
        DIOND_RETURN_IF_ERROR(
            kernels::Copy(ctx, CVec(a.state_in[1][p], vsize, dev), Vec(v + p * vsize, vsize, dev)));
      }
      if (!cfg.split_sizes.empty()) {
        const int64_t mm = (*a.shape)[0], n = (*a.shape)[1];
        for (int64_t p = 0; p < a.count; ++p) {
          int64_t start = 0;
          for (int64_t sz : cfg.split_sizes) {
            DIOND_RETURN_IF_ERROR(
                kernels::NormalizeNeurons(ctx, w, View2(u + p * mm * n + start * n, sz, n, dev),
                                          Vec(v + p * mm + start, sz, dev)));
            start += sz;
          }
        }
      } else {
        DIOND_RETURN_IF_ERROR(kernels::NormalizeNeurons(ctx, w, View3(u, units, dev),
                                                        Vec(v, units.batch * units.rows, dev)));
      }
    }
    // 5-7. Weight decay with the base lr, then X ← X − α·O: one pass (ApplyUpdate).
    const auto [fan_out, fan_in] = LrFans(cfg, eff);
    kernels::ApplyUpdateParams ap;
    ap.alpha = AdjustedLr(a.scalars.lr, h.adjust_lr, fan_out, fan_in);
    ap.lr_wd = a.scalars.lr * a.scalars.weight_decay;
    ap.cautious = h.cautious_wd;
    // Muon in bf16 mode: the bf16 O times the f32 0-d α stays bf16 (one rounding, §5.3 step 7);
    // NorMuon's D is f32 in both modes.
    ap.round_bf16 = bf16 && !normuon;
    // From the caller's parameters into the staged ones (out of place).
    for (int64_t p = 0; p < a.count; ++p) {
      DIOND_RETURN_IF_ERROR(kernels::ApplyUpdate(ctx, ap, CVec(u + p * numel, numel, dev),
                                                 CVec(a.x_in[p], numel, dev),
                                                 Vec(a.x + p * numel, numel, dev)));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<UpdateRule> MakeMuonRule() { return std::make_unique<MuonRule>(); }

}  // namespace diond::optim::internal
