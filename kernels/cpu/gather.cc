// Gather and Scatter of rows or columns (kernels/ops.h).
#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/validate.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using cpu::Invalid;

// The shape the gathered block must have: k×cols (rows) or rows×k (cols), same batch.
absl::Status CheckSlices(const Context& ctx, const char* op, ConstTensorView full,
                         const char* full_name, ConstTensorView part, const char* part_name,
                         Axis axis, absl::Span<const int64_t> indices, bool distinct) {
  DIOND_RETURN_IF_ERROR(cpu::CheckContext(ctx, op));
  DIOND_RETURN_IF_ERROR(cpu::CheckMatrix(ctx, op, full_name, full));
  DIOND_RETURN_IF_ERROR(cpu::CheckMatrix(ctx, op, part_name, part));
  if (axis != Axis::kRows && axis != Axis::kCols) {
    return Invalid(op, "unknown axis ", static_cast<int>(axis));
  }
  const int64_t k = static_cast<int64_t>(indices.size());
  const int64_t limit = axis == Axis::kRows ? full.Rows() : full.Cols();
  const int64_t want_r = axis == Axis::kRows ? k : full.Rows();
  const int64_t want_c = axis == Axis::kRows ? full.Cols() : k;
  if (part.Rows() != want_r || part.Cols() != want_c || part.Batch() != full.Batch() ||
      part.rank() != full.rank()) {
    return Invalid(op, part_name, " is ", part.DebugString(), ", want ", want_r, "x", want_c,
                   " matrices, batch ", full.Batch(), " (", full_name, " ", full.DebugString(),
                   ", ", k, " indices)");
  }
  for (int64_t i = 0; i < k; ++i) {
    if (indices[i] < 0 || indices[i] >= limit) {
      return Invalid(op, "indices[", i, "] = ", indices[i], " is outside [0, ", limit, ")");
    }
  }
  if (distinct) {
    std::vector<int64_t> sorted(indices.begin(), indices.end());
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) return Invalid(op, "index ", *dup, " appears more than once");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out) {
  constexpr const char* kOp = "Gather";
  DIOND_RETURN_IF_ERROR(CheckSlices(ctx, kOp, a, "a", out, "out", axis, indices, false));
  cpu::ApplyThreadPolicy(ctx);
  const int64_t k = static_cast<int64_t>(indices.size());
  for (int64_t b = 0; b < a.Batch(); ++b) {
    ConstTensorView am = a.Matrix(b);
    TensorView om = out.Matrix(b);
    for (int64_t i = 0; i < k; ++i) {
      if (axis == Axis::kRows) {
        DIOND_RETURN_IF_ERROR(Copy(ctx, am.RowRange(indices[i], 1), om.RowRange(i, 1)));
      } else {
        DIOND_RETURN_IF_ERROR(Copy(ctx, am.ColRange(indices[i], 1), om.ColRange(i, 1)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst) {
  constexpr const char* kOp = "Scatter";
  DIOND_RETURN_IF_ERROR(CheckSlices(ctx, kOp, dst, "dst", src, "src", axis, indices, true));
  DIOND_RETURN_IF_ERROR(cpu::CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(cpu::CheckFinite(kOp, "beta", beta));
  cpu::ApplyThreadPolicy(ctx);
  const int64_t rows = src.Rows(), cols = src.Cols();
  cpu::DispatchDType(src.dtype(), [&](auto st) {
    using S = decltype(st);
    cpu::DispatchDType(dst.dtype(), [&](auto dt) {
      using D = decltype(dt);
      for (int64_t b = 0; b < dst.Batch(); ++b) {
        ConstTensorView sm = src.Matrix(b);
        TensorView dm = dst.Matrix(b);
        const S* sp = static_cast<const S*>(sm.data());
        D* dp = static_cast<D*>(dm.data());
        const int64_t lds = sm.layout().RowStride(), ldd = dm.layout().RowStride();
        cpu::ParallelRange(rows, [&](int64_t r0, int64_t r1) {
          for (int64_t i = r0; i < r1; ++i) {
            for (int64_t j = 0; j < cols; ++j) {
              const int64_t di = axis == Axis::kRows ? indices[i] : i;
              const int64_t dj = axis == Axis::kRows ? j : indices[j];
              D& d = dp[di * ldd + dj];
              const float v = alpha * cpu::ToF32(sp[i * lds + j]);
              d = cpu::FromF32<D>(beta == 0.0f ? v : v + beta * cpu::ToF32(d));
            }
          }
        }, std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
      }
    });
  });
  return absl::OkStatus();
}

}  // namespace diond::kernels
