// Reductions of kernels/ops.h: FrobeniusNorm, AxisNorms, TopKByL1Norm, IsAllZero.
// Every sum is accumulated in double along one row or one column by one thread: a row in the
// lane order of math::FoldRowSumLanes (the CUDA backend's warp order), a column in row order; so
// results depend neither on the thread count nor on the ISA clone of the f32 loops, and are the
// GPU's bit for bit.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels::cpu {
namespace {
// n elements of T from the context's scratch arena (valid until the caller's Scope ends).
template <typename T>
absl::StatusOr<T*> ScratchArray(const Context& ctx, int64_t n) {
  DIOND_ASSIGN_OR_RETURN(
      void* p, ctx.scratch().Allocate(static_cast<size_t>(n > 0 ? n : 1) * sizeof(T), 64));
  return static_cast<T*>(p);
}
}  // namespace

namespace {

double Term(NormType t, float v) {
  return t == NormType::kL1 ? std::fabs(static_cast<double>(v))
                            : static_cast<double>(v) * static_cast<double>(v);
}

}  // namespace

// ---- kbw: f32 row and column sums per ISA (DIOND_CPU_CLONES, loops.h) -----------------------
// A row is summed in double in the lane order of math::FoldRowSumLanes (elementwise_math.h), the
// CUDA backend's warp order: 32 independent chains per row (the adds overlap instead of waiting
// on each other's latency, and vectorize without reassociation), then the pairwise fold.
// ColSumsF32 adds one row to the column sums at a time (the columns are independent lanes): each
// column in row order. Every clone gives the same bits.
DIOND_CPU_CLONES double RowSumF32(bool l1, const float* row, int64_t cols) {
  constexpr int kLanes = math::kRowSumLanes;
  double lanes[kLanes] = {};
  int64_t j = 0;
  if (l1) {
    for (; j + kLanes <= cols; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] += std::fabs(static_cast<double>(row[j + l]));
    }
    for (int l = 0; j + l < cols; ++l) lanes[l] += std::fabs(static_cast<double>(row[j + l]));
  } else {
    for (; j + kLanes <= cols; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const double v = row[j + l];
        lanes[l] += v * v;
      }
    }
    for (int l = 0; j + l < cols; ++l) {
      const double v = row[j + l];
      lanes[l] += v * v;
    }
  }
  return math::FoldRowSumLanes(lanes);
}

namespace {

// Columns [c0, c1) of one matrix: out[j] = Σ_i Term(a[i, j]), rows in order.
DIOND_CPU_CLONES void ColSumsF32(NormType type, const float* base, int64_t row_stride, int64_t rows,
                                 int64_t c0, int64_t c1, double* out) {
  for (int64_t j = c0; j < c1; ++j) out[j] = 0.0;
  const bool l1 = type == NormType::kL1;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = base + i * row_stride;
    if (l1) {
      for (int64_t j = c0; j < c1; ++j) out[j] += std::fabs(static_cast<double>(row[j]));
    } else {
      for (int64_t j = c0; j < c1; ++j) out[j] += static_cast<double>(row[j]) * row[j];
    }
  }
}

// Per-row sums of Term() for every row of every matrix of a (row-major), into sums
// [batch·rows].
void RowSums(ConstTensorView a, NormType type, double* sums) {
  const int64_t rows = a.Rows(), cols = a.Cols(), batch = a.Batch();
  const TensorLayout& l = a.layout();
  if (a.dtype() == DType::kF32) {
    const float* base = static_cast<const float*>(a.data());
    const bool l1 = type == NormType::kL1;
    cpu::ParallelRange(
        batch * rows,
        [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) {
            sums[r] = RowSumF32(
                l1, base + (r / rows) * l.BatchStride() + (r % rows) * l.RowStride(), cols);
          }
        },
        std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
    return;
  }
  cpu::DispatchDType(a.dtype(), [&](auto at) {
    using A = decltype(at);
    const A* base = static_cast<const A*>(a.data());
    cpu::ParallelRange(
        batch * rows,
        [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) {
            const A* row = base + (r / rows) * l.BatchStride() + (r % rows) * l.RowStride();
            double lanes[math::kRowSumLanes] = {};
            for (int64_t j = 0; j < cols; ++j) {
              lanes[j % math::kRowSumLanes] += Term(type, cpu::ToF32(row[j]));
            }
            sums[r] = math::FoldRowSumLanes(lanes);
          }
        },
        std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
  });
}

// Per-column sums into sums [batch·cols]; threads split the columns, each walks all rows.
void ColSums(ConstTensorView a, NormType type, double* sums) {
  const int64_t rows = a.Rows(), cols = a.Cols(), batch = a.Batch();
  const TensorLayout& l = a.layout();
  if (a.dtype() == DType::kF32) {
    const float* base = static_cast<const float*>(a.data());
    for (int64_t bi = 0; bi < batch; ++bi) {
      double* out = sums + bi * cols;
      const float* m = base + bi * l.BatchStride();
      cpu::ParallelRange(
          cols, [&](int64_t b, int64_t e) { ColSumsF32(type, m, l.RowStride(), rows, b, e, out); },
          std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, rows)));
    }
    return;
  }
  cpu::DispatchDType(a.dtype(), [&](auto at) {
    using A = decltype(at);
    const A* base = static_cast<const A*>(a.data());
    for (int64_t bi = 0; bi < batch; ++bi) {
      double* out = sums + bi * cols;
      cpu::ParallelRange(
          cols,
          [&](int64_t b, int64_t e) {
            for (int64_t j = b; j < e; ++j) out[j] = 0.0;
            for (int64_t i = 0; i < rows; ++i) {
              const A* row = base + bi * l.BatchStride() + i * l.RowStride();
              for (int64_t j = b; j < e; ++j) out[j] += Term(type, cpu::ToF32(row[j]));
            }
          },
          std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, rows)));
    }
  });
}

}  // namespace

