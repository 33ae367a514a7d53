// Dion2 (ALGORITHMS.md §7.3, §20.3) and NorDion2 / Dion3 (§8.2, §20.4) for one shape bucket,
// single-device ("local" selection scope; the "global" scope only differs when sharded, §7.4).
#include <vector>

#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"

namespace diond::optim::internal {
namespace {

using kernels::Axis;

class Dion2Rule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    std::vector<StateSpec> s = {{std::string(kStateMomentum), shape}};
    if (config.algorithm == AlgorithmKind::kNorDion2) {
      ParamShape v = shape;
      v.back() = 1;
      s.push_back({std::string(kStateVarianceNeuron), v});
    }
    return s;
  }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& a) const override {
    const GroupConfig& cfg = *a.config;
    const Hyperparams& h = cfg.hyperparams;
    const bool nordion = cfg.algorithm == AlgorithmKind::kNorDion2;
    const ParamShape eff = EffectiveShape(cfg, *a.shape);
    // Selection works on trailing matrices (per head with num_heads), before any flatten.
    const MatrixBatch units = TrailingMatrices(a.count, eff);
    const int64_t R = units.rows, C = units.cols, msize = units.MatrixSize();
    // §7.2: Dion2 subsamples the shorter dimension (rows if m <= n); NorDion2 always rows.
    const Axis axis = (nordion || R <= C) ? Axis::kRows : Axis::kCols;
    const int64_t length = axis == Axis::kRows ? R : C;
    const int64_t k = SelectionCount(length, h.fraction);
    // NorDion2 uses mu as the error-feedback decay (§8.1).
    const float ef = nordion ? F32(h.mu) : F32(h.ef_decay);
    float* m = a.state[0];

    // 1. M ← M + G (pure accumulation, P5).
    for (int64_t i = 0; i < units.batch * msize; ++i) m[i] = m[i] + a.g[i];

    // 2-7. Per unit: top-k slices by L1 norm, S = M[I] (pre-decay, P6), M[I] ← ef·S.
    const int64_t sub_rows = axis == Axis::kRows ? k : R;
    const int64_t sub_cols = axis == Axis::kRows ? C : k;
    const int64_t sub_size = sub_rows * sub_cols;
    std::vector<int64_t> idx(static_cast<size_t>(units.batch * k));
    std::vector<float> s(static_cast<size_t>(units.batch * sub_size));
    for (int64_t b = 0; b < units.batch; ++b) {
      kernels::TensorView mb = View2(m + b * msize, R, C);
      absl::Span<int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
      DIOND_RETURN_IF_ERROR(kernels::TopKByL1Norm(ctx, mb, axis, k, ib));
      kernels::TensorView sb = View2(s.data() + b * sub_size, sub_rows, sub_cols);
      DIOND_RETURN_IF_ERROR(kernels::Gather(ctx, mb, axis, ib, sb));
      DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, sb, axis, ib, ef, 0.0f, mb));
    }

    // 8. O = ORTH(bf(S)); with flatten each parameter's selected [.., sub_rows, sub_cols]
    // tensor is one matrix (per parameter, P16).
    ParamShape sub_shape = eff;
    sub_shape[sub_shape.size() - 2] = sub_rows;
    sub_shape[sub_shape.size() - 1] = sub_cols;
    DIOND_RETURN_IF_ERROR(
        OrthogonalizeBatch(ctx, cfg, s.data(), s.data(), OrthoMatrices(cfg, a.count, sub_shape)));

    // NorDion2: NorMuon's normalization on the selected rows, in f32, with V gathered from and
    // scattered back to the selected rows only (§8.2 step 3).
    if (nordion) {
      const float w = 1.0f - F32(h.muon_beta2);
      float* v = a.state[1];
      std::vector<float> vi(static_cast<size_t>(k));
      for (int64_t b = 0; b < units.batch; ++b) {
        const int64_t* ib = idx.data() + b * k;
        for (int64_t j = 0; j < k; ++j) vi[j] = v[b * R + ib[j]];
        NormalizeRows(s.data() + b * sub_size, vi.data(), 1, k, C, w);
        for (int64_t j = 0; j < k; ++j) v[b * R + ib[j]] = vi[j];
      }
    }

    // 9-11. α from the full (effective) matrix shape; decay every entry; update selected ones.
    const auto [fan_out, fan_in] = LrFans(cfg, eff);
    const float alpha = AdjustedLr(a.scalars.lr, h.adjust_lr, fan_out, fan_in);
    const float decay = DecayFactor(a.scalars.lr, a.scalars.weight_decay);
    for (int64_t i = 0; i < units.batch * msize; ++i) a.x[i] = a.x[i] * decay;
    for (int64_t b = 0; b < units.batch; ++b) {
      kernels::TensorView xb = View2(a.x + b * msize, R, C);
      kernels::TensorView sb = View2(s.data() + b * sub_size, sub_rows, sub_cols);
      absl::Span<const int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
      DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, sb, axis, ib, -alpha, 1.0f, xb));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<UpdateRule> MakeDion2Rule() { return std::make_unique<Dion2Rule>(); }

}  // namespace diond::optim::internal
