// Elementwise ops of kernels/ops.h: Copy, Fill, Axpby, Scale, AddScalar, Unary, Binary.
// Every value is computed in f32 and rounded once to the output dtype (ops.h conventions).
#include <cfloat>
#include <cmath>
#include <cstring>

#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels::cpu {
namespace {

// Pads a layout to rank 3 ([1, 1, n] for rank 1, [1, 1, 1] for rank 0).
TensorLayout Pad3(const TensorLayout& l) {
  TensorLayout p;
  p.dtype = l.dtype;
  p.rank = 3;
  const int shift = 3 - l.rank;
  for (int i = 0; i < 3; ++i) {
    p.dims[i] = i < shift ? 1 : l.dims[i - shift];
    p.strides[i] = i < shift ? 0 : l.strides[i - shift];
  }
  return p;
}

// out[i] = f(x[i]) over contiguous data, any dtypes.
template <typename F>
void Map1(ConstTensorView x, TensorView out, F f) {
  DispatchDType(x.dtype(), [&](auto xt) {
    using X = decltype(xt);
    DispatchDType(out.dtype(), [&](auto ot) {
      using O = decltype(ot);
      const X* xp = static_cast<const X*>(x.data());
      O* op = static_cast<O*>(out.data());
      ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) op[i] = FromF32<O>(f(ToF32(xp[i])));
      });
    });
  });
}

// out[i] = f(x[i], y[i]) over contiguous data, any dtypes.
template <typename F>
void Map2(ConstTensorView x, ConstTensorView y, TensorView out, F f) {
  DispatchDType(x.dtype(), [&](auto xt) {
    using X = decltype(xt);
    DispatchDType(y.dtype(), [&](auto yt) {
      using Y = decltype(yt);
      DispatchDType(out.dtype(), [&](auto ot) {
        using O = decltype(ot);
        const X* xp = static_cast<const X*>(x.data());
        const Y* yp = static_cast<const Y*>(y.data());
        O* op = static_cast<O*>(out.data());
        ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) op[i] = FromF32<O>(f(ToF32(xp[i]), ToF32(yp[i])));
        });
      });
    });
  });
}

// ---- kperf: the contiguous same-dtype cases of Axpby and Scale as cloned range kernels -------
// (DIOND_CPU_CLONES, loops.h): the orthogonalizers' bf16 phases and the rules' momentum updates
// call these on every step, and the generic Map1/Map2 loops are built for the baseline ISA only.
// Same arithmetic as the lambdas below (a·x + b·y, no contraction), so the same bits.
DIOND_CPU_CLONES void AxpbyF32Range(float a, const float* x, float b, const float* y, float* o,
                                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a * x[i] + b * y[i];
}
// Binary's f32 case of a contiguous x and a one-element y (the orthogonalizers' normalization
// by a device-side scalar): the general loop's per-element switch and strided read of y kept it
// scalar. Same arithmetic: x·b or x / b (a division, not a multiply by a reciprocal).
DIOND_CPU_CLONES void MulScalarF32Range(const float* x, float b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] * b;
}
DIOND_CPU_CLONES void DivScalarF32Range(const float* x, float b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] / b;
}

DIOND_CPU_CLONES void ScaleF32Range(float a, const float* x, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a * x[i];
}
DIOND_CPU_CLONES void AxpbyBf16Range(float a, const BFloat16* x, float b, const BFloat16* y,
                                     BFloat16* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = FloatToBf16(a * Bf16ToFloat(x[i]) + b * Bf16ToFloat(y[i]));
}
DIOND_CPU_CLONES void ScaleBf16Range(float a, const BFloat16* x, BFloat16* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = FloatToBf16(a * Bf16ToFloat(x[i]));
}

// Overloads by storage type, for AxpbyContiguous.
void AxpbyRange(float a, const float* x, float b, const float* y, float* o, int64_t n) {
  AxpbyF32Range(a, x, b, y, o, n);
}
void AxpbyRange(float a, const BFloat16* x, float b, const BFloat16* y, BFloat16* o, int64_t n) {
  AxpbyBf16Range(a, x, b, y, o, n);
}
void ScaleRange(float a, const float* x, float* o, int64_t n) { ScaleF32Range(a, x, o, n); }
void ScaleRange(float a, const BFloat16* x, BFloat16* o, int64_t n) { ScaleBf16Range(a, x, o, n); }

