// Dion2 (ALGORITHMS.md §7.3, §20.3) and NorDion2 / Dion3 (§8.2, §20.4) for one shape bucket,
// single-device ("local" selection scope; the "global" scope only differs when sharded, §7.4).
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"

namespace diond::optim::internal {
namespace {

using kernels::Axis;

// Where Dion2/NorDion2 select for one parameter of `shape` (§7.2): its trailing matrices
// (per head), the axis and the count.
struct Selection {
  MatrixBatch units;  // of one parameter
  Axis axis;
  int64_t length, k, sub_rows, sub_cols;
};

Selection SelectionOf(const GroupConfig& cfg, const ParamShape& shape, int64_t count) {
  const ParamShape eff = EffectiveShape(cfg, shape);
  Selection s;
  s.units = TrailingMatrices(count, eff);
  const int64_t R = s.units.rows, C = s.units.cols;
  s.axis = (cfg.algorithm == AlgorithmKind::kNorDion2 || R <= C) ? Axis::kRows : Axis::kCols;
  s.length = s.axis == Axis::kRows ? R : C;
  s.k = SelectionCount(s.length, cfg.hyperparams.fraction);
  s.sub_rows = s.axis == Axis::kRows ? s.k : R;
  s.sub_cols = s.axis == Axis::kRows ? C : s.k;
  return s;
}

// The order in which the reference's torch.topk(sorted=False) lists the selected slices (PyTorch
// 1.13-2.x CPU kernel: a queue of (score, index) pairs, std::partial_sort of the first k when
// k·64 <= L, else std::nth_element at k-1, both with "larger score first"), applied to the
// selection `idx` (descending by score) when the reference's comparisons pick the same set.
// The order is the row/column order of the orthogonalized submatrix: it does not change the
// exact result, but it is the f32 accumulation order of that matrix's Gram products, which on
// ill-conditioned real gradients can flip a bf16 rounding (orthogonalize.cc, Bf16Matmul).
void ReferenceSelectionOrder(absl::Span<const float> scores, absl::Span<int64_t> idx) {
  const int64_t length = static_cast<int64_t>(scores.size());
  const int64_t k = static_cast<int64_t>(idx.size());
  using Elem = std::pair<float, int64_t>;
  std::vector<Elem> queue(static_cast<size_t>(length));
  for (int64_t j = 0; j < length; ++j) queue[j] = {scores[j], j};
  auto comp = [](const Elem& x, const Elem& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  if (k * 64 <= length) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), comp);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), comp);
  }
  std::vector<int64_t> mine(idx.begin(), idx.end()), theirs(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) theirs[j] = queue[j].second;
  std::vector<int64_t> a = mine, b = theirs;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  if (a == b) std::copy(theirs.begin(), theirs.end(), idx.begin());
}

