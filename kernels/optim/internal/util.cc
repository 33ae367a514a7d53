#include "kernels/optim/internal/util.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "common/status_macros.h"
#include "kernels/optim/orthogonalize.h"

namespace diond::optim::internal {

namespace {
int64_t Product(const ParamShape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= s[i];
  return p;
}

double AdjustRatio(AdjustLr mode, int64_t fan_out, int64_t fan_in) {
  switch (mode) {
    case AdjustLr::kSpectralNorm:
      return std::sqrt(static_cast<double>(fan_out) / static_cast<double>(fan_in));
    case AdjustLr::kRmsNorm:
      return 0.2 * std::sqrt(static_cast<double>(std::max(fan_out, fan_in)));
    case AdjustLr::kNone:
      return 1.0;
  }
  return 1.0;
}
}  // namespace

float AdjustedLr(float lr, AdjustLr mode, int64_t fan_out, int64_t fan_in) {
  if (mode == AdjustLr::kNone) return lr;
  return lr * F32(AdjustRatio(mode, fan_out, fan_in));
}

std::vector<StateSpec> MomentumStateSpecs(bool with_variance_neuron, const ParamShape& shape) {
  std::vector<StateSpec> s = {{std::string(kStateMomentum), shape}};
  if (with_variance_neuron) {
    ParamShape v = shape;
    v.back() = 1;
    s.push_back({std::string(kStateVarianceNeuron), v});
  }
  return s;
}

ParamShape EffectiveShape(const GroupConfig& config, const ParamShape& shape) {
  if (config.num_heads > 1 && shape.size() == 2) {
    return {config.num_heads, shape[0] / config.num_heads, shape[1]};
  }
  return shape;
}

MatrixBatch TrailingMatrices(int64_t count, const ParamShape& s) {
  const size_t r = s.size();
  return {count * Product(s, 0, r - 2), s[r - 2], s[r - 1]};
}

MatrixBatch OrthoMatrices(const GroupConfig& config, int64_t count, const ParamShape& s) {
  if (config.flatten && s.size() >= 3) return {count, s[0], Product(s, 1, s.size())};
  return TrailingMatrices(count, s);
}

std::pair<int64_t, int64_t> LrFans(const GroupConfig& config, const ParamShape& eff) {
  if (config.flatten && eff.size() >= 3) return {eff[0], Product(eff, 1, eff.size())};
  return {eff[eff.size() - 2], eff[eff.size() - 1]};
}

kernels::TensorView View3(float* p, const MatrixBatch& b) {
  return kernels::TensorView(p, kernels::ContiguousLayout(kernels::DType::kF32,
                                                          {b.batch, b.rows, b.cols}));
}
kernels::ConstTensorView CView3(const float* p, const MatrixBatch& b) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(kernels::DType::kF32,
                                                               {b.batch, b.rows, b.cols}));
}
kernels::TensorView View2(float* p, int64_t rows, int64_t cols) {
  return kernels::TensorView(p, kernels::ContiguousLayout(kernels::DType::kF32, {rows, cols}));
}

absl::Status OrthogonalizeBatch(const kernels::Context& ctx, const GroupConfig& config,
                                const float* in, float* out, const MatrixBatch& b) {
  kernels::OrthogonalizeOptions o;
  o.method = config.hyperparams.orthogonalizer == Orthogonalizer::kPolarExpress
                 ? kernels::OrthoMethod::kPolarExpress
                 : kernels::OrthoMethod::kNewtonSchulz5;
  o.precision = config.precision == Precision::kBf16Reference
                    ? kernels::OrthoPrecision::kBf16Reference
                    : kernels::OrthoPrecision::kFp32;
  o.epsilon = F32(config.hyperparams.epsilon);
  return kernels::Orthogonalize(ctx, o, CView3(in, b), View3(out, b));
}

