// Shared pieces of the CUDA ops backend (kernels/cuda/ops_*.cu): error reporting in the C ABI's
// typed element access and the generic elementwise launcher (the host-side runtime pieces:
// kernels/cuda/runtime.h). Internal to the plugin.
#ifndef DIOND_KERNELS_CUDA_OPS_COMMON_CUH_
#define DIOND_KERNELS_CUDA_OPS_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/call_descriptors.h"
#include "kernels/cuda/plugin_api.h"
#include "kernels/cuda/runtime.h"
#include "kernels/elementwise_math.h"

namespace diond::cuda {

// ---- element access -------------------------------------------------------------------------

__device__ __forceinline__ float LoadAs(const void* p, int dtype, int64_t i) {
  if (dtype == DIOND_DT_F32) return static_cast<const float*>(p)[i];
  if (dtype == DIOND_DT_BF16) {
    return kernels::math::FloatFromBf16Bits(static_cast<const uint16_t*>(p)[i]);
  }
  return __half2float(static_cast<const __half*>(p)[i]);
}
__device__ __forceinline__ void StoreAs(void* p, int dtype, int64_t i, float v) {
  if (dtype == DIOND_DT_F32) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == DIOND_DT_BF16) {
    static_cast<uint16_t*>(p)[i] = kernels::math::Bf16BitsFromFloat(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

inline size_t DtypeBytes(int dtype) { return dtype == DIOND_DT_F32 ? 4 : 2; }

inline int64_t NumElements(const DiondTensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.rank; ++i) n *= t.dims[i];
  return n;
}

// A view as `batch` matrices rows×cols with element strides (rank 0: 1×1, rank 1: 1×n).
struct Mat3 {
  void* p;
  int dtype;
  int64_t batch, rows, cols;
  int64_t bs, rs, cs;
};
inline Mat3 AsMat3(const DiondTensor& t) {
  Mat3 m{t.data, t.dtype, 1, 1, 1, 0, 0, 0};
  if (t.rank == 1) {
    m.cols = t.dims[0];
    m.cs = t.strides[0];
    m.rs = m.cols * m.cs;
  } else if (t.rank == 2) {
    m.rows = t.dims[0];
    m.cols = t.dims[1];
    m.rs = t.strides[0];
    m.cs = t.strides[1];
  } else if (t.rank == 3) {
    m.batch = t.dims[0];
    m.rows = t.dims[1];
    m.cols = t.dims[2];
    m.bs = t.strides[0];
    m.rs = t.strides[1];
    m.cs = t.strides[2];
  }
  return m;
}
// The descriptor's view of a row-major operand (unit column stride assumed, as ops.h requires).
inline cuda_calls::RowMajor AsRowMajor(const DiondTensor& t) {
  const Mat3 m = AsMat3(t);
  cuda_calls::RowMajor r;
  r.rows = m.rows;
  r.cols = m.cols;
  r.row_stride = m.rs;
  r.batch = m.batch;
  r.batch_stride = m.bs;
  return r;
}
inline bool Absent(const DiondTensor* t) { return t == nullptr || t->data == nullptr; }

// ---- the generic elementwise launcher -------------------------------------------------------
// Launch(call, op, n, f) runs f(i) for i in [0, n) on call->stream; f is a __device__ lambda
// (nvcc --extended-lambda). Adding an elementwise op is one Launch around the op's per-element
// function of kernels/elementwise_math.h (docs/GPU.md).
template <typename F>
__global__ void MapKernel(int64_t n, F f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(i);
  }
}
constexpr int kThreads = 256;
inline unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 * 8 ? blocks : 65536 * 8);
}
template <typename F>
int Launch(const DiondOpsCall* call, const char* op, int64_t n, F f) {
  if (n <= 0) return DIOND_OPS_OK;
  MapKernel<<<GridFor(n), kThreads, 0, StreamOf(call)>>>(n, f);
  return CheckLaunch(call, op);
}

// ---- row sums: a warp per row (math::FoldRowSumLanes, elementwise_math.h) --------------------
// A kernel over rows gives each warp of a kThreads block one row at a time (row r = warp index,
// grid-stride over RowGrid(rows) blocks); lane l adds the row's terms l, l + 32, ... in order into
// a double, and FoldWarp folds the 32 lanes pairwise (16, 8, 4, 2, 1), which is the CPU's order
// bit for bit (--fmad=false keeps every product and sum rounded as written). Every lane of a warp
// must call FoldWarp (the shuffles name the whole warp); lane 0 gets the row's sum.
constexpr int kWarp = 32;
static_assert(kernels::math::kRowSumLanes == kWarp, "the row-sum order: one lane per warp thread");
constexpr int kRowsPerBlock = kThreads / kWarp;
inline unsigned RowGrid(int64_t rows) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  return static_cast<unsigned>(blocks < 65536 * 8 ? blocks : 65536 * 8);
}
__device__ __forceinline__ double FoldWarp(double s) {
  for (int h = kWarp / 2; h > 0; h /= 2) s += __shfl_down_sync(0xffffffffu, s, h);
  return s;
}

// ---- the fused steps' scalars (ops_elementwise.cu, ops_fused.cu): the plugin's records as the
// shared element functions take them, and where a kernel gets them: ByValue (formed on the host
// at the call, passed in the kernel's arguments) or OnDevice (graph: a device record read by
// every thread when the kernel runs, so a replayed graph gets the record the host uploaded
// before the launch; DIOND_OPS_API_VERSION 8).
__host__ __device__ inline kernels::math::AdamWScalars AdamWOf(const DiondAdamWScalars* c) {
  return kernels::math::AdamWScalars{c->decay,        c->lr_wd, c->one_minus_b1,
                                     c->one_minus_b2, c->beta2, c->step_size,
                                     c->sqrt_bc2,     c->eps,   c->cautious != 0};
}
__host__ __device__ inline kernels::math::LionScalars LionOf(const DiondLionScalars* c) {
  return kernels::math::LionScalars{c->w1, c->w2, c->lr_wd, c->decay, c->lr, c->cautious != 0};
}
__host__ __device__ inline kernels::math::ApplyUpdateScalars ApplyUpdateOf(
    const DiondApplyUpdateScalars* c) {
  kernels::math::ApplyUpdateScalars s;
  s.alpha = c->alpha;
  s.decay = c->decay;
  s.lr_wd = c->lr_wd;
  s.cautious = c->cautious != 0;
  s.round_bf16 = c->round_bf16 != 0;
  return s;
}
template <typename S>
struct ByValue {
  S s;
  __device__ S operator()() const { return s; }
};
template <typename S, typename R, S (*Of)(const R*)>
struct OnDevice {
  const R* c;
  __device__ S operator()() const { return Of(c); }
};
using AdamWByValue = ByValue<kernels::math::AdamWScalars>;
using AdamWOnDevice = OnDevice<kernels::math::AdamWScalars, DiondAdamWScalars, &AdamWOf>;
using LionByValue = ByValue<kernels::math::LionScalars>;
using LionOnDevice = OnDevice<kernels::math::LionScalars, DiondLionScalars, &LionOf>;
using ApplyUpdateByValue = ByValue<kernels::math::ApplyUpdateScalars>;
using ApplyUpdateOnDevice =
    OnDevice<kernels::math::ApplyUpdateScalars, DiondApplyUpdateScalars, &ApplyUpdateOf>;

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_OPS_COMMON_CUH_
