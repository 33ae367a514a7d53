// Gather and Scatter of rows or columns (kernels/ops.h).
#include <algorithm>
#include <type_traits>

#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"

namespace diond::kernels::cpu {

// Both ops walk the matrices row by row (the rows of `src`/`out`), so a column selection reads
// and writes whole rows instead of one strided column at a time, and split the rows over the
// threads. Every element is computed the same way whatever the split.

absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t rows = out.Rows(), cols = out.Cols();
  const int64_t* idx = indices.data();
  cpu::DispatchDType(a.dtype(), [&](auto at) {
    using A = decltype(at);
    cpu::DispatchDType(out.dtype(), [&](auto ot) {
      using O = decltype(ot);
      for (int64_t b = 0; b < out.Batch(); ++b) {
        ConstTensorView am = a.Matrix(b);
        TensorView om = out.Matrix(b);
        const A* ap = static_cast<const A*>(am.data());
        O* op = static_cast<O*>(om.data());
        const int64_t lda = am.layout().RowStride(), ldo = om.layout().RowStride();
        cpu::ParallelRange(
            rows,
            [&](int64_t r0, int64_t r1) {
              for (int64_t i = r0; i < r1; ++i) {
                O* orow = op + i * ldo;
                if (axis == Axis::kRows) {
                  const A* arow = ap + idx[i] * lda;
                  for (int64_t j = 0; j < cols; ++j) orow[j] = cpu::FromF32<O>(cpu::ToF32(arow[j]));
                } else {
                  const A* arow = ap + i * lda;
                  for (int64_t j = 0; j < cols; ++j) {
                    orow[j] = cpu::FromF32<O>(cpu::ToF32(arow[idx[j]]));
                  }
                }
              }
            },
            std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
      }
    });
  });
  return absl::OkStatus();
}

namespace {

// d ← alpha·s (+ beta·d), rounded once to D.
template <bool kAccumulate, typename S, typename D>
inline void ScatterOne(float alpha, float beta, S s, D& d) {
  const float v = alpha * cpu::ToF32(s);
  d = cpu::FromF32<D>(kAccumulate ? v + beta * cpu::ToF32(d) : v);
}

}  // namespace

absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t rows = src.Rows(), cols = src.Cols();
  const int64_t* idx = indices.data();
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
        auto body = [&](auto accumulate, int64_t r0, int64_t r1) {
          constexpr bool kAcc = decltype(accumulate)::value;
          for (int64_t i = r0; i < r1; ++i) {
            const S* srow = sp + i * lds;
            if (axis == Axis::kRows) {
              D* drow = dp + idx[i] * ldd;
              for (int64_t j = 0; j < cols; ++j) ScatterOne<kAcc>(alpha, beta, srow[j], drow[j]);
            } else {
              D* drow = dp + i * ldd;
              for (int64_t j = 0; j < cols; ++j) {
                ScatterOne<kAcc>(alpha, beta, srow[j], drow[idx[j]]);
              }
            }
          }
        };
        cpu::ParallelRange(
            rows,
            [&](int64_t r0, int64_t r1) {
              if (beta == 0.0f) {
                body(std::false_type{}, r0, r1);
              } else {
                body(std::true_type{}, r0, r1);
              }
            },
            std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
      }
    });
  });
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