std::vector<double> SplitScales(const GroupConfig& config, int64_t m, int64_t n) {
  std::vector<double> c;
  if (config.hyperparams.adjust_lr == AdjustLr::kNone) return c;
  const double full = AdjustRatio(config.hyperparams.adjust_lr, m, n);
  for (int64_t s : config.split_sizes) {
    c.push_back(AdjustRatio(config.hyperparams.adjust_lr, s, n) / full);
  }
  return c;
}

absl::Status OrthogonalizeSplit(const kernels::Context& ctx, const GroupConfig& config,
                                int64_t count, int64_t m, int64_t n, const float* in,
                                float* out) {
  const std::vector<int64_t>& sizes = config.split_sizes;
  std::vector<int64_t> starts(sizes.size());
  for (size_t i = 1; i < sizes.size(); ++i) starts[i] = starts[i - 1] + sizes[i - 1];
  const std::vector<double> scales = SplitScales(config, m, n);
  const bool bf16 = config.precision == Precision::kBf16Reference;
  // Blocks of equal height (of every matrix) form one batched call (§3.8).
  std::map<int64_t, std::vector<size_t>> by_height;
  for (size_t i = 0; i < sizes.size(); ++i) by_height[sizes[i]].push_back(i);
  for (const auto& [h, blocks] : by_height) {
    const MatrixBatch b{count * static_cast<int64_t>(blocks.size()), h, n};
    kernels::ScratchArena::Scope scope(ctx.scratch());
    DIOND_ASSIGN_OR_RETURN(kernels::Tensor buf_t,
                           kernels::Tensor::Allocate(kernels::DType::kF32,
                                                     {b.batch * b.MatrixSize()}, &ctx.scratch()));
    float* const buf = buf_t.As<float>();
    int64_t j = 0;
    for (int64_t p = 0; p < count; ++p) {
      for (size_t blk : blocks) {
        std::copy_n(in + p * m * n + starts[blk] * n, h * n, buf + j * h * n);
        ++j;
      }
    }
    DIOND_RETURN_IF_ERROR(OrthogonalizeBatch(ctx, config, buf, buf, b));
    j = 0;
    for (int64_t p = 0; p < count; ++p) {
      for (size_t blk : blocks) {
        float* dst = out + p * m * n + starts[blk] * n;
        const float* src = buf + j * h * n;
        if (scales.empty()) {
          std::copy_n(src, h * n, dst);
        } else {
          // A bf16 tensor times a Python float: product in f32 with the scalar in f32, rounded
          // once to bf16 (conformance README §5 item 7).
          const float c = F32(scales[blk]);
          for (int64_t e = 0; e < h * n; ++e) {
            const float v = c * src[e];
            dst[e] = bf16 ? kernels::RoundToBf16(v) : v;
          }
        }
        ++j;
      }
    }
  }
  return absl::OkStatus();
}

void NormalizeRows(float* o, float* v, int64_t v_stride, int64_t rows, int64_t cols, float w) {
  double f2 = 0;
  for (int64_t e = 0; e < rows * cols; ++e) f2 += static_cast<double>(o[e]) * o[e];
  const float f = static_cast<float>(std::sqrt(f2));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = o + r * cols;
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(row[c]) * row[c];
    const float nu = static_cast<float>(ss) / static_cast<float>(cols);
    float& vr = v[r * v_stride];
    vr = Lerp(vr, nu, w);
  }
  double d2 = 0;
  for (int64_t r = 0; r < rows; ++r) {
    // The 1e-8 literals are hard-coded upstream, not the group epsilon (P9).
    const float denom = std::sqrt(v[r * v_stride]) + 1e-8f;
    float* row = o + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      row[c] = row[c] / denom;
      d2 += static_cast<double>(row[c]) * row[c];
    }
  }
  const float scale = f / std::max(static_cast<float>(std::sqrt(d2)), 1e-8f);
  for (int64_t e = 0; e < rows * cols; ++e) o[e] *= scale;
}

}  // namespace diond::optim::internal
