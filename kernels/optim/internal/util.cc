#include "kernels/optim/internal/util.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "common/status_macros.h"
#include "kernels/ops.h"
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

kernels::TensorView View3(float* p, const MatrixBatch& b, kernels::Device dev) {
  return kernels::TensorView(
      p, kernels::ContiguousLayout(kernels::DType::kF32, {b.batch, b.rows, b.cols}), dev);
}
kernels::ConstTensorView CView3(const float* p, const MatrixBatch& b, kernels::Device dev) {
  return kernels::ConstTensorView(
      p, kernels::ContiguousLayout(kernels::DType::kF32, {b.batch, b.rows, b.cols}), dev);
}
kernels::TensorView View2(float* p, int64_t rows, int64_t cols, kernels::Device dev) {
  return kernels::TensorView(p, kernels::ContiguousLayout(kernels::DType::kF32, {rows, cols}), dev);
}

absl::Status Upload(const kernels::Context& ctx, const float* host, float* dev, int64_t n) {
  return kernels::CopyFromHost(ctx, kernels::MakeView(host, {n}), Vec(dev, n, ctx.device()));
}
absl::Status Download(const kernels::Context& ctx, const float* dev, float* host, int64_t n) {
  return kernels::CopyToHost(ctx, CVec(dev, n, ctx.device()), kernels::MakeView(host, {n}));
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
  o.bf16_matmul = ResolveBf16Matmul(config.bf16_matmul) == Bf16MatmulEngine::kOneDnn
                      ? kernels::Bf16Matmul::kOneDnnBf16
                      : kernels::Bf16Matmul::kReferenceF32Gemm;
  o.epsilon = F32(config.hyperparams.epsilon);
  return kernels::Orthogonalize(ctx, o, CView3(in, b, ctx.device()), View3(out, b, ctx.device()));
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

absl::StatusOr<float*> ScratchFloats(const kernels::Context& ctx, int64_t n) {
  const size_t bytes = static_cast<size_t>(n > 0 ? n : 1) * sizeof(float);
  DIOND_ASSIGN_OR_RETURN(void* p, ctx.scratch().Allocate(bytes, 64));
  return static_cast<float*>(p);
}

absl::Status OrthogonalizeSplit(const kernels::Context& ctx, const GroupConfig& config,
                                int64_t count, int64_t m, int64_t n, const float* in, float* out) {
  const std::vector<int64_t>& sizes = config.split_sizes;
  std::vector<int64_t> starts(sizes.size());
  for (size_t i = 1; i < sizes.size(); ++i) starts[i] = starts[i - 1] + sizes[i - 1];
  const std::vector<double> scales = SplitScales(config, m, n);
  const bool bf16 = config.precision == Precision::kBf16Reference;
  const kernels::Device dev = ctx.device();
  // Blocks of equal height (of every matrix) form one batched call (§3.8).
  std::map<int64_t, std::vector<size_t>> by_height;
  for (size_t i = 0; i < sizes.size(); ++i) by_height[sizes[i]].push_back(i);
  for (const auto& [h, blocks] : by_height) {
    const MatrixBatch b{count * static_cast<int64_t>(blocks.size()), h, n};
    kernels::ScratchArena::Scope scope(ctx.scratch());
    DIOND_ASSIGN_OR_RETURN(float* const buf, ScratchFloats(ctx, b.batch * b.MatrixSize()));
    // bf16 mode: c·block rounded once to bf16 (into `rounded`), then widened exactly.
    kernels::BFloat16* rounded = nullptr;
    if (bf16 && !scales.empty()) {
      DIOND_ASSIGN_OR_RETURN(
          void* r, ctx.scratch().Allocate(static_cast<size_t>(h * n) * sizeof(kernels::BFloat16)));
      rounded = static_cast<kernels::BFloat16*>(r);
    }
    int64_t j = 0;
    for (int64_t p = 0; p < count; ++p) {
      for (size_t blk : blocks) {
        DIOND_RETURN_IF_ERROR(kernels::Copy(
            ctx, View2(const_cast<float*>(in) + p * m * n + starts[blk] * n, h, n, dev),
            View2(buf + j * h * n, h, n, dev)));
        ++j;
      }
    }
    DIOND_RETURN_IF_ERROR(OrthogonalizeBatch(ctx, config, buf, buf, b));
    j = 0;
    for (int64_t p = 0; p < count; ++p) {
      for (size_t blk : blocks) {
        kernels::TensorView dst = View2(out + p * m * n + starts[blk] * n, h, n, dev);
        kernels::TensorView src = View2(buf + j * h * n, h, n, dev);
        if (scales.empty()) {
          DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, src, dst));
        } else if (!bf16) {
          DIOND_RETURN_IF_ERROR(kernels::Scale(ctx, F32(scales[blk]), src, dst));
        } else {
          // A bf16 tensor times a Python float: product in f32 with the scalar in f32, rounded
          // once to bf16 (conformance README §5 item 7).
          kernels::TensorView r(rounded, kernels::ContiguousLayout(kernels::DType::kBf16, {h, n}),
                                dev);
          DIOND_RETURN_IF_ERROR(kernels::Scale(ctx, F32(scales[blk]), src, r));
          DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, r, dst));
        }
        ++j;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::optim::internal
