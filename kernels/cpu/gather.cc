// Gather and Scatter of rows or columns (kernels/ops.h).
#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/backend.h"

namespace diond::kernels::cpu {

absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t k = static_cast<int64_t>(indices.size());
  for (int64_t b = 0; b < a.Batch(); ++b) {
    ConstTensorView am = a.Matrix(b);
    TensorView om = out.Matrix(b);
    for (int64_t i = 0; i < k; ++i) {
      if (axis == Axis::kRows) {
        DIOND_RETURN_IF_ERROR(cpu::Copy(ctx, am.RowRange(indices[i], 1), om.RowRange(i, 1)));
      } else {
        DIOND_RETURN_IF_ERROR(cpu::Copy(ctx, am.ColRange(indices[i], 1), om.ColRange(i, 1)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst) {
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

}  // namespace diond::kernels::cpu
