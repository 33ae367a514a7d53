// Shared helpers of the update rules: float32 scalar materialization (ALGORITHMS.md §0, P1),
// lr adjustment (§3.9), matrix layouts for num_heads / flatten (§14), orthogonalization of a
// stack with split_sizes (§3.8) and scratch memory. Every numeric loop is an op of kernels/ops.h.
#ifndef DIOND_KERNELS_OPTIM_INTERNAL_UTIL_H_
#define DIOND_KERNELS_OPTIM_INTERNAL_UTIL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/optimizer_types.h"
#include "kernels/tensor.h"

namespace diond::optim::internal {

// The reference wraps every hyperparameter in a float32 0-d tensor (P1).
inline float F32(double v) { return static_cast<float>(v); }

// 1 − η·λ formed in float32 (η·λ rounded, then the subtraction rounded).
inline float DecayFactor(float lr, float wd) {
  const float lw = lr * wd;
  return 1.0f - lw;
}

// ADJ(η; fan_out, fan_in) of §20: the ratio in double, rounded to f32, times the f32 lr.
float AdjustedLr(float lr, AdjustLr mode, int64_t fan_out, int64_t fan_in);

// The shape a parameter is processed as: [h, m/h, n] with num_heads > 1, else its own shape.
// State of the momentum methods: "momentum" (the parameter's shape) and, for the normalized
// variants (NorMuon, NorDion2), "variance_neuron" (shape[:-1] + [1]).
std::vector<StateSpec> MomentumStateSpecs(bool with_variance_neuron, const ParamShape& shape);

ParamShape EffectiveShape(const GroupConfig& config, const ParamShape& shape);

// A stack of `batch` row-major matrices rows×cols, contiguous.
struct MatrixBatch {
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t MatrixSize() const { return rows * cols; }
};

// Trailing matrices of `count` tensors of shape `s` (rank >= 2).
MatrixBatch TrailingMatrices(int64_t count, const ParamShape& s);
// How `count` tensors of shape `s` are orthogonalized: one [s0, ∏s[1:]] matrix each when
// flatten and rank >= 3 (per tensor, P16), else their trailing matrices.
MatrixBatch OrthoMatrices(const GroupConfig& config, int64_t count, const ParamShape& s);
// (fan_out, fan_in) for lr adjustment of an (effective) parameter shape (§3.9, P8).
std::pair<int64_t, int64_t> LrFans(const GroupConfig& config, const ParamShape& eff);

// Views of f32 memory on `dev`: the rules pass ctx.device(), so that the pointers of a device
// context (the caller's parameters and gradients, the state, the staging, the scratch arena)
// are handed to the ops as device views (the device contract, group_optimizer.h).
kernels::TensorView View3(float* p, const MatrixBatch& b, kernels::Device dev);
kernels::ConstTensorView CView3(const float* p, const MatrixBatch& b, kernels::Device dev);
kernels::TensorView View2(float* p, int64_t rows, int64_t cols, kernels::Device dev);

// out ← ORTH(in) for the matrices of `b`, with the group's orthogonalizer, epsilon and
// precision (kBf16Reference: bf16 input rounding and bf16 iterations; the result holds bf16
// values widened to f32). `out` may equal `in`.
absl::Status OrthogonalizeBatch(const kernels::Context& ctx, const GroupConfig& config,
                                const float* in, float* out, const MatrixBatch& b);

// Split scales c_i = ADJ(1; s_i, n) / ADJ(1; m, n) in double (§3.8); empty for adjust_lr none.
std::vector<double> SplitScales(const GroupConfig& config, int64_t m, int64_t n);

// Muon/NorMuon with split_sizes: for `count` stacked m×n matrices, orthogonalizes every row
// block (blocks of equal height of all matrices in one batched call) and multiplies block i by
// f32(c_i), rounding the product to bf16 in kBf16Reference mode (P4).
absl::Status OrthogonalizeSplit(const kernels::Context& ctx, const GroupConfig& config,
                                int64_t count, int64_t m, int64_t n, const float* in, float* out);

// `n` f32 elements of the context's scratch arena: valid until the caller's
// kernels::ScratchArena::Scope ends. Steps after the first reuse the arena's blocks, so they
// allocate nothing (step_allocation_test).
absl::StatusOr<float*> ScratchFloats(const kernels::Context& ctx, int64_t n);

// A contiguous f32 vector view of n elements on `dev`.
inline kernels::TensorView Vec(float* p, int64_t n, kernels::Device dev) {
  return kernels::TensorView(p, kernels::ContiguousLayout(kernels::DType::kF32, {n}), dev);
}
inline kernels::ConstTensorView CVec(const float* p, int64_t n, kernels::Device dev) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(kernels::DType::kF32, {n}), dev);
}

// Explicit copies of n floats between host memory and ctx's device (kernels/ops.h CopyFromHost /
// CopyToHost): each is a sync point (docs/KERNELS.md §4.3). Plain copies on the CPU context.
absl::Status Upload(const kernels::Context& ctx, const float* host, float* dev, int64_t n);
absl::Status Download(const kernels::Context& ctx, const float* dev, float* host, int64_t n);

}  // namespace diond::optim::internal

#endif  // DIOND_KERNELS_OPTIM_INTERNAL_UTIL_H_
