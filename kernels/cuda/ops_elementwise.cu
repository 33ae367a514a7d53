// Elementwise, fused and gather/scatter ops of the CUDA backend. Each kernel is one Launch
// (ops_common.cuh) around the op's per-element function of kernels/elementwise_math.h, the same
// function the CPU loops call; built with --fmad=false so that no a·b + c is contracted where
// the CPU does not contract it (the element functions use fmaf where the reference fuses).
#include <cstring>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {
namespace {

namespace math = ::diond::kernels::math;

// A view padded to rank 3 ([1, 1, n] for rank 1).
struct P3 {
  void* p;
  int dtype;
  int64_t d[3];
  int64_t s[3];
};
P3 Pad3(const DiondTensor& t) {
  P3 r{t.data, t.dtype, {1, 1, 1}, {0, 0, 0}};
  const int shift = 3 - t.rank;
  for (int i = 0; i < 3; ++i) {
    if (i >= shift) {
      r.d[i] = t.dims[i - shift];
      r.s[i] = t.strides[i - shift];
    }
  }
  return r;
}

bool Contiguous(const DiondTensor& t) {
  int64_t expect = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    if (t.dims[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.dims[i];
  }
  return true;
}

// Copies `count` host indices to device scratch on the call's stream.
int UploadIndices(const DiondOpsCall* call, const char* op, const int64_t* idx, int64_t count,
                  Scratch* s) {
  DIOND_RC(s->Allocate(call, op, static_cast<size_t>(count) * sizeof(int64_t)));
  if (count > 0) {
    DIOND_CU(op, cudaMemcpyAsync(s->As<int64_t>(), idx, static_cast<size_t>(count) * 8,
                                 cudaMemcpyHostToDevice, StreamOf(call)));
  }
  return DIOND_OPS_OK;
}

}  // namespace

int OpCopy(const DiondOpsCall* call, DiondIn src, DiondOut dst) {
  constexpr const char* kOp = "Copy";
  DIOND_RC(UseDevice(call, kOp));
  const int64_t n = NumElements(*src);
  if (n == 0) return DIOND_OPS_OK;
  if (src->data == dst->data && src->dtype == dst->dtype &&
      std::memcmp(src->strides, dst->strides, sizeof(src->strides)) == 0) {
    return DIOND_OPS_OK;  // exact alias
  }
  if (Contiguous(*src) && Contiguous(*dst) && src->dtype == dst->dtype) {
    DIOND_CU(kOp,
             cudaMemcpyAsync(dst->data, src->data, static_cast<size_t>(n) * DtypeBytes(src->dtype),
                             cudaMemcpyDeviceToDevice, StreamOf(call)));
    return DIOND_OPS_OK;
  }
  const P3 s = Pad3(*src), d = Pad3(*dst);
  return Launch(call, kOp, n, [=] __device__(int64_t i) {
    const int64_t i2 = i % s.d[2], r = i / s.d[2], i1 = r % s.d[1], i0 = r / s.d[1];
    const float v = LoadAs(s.p, s.dtype, i0 * s.s[0] + i1 * s.s[1] + i2 * s.s[2]);
    StoreAs(d.p, d.dtype, i0 * d.s[0] + i1 * d.s[1] + i2 * d.s[2], v);
  });
}

int OpFill(const DiondOpsCall* call, float value, DiondOut dst) {
  DIOND_RC(UseDevice(call, "Fill"));
  void* p = dst->data;
  const int dt = dst->dtype;
  return Launch(call, "Fill", NumElements(*dst),
                [=] __device__(int64_t i) { StoreAs(p, dt, i, value); });
}

int OpAxpby(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondIn y, DiondOut out) {
  DIOND_RC(UseDevice(call, "Axpby"));
  const void* xp = x->data;
  const int xt = x->dtype, ot = out->dtype;
  void* op = out->data;
  if (beta == 0.0f) {
    return Launch(call, "Axpby", NumElements(*out),
                  [=] __device__(int64_t i) { StoreAs(op, ot, i, alpha * LoadAs(xp, xt, i)); });
  }
  const void* yp = y->data;
  const int yt = y->dtype;
  return Launch(call, "Axpby", NumElements(*out), [=] __device__(int64_t i) {
    StoreAs(op, ot, i, alpha * LoadAs(xp, xt, i) + beta * LoadAs(yp, yt, i));
  });
}

int OpAddScalar(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondOut out) {
  DIOND_RC(UseDevice(call, "AddScalar"));
  const void* xp = x->data;
  const int xt = x->dtype, ot = out->dtype;
  void* op = out->data;
  return Launch(call, "AddScalar", NumElements(*out), [=] __device__(int64_t i) {
    StoreAs(op, ot, i, alpha * LoadAs(xp, xt, i) + beta);
  });
}

int OpUnary(const DiondOpsCall* call, int32_t code, DiondIn x, DiondOut out) {
  DIOND_RC(UseDevice(call, "Unary"));
  const void* xp = x->data;
  const int xt = x->dtype, ot = out->dtype;
  void* op = out->data;
  return Launch(call, "Unary", NumElements(*out), [=] __device__(int64_t i) {
    StoreAs(op, ot, i, math::UnaryElement(code, LoadAs(xp, xt, i)));
  });
}

int OpBinary(const DiondOpsCall* call, int32_t code, DiondIn x, DiondIn y, DiondOut out) {
  DIOND_RC(UseDevice(call, "Binary"));
  const P3 xs = Pad3(*x);
  P3 ys = Pad3(*y);
  for (int i = 0; i < 3; ++i) {
    if (ys.d[i] == 1) ys.s[i] = 0;  // broadcast
  }
  const int ot = out->dtype;
  void* op = out->data;
  return Launch(call, "Binary", NumElements(*x), [=] __device__(int64_t i) {
    const int64_t i2 = i % xs.d[2], r = i / xs.d[2], i1 = r % xs.d[1], i0 = r / xs.d[1];
    const float a = LoadAs(xs.p, xs.dtype, i);
    const float b = LoadAs(ys.p, ys.dtype, i0 * ys.s[0] + i1 * ys.s[1] + i2 * ys.s[2]);
    StoreAs(op, ot, i, math::BinaryElement(code, a, b));
  });
}

// A += value·I on each matrix of a rank-2/3 f32 view (rows == cols).
int OpAddToDiagonal(const DiondOpsCall* call, float value, DiondOut a) {
  DIOND_RC(UseDevice(call, "AddToDiagonal"));
  const P3 t = Pad3(*a);
  float* p = static_cast<float*>(t.p);
  const int64_t n = t.d[1];
  return Launch(call, "AddToDiagonal", t.d[0] * n, [=] __device__(int64_t i) {
    const int64_t b = i / n, r = i % n;
    p[b * t.s[0] + r * t.s[1] + r * t.s[2]] += value;
  });
}

// The reference's bf16 rounding points on f32 storage (contiguous f32 views).
int OpBf16RoundedAxpby(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondIn y,
                       DiondOut out) {
  DIOND_RC(UseDevice(call, "Bf16RoundedAxpby"));
  if (out->dtype == DIOND_DT_BF16) {  // bf16 storage (the adapter checked x and y match)
    const uint16_t* yb = static_cast<const uint16_t*>(y->data);
    uint16_t* ob = static_cast<uint16_t*>(out->data);
    if (alpha == 0.0f) {
      return Launch(call, "Bf16RoundedAxpby", NumElements(*out), [=] __device__(int64_t i) {
        ob[i] = math::Bf16BitsFromFloat(
            math::Bf16RoundedAxpbyElement(0.0f, 0.0f, beta, math::FloatFromBf16Bits(yb[i]), false));
      });
    }
    const uint16_t* xb = static_cast<const uint16_t*>(x->data);
    return Launch(call, "Bf16RoundedAxpby", NumElements(*out), [=] __device__(int64_t i) {
      ob[i] = math::Bf16BitsFromFloat(math::Bf16RoundedAxpbyElement(
          alpha, math::FloatFromBf16Bits(xb[i]), beta, math::FloatFromBf16Bits(yb[i]), true));
    });
  }
  const float* yp = static_cast<const float*>(y->data);
  float* op = static_cast<float*>(out->data);
  if (alpha == 0.0f) {
    return Launch(call, "Bf16RoundedAxpby", NumElements(*out), [=] __device__(int64_t i) {
      op[i] = math::Bf16RoundedAxpbyElement(0.0f, 0.0f, beta, yp[i], false);
    });
  }
  const float* xp = static_cast<const float*>(x->data);
  return Launch(call, "Bf16RoundedAxpby", NumElements(*out), [=] __device__(int64_t i) {
    op[i] = math::Bf16RoundedAxpbyElement(alpha, xp[i], beta, yp[i], true);
  });
}

namespace {
template <typename Scalars>
int AdamWWith(const DiondOpsCall* call, Scalars scalars, DiondIn grad, DiondOut x, DiondOut m,
              DiondOut v) {
  DIOND_RC(UseDevice(call, "AdamWStep"));
  const float* g = static_cast<const float*>(grad->data);
  float* xp = static_cast<float*>(x->data);
  float* mp = static_cast<float*>(m->data);
  float* vp = static_cast<float*>(v->data);
  return Launch(call, "AdamWStep", NumElements(*x), [=] __device__(int64_t i) {
    math::AdamWElement(scalars(), g[i], xp[i], mp[i], vp[i]);
  });
}
template <typename Scalars>
int LionWith(const DiondOpsCall* call, Scalars scalars, DiondIn grad, DiondOut x, DiondOut m) {
  DIOND_RC(UseDevice(call, "LionStep"));
  const float* g = static_cast<const float*>(grad->data);
  float* xp = static_cast<float*>(x->data);
  float* mp = static_cast<float*>(m->data);
  return Launch(call, "LionStep", NumElements(*x),
                [=] __device__(int64_t i) { math::LionElement(scalars(), g[i], xp[i], mp[i]); });
}
}  // namespace

int OpAdamWStep(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad, DiondOut x,
                DiondOut m, DiondOut v) {
  return AdamWWith(call, AdamWByValue{AdamWOf(c)}, grad, x, m, v);
}
int OpAdamWStepDev(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad, DiondOut x,
                   DiondOut m, DiondOut v) {
  return AdamWWith(call, AdamWOnDevice{c}, grad, x, m, v);
}
int OpLionStep(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
               DiondOut m) {
  return LionWith(call, LionByValue{LionOf(c)}, grad, x, m);
}
int OpLionStepDev(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
                  DiondOut m) {
  return LionWith(call, LionOnDevice{c}, grad, x, m);
}

int OpGather(const DiondOpsCall* call, DiondIn a, int32_t axis, const int64_t* indices,
             int64_t count, DiondOut out) {
  constexpr const char* kOp = "Gather";
  DIOND_RC(UseDevice(call, kOp));
  Scratch idx;
  DIOND_RC(UploadIndices(call, kOp, indices, count, &idx));
  const Mat3 s = AsMat3(*a), d = AsMat3(*out);
  const int64_t* ix = idx.As<int64_t>();
  const bool rows = axis == 0;
  return Launch(call, kOp, d.batch * d.rows * d.cols, [=] __device__(int64_t i) {
    const int64_t j = i % d.cols, r = i / d.cols, row = r % d.rows, b = r / d.rows;
    const int64_t sr = rows ? ix[row] : row, sc = rows ? j : ix[j];
    const float v = LoadAs(s.p, s.dtype, b * s.bs + sr * s.rs + sc * s.cs);
    StoreAs(d.p, d.dtype, b * d.bs + row * d.rs + j * d.cs, v);
  });
}

int OpScatter(const DiondOpsCall* call, DiondIn src, int32_t axis, const int64_t* indices,
              int64_t count, float alpha, float beta, DiondOut dst) {
  constexpr const char* kOp = "Scatter";
  DIOND_RC(UseDevice(call, kOp));
  Scratch idx;
  DIOND_RC(UploadIndices(call, kOp, indices, count, &idx));
  const Mat3 s = AsMat3(*src), d = AsMat3(*dst);
  const int64_t* ix = idx.As<int64_t>();
  const bool rows = axis == 0;
  return Launch(call, kOp, d.batch * s.rows * s.cols, [=] __device__(int64_t i) {
    const int64_t j = i % s.cols, r = i / s.cols, row = r % s.rows, b = r / s.rows;
    const int64_t dr = rows ? ix[row] : row, dc = rows ? j : ix[j];
    const int64_t at = b * d.bs + dr * d.rs + dc * d.cs;
    const float v = alpha * LoadAs(s.p, s.dtype, b * s.bs + row * s.rs + j * s.cs);
    StoreAs(d.p, d.dtype, at, beta == 0.0f ? v : v + beta * LoadAs(d.p, d.dtype, at));
  });
}

}  // namespace diond::cuda