// out ← alpha·x (+ beta·y when with_y) over contiguous views of storage type T, split over the
// OpenMP threads.
template <typename T>
void AxpbyContiguous(float alpha, ConstTensorView x, float beta, ConstTensorView y, bool with_y,
                     TensorView out) {
  const T* xp = static_cast<const T*>(x.data());
  const T* yp = with_y ? static_cast<const T*>(y.data()) : nullptr;
  T* op = static_cast<T*>(out.data());
  ParallelRange(out.NumElements(), [&](int64_t b, int64_t e) {
    if (with_y) {
      AxpbyRange(alpha, xp + b, beta, yp + b, op + b, e - b);
    } else {
      ScaleRange(alpha, xp + b, op + b, e - b);
    }
  });
}

// True when Axpby/Scale can take a range kernel above: x, y (if read) and out contiguous, of
// one dtype T.
bool SameContiguous(DType t, ConstTensorView x, ConstTensorView y, bool with_y, TensorView out) {
  if (out.dtype() != t || x.dtype() != t || !out.IsContiguous() || !x.IsContiguous()) return false;
  return !with_y || (y.dtype() == t && y.IsContiguous());
}

}  // namespace

absl::Status Copy(const Context& ctx, ConstTensorView src, TensorView dst) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t n = src.NumElements();
  if (n == 0) return absl::OkStatus();
  if (src.data() == dst.data() && src.dtype() == dst.dtype() &&
      std::memcmp(src.layout().strides, dst.layout().strides, sizeof(src.layout().strides)) == 0) {
    return absl::OkStatus();  // exact alias: nothing to do
  }
  if (src.IsContiguous() && dst.IsContiguous()) {
    if (src.dtype() == dst.dtype()) {
      std::memcpy(dst.data(), src.data(), static_cast<size_t>(n) * DTypeSize(src.dtype()));
    } else {
      Map1(src, dst, [](float v) { return v; });
    }
    return absl::OkStatus();
  }
  const TensorLayout s = Pad3(src.layout()), d = Pad3(dst.layout());
  DispatchDType(src.dtype(), [&](auto st) {
    using S = decltype(st);
    DispatchDType(dst.dtype(), [&](auto dt) {
      using D = decltype(dt);
      const S* sp = static_cast<const S*>(src.data());
      D* dp = static_cast<D*>(dst.data());
      ParallelRange(
          s.dims[0] * s.dims[1],
          [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
              const int64_t i0 = r / s.dims[1], i1 = r % s.dims[1];
              const S* si = sp + i0 * s.strides[0] + i1 * s.strides[1];
              D* di = dp + i0 * d.strides[0] + i1 * d.strides[1];
              for (int64_t j = 0; j < s.dims[2]; ++j) {
                di[j * d.strides[2]] = FromF32<D>(ToF32(si[j * s.strides[2]]));
              }
            }
          },
          std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, s.dims[2])));
    });
  });
  return absl::OkStatus();
}

absl::Status Fill(const Context& ctx, float value, TensorView dst) {
  cpu::ApplyThreadPolicy(ctx);
  DispatchDType(dst.dtype(), [&](auto dt) {
    using D = decltype(dt);
    const D v = FromF32<D>(value);
    D* dp = static_cast<D*>(dst.data());
    ParallelRange(dst.NumElements(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dp[i] = v;
    });
  });
  return absl::OkStatus();
}

absl::Status Axpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                   ConstTensorView y, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  const bool with_y = beta != 0.0f;
  if (SameContiguous(DType::kF32, x, y, with_y, out)) {
    AxpbyContiguous<float>(alpha, x, beta, y, with_y, out);
    return absl::OkStatus();
  }
  if (SameContiguous(DType::kBf16, x, y, with_y, out)) {
    AxpbyContiguous<BFloat16>(alpha, x, beta, y, with_y, out);
    return absl::OkStatus();
  }
  if (!with_y) {
    Map1(x, out, [alpha](float v) { return alpha * v; });
  } else {
    Map2(x, y, out, [alpha, beta](float a, float b) { return alpha * a + beta * b; });
  }
  return absl::OkStatus();
}