class Dion2Rule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    return MomentumStateSpecs(config.algorithm == AlgorithmKind::kNorDion2, shape);
  }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& a) const override {
    const GroupConfig& cfg = *a.config;
    const Hyperparams& h = cfg.hyperparams;
    const bool nordion = cfg.algorithm == AlgorithmKind::kNorDion2;
    const bool bf16 = cfg.precision == Precision::kBf16Reference;
    const kernels::Device dev = ctx.device();  // every pointer of `a` is on it
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

    const int64_t total = units.batch * msize;

    // 1. M ← M + G (pure accumulation, P5).
    // Per parameter: its gradient is the caller's buffer (GroupOptimizer stages no gradient).
    const int64_t numel = total / a.count;
    // The persistent momentum is read once, the staged one written (out of place).
    for (int64_t p = 0; p < a.count; ++p) {
      DIOND_RETURN_IF_ERROR(kernels::Axpby(ctx, 1.0f, CVec(a.state_in[0][p], numel, dev), 1.0f,
                                           CVec(a.g[p], numel, dev),
                                           Vec(m + p * numel, numel, dev)));
    }

    // 2-7. Per unit: top-k slices by L1 norm, S = M[I] (pre-decay, P6), M[I] ← ef·S.
    // The indices come back to the host (TopKByL1Norm's sync point, docs/KERNELS.md); S and the
    // scores live in the context's scratch arena.
    const int64_t sub_rows = axis == Axis::kRows ? k : R;
    const int64_t sub_cols = axis == Axis::kRows ? C : k;
    const int64_t sub_size = sub_rows * sub_cols;
    kernels::ScratchArena::Scope scope(ctx.scratch());
    std::vector<int64_t> idx(static_cast<size_t>(units.batch * k));
    // S (then O) lives in the scratch, or, when the parameter write is deferred to the commit,
    // at the start of the staged parameters (batch·sub_size <= their size): the compact update
    // CommitParams applies.
    float* s = a.x;
    if (a.keep == nullptr) {
      DIOND_ASSIGN_OR_RETURN(s, ScratchFloats(ctx, units.batch * sub_size));
    }
    float* scores = nullptr;
    std::vector<float> scores_host;
    if (bf16) {
      DIOND_ASSIGN_OR_RETURN(scores, ScratchFloats(ctx, length));
      scores_host.resize(static_cast<size_t>(length));
    }
    for (int64_t b = 0; b < units.batch; ++b) {
      kernels::TensorView mb = View2(m + b * msize, R, C, dev);
      absl::Span<int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
      if (bf16) {
        DIOND_RETURN_IF_ERROR(
            kernels::TopKByL1Norm(ctx, mb, axis, k, ib, Vec(scores, length, dev)));
        // Host-side reordering of the selection: the scores are read back (a sync point).
        DIOND_RETURN_IF_ERROR(Download(ctx, scores, scores_host.data(), length));
        ReferenceSelectionOrder(scores_host, ib);
      } else {
        DIOND_RETURN_IF_ERROR(kernels::TopKByL1Norm(ctx, mb, axis, k, ib));
      }
      kernels::TensorView sb = View2(s + b * sub_size, sub_rows, sub_cols, dev);
      DIOND_RETURN_IF_ERROR(kernels::Gather(ctx, mb, axis, ib, sb));
      DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, sb, axis, ib, ef, 0.0f, mb));
    }

    // 8. O = ORTH(bf(S)); with flatten each parameter's selected [.., sub_rows, sub_cols]
    // tensor is one matrix (per parameter, P16).
    ParamShape sub_shape = eff;
    sub_shape[sub_shape.size() - 2] = sub_rows;
    sub_shape[sub_shape.size() - 1] = sub_cols;
    DIOND_RETURN_IF_ERROR(
        OrthogonalizeBatch(ctx, cfg, s, s, OrthoMatrices(cfg, a.count, sub_shape)));

    // NorDion2: NorMuon's normalization on the selected rows, in f32, with V gathered from and
    // scattered back to the selected rows only (§8.2 step 3): one batched NormalizeNeurons.
    if (nordion) {
      const float w = 1.0f - F32(h.muon_beta2);
      float* v = a.state[1];
      // V is small (one value per row): staged by a copy, then updated in place.
      const int64_t vsize = numel / a.shape->back();
      for (int64_t p = 0; p < a.count; ++p) {
        DIOND_RETURN_IF_ERROR(
            kernels::Copy(ctx, CVec(a.state_in[1][p], vsize, dev), Vec(v + p * vsize, vsize, dev)));
      }
      DIOND_ASSIGN_OR_RETURN(float* const vi, ScratchFloats(ctx, units.batch * k));
      for (int64_t b = 0; b < units.batch; ++b) {
        absl::Span<const int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
        DIOND_RETURN_IF_ERROR(kernels::Gather(ctx, View2(v + b * R, R, 1, dev), Axis::kRows, ib,
                                              View2(vi + b * k, k, 1, dev)));
      }
      DIOND_RETURN_IF_ERROR(kernels::NormalizeNeurons(
          ctx, w, View3(s, MatrixBatch{units.batch, k, C}, dev), Vec(vi, units.batch * k, dev)));
      for (int64_t b = 0; b < units.batch; ++b) {
        absl::Span<const int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
        DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, View2(vi + b * k, k, 1, dev), Axis::kRows, ib,
                                               1.0f, 0.0f, View2(v + b * R, R, 1, dev)));
      }
    }

    if (a.keep != nullptr) {
      // Deferred: steps 9-11 run at commit (CommitParams), on the caller's parameters.
      a.keep->assign(idx.begin(), idx.end());
      return absl::OkStatus();
    }

    // 9-11. α from the full (effective) matrix shape; decay every entry; update selected ones.
    const auto [fan_out, fan_in] = LrFans(cfg, eff);
    const float alpha = AdjustedLr(a.scalars.lr, h.adjust_lr, fan_out, fan_in);
    const float decay = DecayFactor(a.scalars.lr, a.scalars.weight_decay);
    // Decay from the caller's parameters into the staged ones (out of place), then the
    // selected slices.
    for (int64_t p = 0; p < a.count; ++p) {
      DIOND_RETURN_IF_ERROR(kernels::Scale(ctx, decay, CVec(a.x_in[p], numel, dev),
                                           Vec(a.x + p * numel, numel, dev)));
    }
    for (int64_t b = 0; b < units.batch; ++b) {
      kernels::TensorView xb = View2(a.x + b * msize, R, C, dev);
      kernels::TensorView sb = View2(s + b * sub_size, sub_rows, sub_cols, dev);
      absl::Span<const int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
      DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, sb, axis, ib, -alpha, 1.0f, xb));
    }
    // The compact update for other workers: per unit, the indices then the selected slices of
    // X after the step.
    if (!a.capture.empty()) {
      const int64_t per_param = units.batch / a.count;
      // The slices are gathered on the device, then read back (a sync point per unit).
      DIOND_ASSIGN_OR_RETURN(float* const gathered, ScratchFloats(ctx, sub_size));
      for (int64_t p = 0; p < a.count; ++p) {
        std::vector<float>& out = *a.capture[static_cast<size_t>(p)];
        out.resize(static_cast<size_t>(per_param * (k + sub_size)));
        float* o = out.data();
        for (int64_t u = 0; u < per_param; ++u) {
          const int64_t b = p * per_param + u;
          for (int64_t j = 0; j < k; ++j) o[j] = static_cast<float>(idx[b * k + j]);
          o += k;
          absl::Span<const int64_t> ib(idx.data() + b * k, static_cast<size_t>(k));
          DIOND_RETURN_IF_ERROR(kernels::Gather(ctx, View2(a.x + b * msize, R, C, dev), axis, ib,
                                                View2(gathered, sub_rows, sub_cols, dev)));
          DIOND_RETURN_IF_ERROR(Download(ctx, gathered, o, sub_size));
          o += sub_size;
        }
      }
    }
    return absl::OkStatus();
  }

  bool DefersParamWrite() const override { return true; }

  // Steps 9-11 of a deferred Apply, per parameter in one pass over it (DecayScatterWithChange):
  // every entry decays, the selected slices take −α·O, and Σ(Δx)² comes with it. The values are
  // those of the staged path (Scale, then Scatter with beta 1), bit for bit.
  absl::Status CommitParams(const kernels::Context& ctx, const BucketArgs& a) const override {
    const GroupConfig& cfg = *a.config;
    const Hyperparams& h = cfg.hyperparams;
    const kernels::Device dev = ctx.device();
    const ParamShape eff = EffectiveShape(cfg, *a.shape);
    const Selection sel = SelectionOf(cfg, *a.shape, a.count);
    const int64_t R = sel.units.rows, C = sel.units.cols, k = sel.k;
    const Axis axis = sel.axis;
    const int64_t sub_size = sel.sub_rows * sel.sub_cols;
    const int64_t per_param = sel.units.batch / a.count;
    if (static_cast<int64_t>(a.keep->size()) != sel.units.batch * k) {
      return absl::InternalError("Dion2 commit: the kept selection does not match the bucket");
    }
    const auto [fan_out, fan_in] = LrFans(cfg, eff);
    const float alpha = AdjustedLr(a.scalars.lr, h.adjust_lr, fan_out, fan_in);
    const float decay = DecayFactor(a.scalars.lr, a.scalars.weight_decay);
    const MatrixBatch one{per_param, sel.sub_rows, sel.sub_cols};
    for (int64_t p = 0; p < a.count; ++p) {
      DIOND_RETURN_IF_ERROR(kernels::DecayScatterWithChange(
          ctx, decay, CView3(a.x + p * per_param * sub_size, one, dev), axis,
          absl::MakeConstSpan(a.keep->data() + p * per_param * k,
                              static_cast<size_t>(per_param * k)),
          -alpha, View3(a.commit_x[p], MatrixBatch{per_param, R, C}, dev),
          Vec(a.commit_sq[p], 1, dev)));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<UpdateRule> MakeDion2Rule() { return std::make_unique<Dion2Rule>(); }

int64_t Dion2CaptureSize(const GroupConfig& config, const ParamShape& shape) {
  if (shape.size() < 2) return 0;
  const Selection s = SelectionOf(config, shape, 1);
  if (s.length > (int64_t{1} << 24)) return 0;  // indices travel as exact floats
  const int64_t size = s.units.batch * (s.k + s.sub_rows * s.sub_cols);
  return size < s.units.batch * s.units.MatrixSize() ? size : 0;
}

absl::Status Dion2ApplyCaptured(const kernels::Context& ctx, const GroupConfig& config,
                                const ParamShape& shape, const StepScalars& scalars,
                                const float* payload, float* x) {
  const Selection s = SelectionOf(config, shape, 1);
  const int64_t msize = s.units.MatrixSize(), sub_size = s.sub_rows * s.sub_cols;
  // Indices first (validated before anything is written).
  std::vector<int64_t> idx(static_cast<size_t>(s.units.batch * s.k));
  for (int64_t u = 0; u < s.units.batch; ++u) {
    const float* in = payload + u * (s.k + sub_size);
    std::vector<bool> seen(static_cast<size_t>(s.length), false);
    for (int64_t j = 0; j < s.k; ++j) {
      const float f = in[j];
      const int64_t i = static_cast<int64_t>(f);
      if (!(f >= 0.0f) || static_cast<float>(i) != f || i >= s.length || seen[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("captured update: bad slice index ", f, " (", s.length, " slices)"));
      }
      seen[i] = true;
      idx[u * s.k + j] = i;
    }
  }
  // Step 10 exactly as the rule: every entry decayed; then the owner's selected slices, uploaded
  // from the (host) payload into the context's scratch (a copy per unit).
  const kernels::Device dev = ctx.device();
  kernels::ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(float* const slices, ScratchFloats(ctx, sub_size));
  const float decay = DecayFactor(scalars.lr, scalars.weight_decay);
  const int64_t total = s.units.batch * msize;
  DIOND_RETURN_IF_ERROR(kernels::Scale(ctx, decay, CVec(x, total, dev), Vec(x, total, dev)));
  for (int64_t u = 0; u < s.units.batch; ++u) {
    const float* values = payload + u * (s.k + sub_size) + s.k;
    absl::Span<const int64_t> ib(idx.data() + u * s.k, static_cast<size_t>(s.k));
    DIOND_RETURN_IF_ERROR(Upload(ctx, values, slices, sub_size));
    DIOND_RETURN_IF_ERROR(kernels::Scatter(ctx, View2(slices, s.sub_rows, s.sub_cols, dev), s.axis,
                                           ib, 1.0f, 0.0f,
                                           View2(x + u * msize, s.units.rows, s.units.cols, dev)));
  }
  return absl::OkStatus();
}

}  // namespace diond::optim::internal