absl::Status FrobeniusNorm(const Context& ctx, ConstTensorView a, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(double* const sums, ScratchArray<double>(ctx, a.Batch() * a.Rows()));
  RowSums(a, NormType::kSumOfSquares, sums);
  float* o = out.As<float>();
  for (int64_t b = 0; b < a.Batch(); ++b) {
    double s = 0.0;
    for (int64_t r = 0; r < a.Rows(); ++r) s += sums[b * a.Rows() + r];
    o[b] = static_cast<float>(std::sqrt(s));
  }
  return absl::OkStatus();
}

absl::Status AxisNorms(const Context& ctx, ConstTensorView a, Axis axis, NormType type,
                       TensorView out) {
  const int64_t per = axis == Axis::kRows ? a.Rows() : a.Cols();
  cpu::ApplyThreadPolicy(ctx);
  const NormType acc = type == NormType::kL1 ? NormType::kL1 : NormType::kSumOfSquares;
  ScratchArena::Scope scope(ctx.scratch());
  const int64_t count = a.Batch() * per;
  DIOND_ASSIGN_OR_RETURN(double* const sums, ScratchArray<double>(ctx, count));
  if (axis == Axis::kRows) {
    RowSums(a, acc, sums);
  } else {
    ColSums(a, acc, sums);
  }
  float* o = out.As<float>();
  for (int64_t i = 0; i < count; ++i) {
    o[i] = static_cast<float>(type == NormType::kL2 ? std::sqrt(sums[i]) : sums[i]);
  }
  return absl::OkStatus();
}

namespace {
// k and indices.size() were validated by the dispatcher (1 <= k <= n, size k).
absl::Status TopKImpl(const Context& ctx, const float* s, int64_t n, int64_t k,
                      absl::Span<int64_t> indices) {
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(int64_t* const idx, ScratchArray<int64_t>(ctx, n));
  std::iota(idx, idx + n, int64_t{0});
  // Strict weak order: numbers before NaN, larger score first, then lower index first.
  auto before = [s](int64_t i, int64_t j) {
    const bool ni = std::isnan(s[i]), nj = std::isnan(s[j]);
    if (ni != nj) return nj;
    if (!ni && s[i] != s[j]) return s[i] > s[j];
    return i < j;
  };
  std::partial_sort(idx, idx + k, idx + n, before);
  std::copy(idx, idx + k, indices.begin());
  return absl::OkStatus();
}
}  // namespace

absl::Status TopKByL1Norm(const Context& ctx, ConstTensorView a, Axis axis, int64_t k,
                          absl::Span<int64_t> indices, TensorView scores_out) {
  const int64_t n = axis == Axis::kRows ? a.Rows() : a.Cols();
  // The scores go straight into scores_out when the caller wants them, else into scratch.
  ScratchArena::Scope scope(ctx.scratch());
  float* scores = nullptr;
  if (!scores_out.empty()) {
    scores = scores_out.As<float>();
  } else {
    DIOND_ASSIGN_OR_RETURN(scores, ScratchArray<float>(ctx, n));
  }
  DIOND_RETURN_IF_ERROR(cpu::AxisNorms(ctx, a, axis, NormType::kL1, MakeView(scores, {n})));
  return TopKImpl(ctx, scores, n, k, indices);
}

absl::Status IsAllZero(const Context& ctx, ConstTensorView a, bool* all_zero) {
  cpu::ApplyThreadPolicy(ctx);
  TensorLayout l = a.layout();
  // Walk any strided layout as rows of the last dim.
  const int64_t rank = l.rank;
  const int64_t d0 = rank == 3 ? l.dims[0] : 1, d1 = rank >= 2 ? l.dims[rank - 2] : 1;
  const int64_t d2 = rank >= 1 ? l.dims[rank - 1] : 1;
  const int64_t s0 = rank == 3 ? l.strides[0] : 0, s1 = rank >= 2 ? l.strides[rank - 2] : 0;
  const int64_t s2 = rank >= 1 ? l.strides[rank - 1] : 0;
  bool zero = true;
  cpu::DispatchDType(a.dtype(), [&](auto at) {
    using A = decltype(at);
    const A* p = static_cast<const A*>(a.data());
    for (int64_t i = 0; i < d0 && zero; ++i) {
      for (int64_t j = 0; j < d1 && zero; ++j) {
        for (int64_t t = 0; t < d2; ++t) {
          if (cpu::ToF32(p[i * s0 + j * s1 + t * s2]) != 0.0f) {  // NaN != 0 as well
            zero = false;
            break;
          }
        }
      }
    }
  });
  *all_zero = zero;
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