absl::Status AddScalar(const Context& ctx, float alpha, ConstTensorView x, float beta,
                       TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  Map1(x, out, [alpha, beta](float v) { return alpha * v + beta; });
  return absl::OkStatus();
}

absl::Status Unary(const Context& ctx, UnaryOp op, ConstTensorView x, TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  switch (op) {
    case UnaryOp::kSign:
      Map1(x, out, [](float v) { return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f); });
      break;
    case UnaryOp::kAbs:
      Map1(x, out, [](float v) { return std::fabs(v); });
      break;
    case UnaryOp::kSqrt:
      Map1(x, out, [](float v) { return std::sqrt(v); });
      break;
    case UnaryOp::kSquare:
      Map1(x, out, [](float v) { return v * v; });
      break;
    case UnaryOp::kNeg:
      Map1(x, out, [](float v) { return -v; });
      break;
    case UnaryOp::kNanToNum:
      Map1(x, out, [](float v) {
        return std::isnan(v) ? 0.0f : (std::isinf(v) ? (v > 0 ? FLT_MAX : -FLT_MAX) : v);
      });
      break;
    default:
      return absl::InvalidArgumentError("Unary: unknown UnaryOp");
  }
  return absl::OkStatus();
}

absl::Status Binary(const Context& ctx, BinaryOp op, ConstTensorView x, ConstTensorView y,
                    TensorView out) {
  cpu::ApplyThreadPolicy(ctx);
  if (x.NumElements() == 0) return absl::OkStatus();
  if ((op == BinaryOp::kMul || op == BinaryOp::kDiv) && x.dtype() == DType::kF32 &&
      y.dtype() == DType::kF32 && out.dtype() == DType::kF32 && y.NumElements() == 1 &&
      x.layout().IsContiguous() && out.layout().IsContiguous()) {
    const float b = *static_cast<const float*>(y.data());
    const float* xp = static_cast<const float*>(x.data());
    float* op_ = static_cast<float*>(out.data());
    ParallelRange(x.NumElements(), [&](int64_t s, int64_t e) {
      if (op == BinaryOp::kMul) {
        MulScalarF32Range(xp + s, b, op_ + s, e - s);
      } else {
        DivScalarF32Range(xp + s, b, op_ + s, e - s);
      }
    });
    return absl::OkStatus();
  }
  const TensorLayout xl = Pad3(x.layout());
  TensorLayout yl = Pad3(y.layout());
  for (int i = 0; i < 3; ++i) {
    if (yl.dims[i] == 1) yl.strides[i] = 0;
  }
  auto apply = [op](float a, float b) {
    switch (op) {
      case BinaryOp::kAdd:
        return a + b;
      case BinaryOp::kSub:
        return a - b;
      case BinaryOp::kMul:
        return a * b;
      case BinaryOp::kDiv:
        return a / b;
      case BinaryOp::kMax:  // NaN-propagating like torch.maximum
        return (std::isnan(a) || std::isnan(b)) ? NAN : (a > b ? a : b);
      case BinaryOp::kMin:
      default:
        return (std::isnan(a) || std::isnan(b)) ? NAN : (a < b ? a : b);
    }
  };
  DispatchDType(x.dtype(), [&](auto xt) {
    using X = decltype(xt);
    DispatchDType(y.dtype(), [&](auto yt) {
      using Y = decltype(yt);
      DispatchDType(out.dtype(), [&](auto ot) {
        using O = decltype(ot);
        const X* xp = static_cast<const X*>(x.data());
        const Y* yp = static_cast<const Y*>(y.data());
        O* op_ = static_cast<O*>(out.data());
        const int64_t rows = xl.dims[0] * xl.dims[1], cols = xl.dims[2];
        ParallelRange(
            rows,
            [&](int64_t b, int64_t e) {
              for (int64_t r = b; r < e; ++r) {
                const int64_t i0 = r / xl.dims[1], i1 = r % xl.dims[1];
                const Y* yr = yp + i0 * yl.strides[0] + i1 * yl.strides[1];
                const X* xr = xp + r * cols;
                O* orow = op_ + r * cols;
                for (int64_t j = 0; j < cols; ++j) {
                  orow[j] = FromF32<O>(apply(ToF32(xr[j]), ToF32(yr[j * yl.strides[2]])));
                }
              }
            },
            std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
      });
    });
  });
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
