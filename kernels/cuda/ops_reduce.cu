// Reductions and selection of the CUDA backend: FrobeniusNorm, AxisNorms, TopKByL1Norm,
// IsAllZero.
//
// Sums, in double and in the CPU backend's order (kernels/cpu/reduce.cc), so norms are
// bit-identical to the CPU's and a top-k by norm selects the same slices: a row by one warp in
// the row-sum order of math::FoldRowSumLanes (elementwise_math.h; coalesced loads), a column by
// one thread in row order (adjacent threads read adjacent columns). The Frobenius norm adds the
// row sums of a matrix in row order.
// TopKByL1Norm: CUB's stable descending radix sort of (TopKOrderKey(score), index) pairs,
// indices given ascending, which is the CPU's order exactly (elementwise_math.h; tested on the
// CPU).
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {
namespace {

namespace math = ::diond::kernels::math;

// norm: 0 L1 (Σ|x|), otherwise Σx².
__device__ __forceinline__ double Term(int l1, float v) {
  const double d = static_cast<double>(v);
  return l1 ? fabs(d) : d * d;
}

// A warp per row (grid-stride over the rows, RowGrid): lane l adds the terms l, l + 32, ... in
// order, and FoldWarp folds the lanes: math::FoldRowSumLanes's order exactly (the CPU's), with the
// row read coalesced.
__global__ void RowSumsKernel(Mat3 a, int l1, int64_t n_rows, double* sums) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  // r is the same for every lane of a warp, so the shuffles see the whole warp.
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / kWarp;
       r < n_rows; r += warps) {
    const int64_t b = r / a.rows, i = r % a.rows;
    const int64_t base = b * a.bs + i * a.rs;
    double s = 0.0;
    for (int64_t j = lane; j < a.cols; j += kWarp) {
      s += Term(l1, LoadAs(a.p, a.dtype, base + j * a.cs));
    }
    s = FoldWarp(s);
    if (lane == 0) sums[r] = s;
  }
}

int RowSums(const DiondOpsCall* call, const char* op, const Mat3& a, int l1, double* sums) {
  const int64_t n_rows = a.batch * a.rows;
  if (n_rows <= 0) return DIOND_OPS_OK;
  RowSumsKernel<<<RowGrid(n_rows), kThreads, 0, StreamOf(call)>>>(a, l1, n_rows, sums);
  return CheckLaunch(call, op);
}

int ColSums(const DiondOpsCall* call, const char* op, const Mat3& a, int l1, double* sums) {
  return Launch(call, op, a.batch * a.cols, [=] __device__(int64_t c) {
    const int64_t b = c / a.cols, j = c % a.cols;
    const int64_t base = b * a.bs + j * a.cs;
    double s = 0.0;
    for (int64_t i = 0; i < a.rows; ++i) s += Term(l1, LoadAs(a.p, a.dtype, base + i * a.rs));
    sums[c] = s;
  });
}

int Norms(const DiondOpsCall* call, const char* op, const DiondTensor& a, int32_t axis,
          int32_t norm, float* out) {
  const Mat3 m = AsMat3(a);
  const int64_t per = axis == 0 ? m.rows : m.cols;
  Scratch sums;
  DIOND_RC(sums.Allocate(call, op, static_cast<size_t>(m.batch * per) * sizeof(double)));
  double* s = sums.As<double>();
  const int l1 = norm == 0;
  DIOND_RC(axis == 0 ? RowSums(call, op, m, l1, s) : ColSums(call, op, m, l1, s));
  const bool sqrt_it = norm == 1;
  return Launch(call, op, m.batch * per, [=] __device__(int64_t i) {
    out[i] = static_cast<float>(sqrt_it ? sqrt(s[i]) : s[i]);
  });
}

__global__ void OrderKeys(const float* scores, int64_t n, uint32_t* keys, int64_t* idx) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = math::TopKOrderKey(scores[i]);
    idx[i] = i;
  }
}

// The first k indices of the top-k order (TopKByL1Norm's) of `scores` (n f32 on the device)
// into host `indices`.
int SortedTopK(const DiondOpsCall* call, const char* op, const float* scores, int64_t n, int64_t k,
               int64_t* indices) {
  if (n > INT32_MAX)
    return Fail(call, DIOND_OPS_INTERNAL, "%s: %lld scores (> 2^31)", op,
                static_cast<long long>(n));
  Scratch keys_in, keys_out, idx_in, idx_out, temp;
  DIOND_RC(keys_in.Allocate(call, op, static_cast<size_t>(n) * 4));
  DIOND_RC(keys_out.Allocate(call, op, static_cast<size_t>(n) * 4));
  DIOND_RC(idx_in.Allocate(call, op, static_cast<size_t>(n) * 8));
  DIOND_RC(idx_out.Allocate(call, op, static_cast<size_t>(n) * 8));
  OrderKeys<<<GridFor(n), kThreads, 0, StreamOf(call)>>>(scores, n, keys_in.As<uint32_t>(),
                                                         idx_in.As<int64_t>());
  DIOND_RC(CheckLaunch(call, op));
  size_t temp_bytes = 0;
  DIOND_CU(op, cub::DeviceRadixSort::SortPairsDescending(
                   nullptr, temp_bytes, keys_in.As<uint32_t>(), keys_out.As<uint32_t>(),
                   idx_in.As<int64_t>(), idx_out.As<int64_t>(), static_cast<int>(n), 0, 32,
                   StreamOf(call)));
  DIOND_RC(temp.Allocate(call, op, temp_bytes));
  DIOND_CU(op, cub::DeviceRadixSort::SortPairsDescending(
                   temp.As<void>(), temp_bytes, keys_in.As<uint32_t>(), keys_out.As<uint32_t>(),
                   idx_in.As<int64_t>(), idx_out.As<int64_t>(), static_cast<int>(n), 0, 32,
                   StreamOf(call)));
  DIOND_CU(op, cudaMemcpyAsync(indices, idx_out.As<int64_t>(), static_cast<size_t>(k) * 8,
                               cudaMemcpyDeviceToHost, StreamOf(call)));
  return Sync(call, op);  // sync point: the indices are host memory
}

}  // namespace

int OpFrobeniusNorm(const DiondOpsCall* call, DiondIn a, DiondOut out) {
  constexpr const char* kOp = "FrobeniusNorm";
  DIOND_RC(UseDevice(call, kOp));
  const Mat3 m = AsMat3(*a);
  if (m.batch == 0) return DIOND_OPS_OK;
  Scratch sums;
  DIOND_RC(sums.Allocate(call, kOp, static_cast<size_t>(m.batch * m.rows) * sizeof(double)));
  double* s = sums.As<double>();
  DIOND_RC(RowSums(call, kOp, m, /*l1=*/0, s));
  float* o = static_cast<float*>(out->data);
  const int64_t rows = m.rows;
  return Launch(call, kOp, m.batch, [=] __device__(int64_t b) {
    double t = 0.0;
    for (int64_t r = 0; r < rows; ++r) t += s[b * rows + r];
    o[b] = static_cast<float>(sqrt(t));
  });
}

int OpAxisNorms(const DiondOpsCall* call, DiondIn a, int32_t axis, int32_t norm, DiondOut out) {
  DIOND_RC(UseDevice(call, "AxisNorms"));
  return Norms(call, "AxisNorms", *a, axis, norm, static_cast<float*>(out->data));
}

int OpTopKByL1Norm(const DiondOpsCall* call, DiondIn a, int32_t axis, int64_t k, int64_t* indices,
                   DiondOut scores_out) {
  constexpr const char* kOp = "TopKByL1Norm";
  DIOND_RC(UseDevice(call, kOp));
  const Mat3 m = AsMat3(*a);
  const int64_t n = axis == 0 ? m.rows : m.cols;
  Scratch own;
  float* scores = nullptr;
  if (Absent(scores_out)) {
    DIOND_RC(own.Allocate(call, kOp, static_cast<size_t>(n) * 4));
    scores = own.As<float>();
  } else {
    scores = static_cast<float*>(scores_out->data);
  }
  DIOND_RC(Norms(call, kOp, *a, axis, /*L1*/ 0, scores));
  return SortedTopK(call, kOp, scores, n, k, indices);
}

int OpIsAllZero(const DiondOpsCall* call, DiondIn a, int32_t* all_zero) {
  constexpr const char* kOp = "IsAllZero";
  DIOND_RC(UseDevice(call, kOp));
  const Mat3 m = AsMat3(*a);
  Scratch flag;
  DIOND_RC(flag.Allocate(call, kOp, sizeof(int)));
  int* f = flag.As<int>();
  DIOND_CU(kOp, cudaMemsetAsync(f, 0, sizeof(int), StreamOf(call)));
  DIOND_RC(Launch(call, kOp, m.batch * m.rows * m.cols, [=] __device__(int64_t i) {
    const int64_t j = i % m.cols, r = i / m.cols, row = r % m.rows, b = r / m.rows;
    const int64_t at = b * m.bs + row * m.rs + j * m.cs;
    // +0 and -0 are zero; everything else (NaN included) is not.
    const bool nonzero =
        m.dtype == DIOND_DT_F32
            ? (__float_as_uint(static_cast<const float*>(m.p)[at]) & 0x7fffffffu) != 0u
            : (static_cast<const uint16_t*>(m.p)[at] & 0x7fffu) != 0u;
    if (nonzero) *f = 1;
  }));
  int h = 0;
  DIOND_CU(kOp, cudaMemcpyAsync(&h, f, sizeof(int), cudaMemcpyDeviceToHost, StreamOf(call)));
  DIOND_RC(Sync(call, kOp));  // sync point: the answer is a host bool
  *all_zero = h == 0 ? 1 : 0;
  return DIOND_OPS_OK;
}

// ---- the session's passes (ops.h "steps" block) ----------------------------------------------
// The finiteness flag is an integer OR (math::NonFiniteBit), so the answer does not depend on the
// order the threads run in; each op is a sync point (the flag is a host value).
namespace {
int FiniteFlagToHost(const DiondOpsCall* call, const char* op, const unsigned* f,
                     int32_t* all_finite) {
  unsigned h = 0;
  DIOND_CU(op, cudaMemcpyAsync(&h, f, sizeof(h), cudaMemcpyDeviceToHost, StreamOf(call)));
  DIOND_RC(Sync(call, op));
  *all_finite = h == 0 ? 1 : 0;
  return DIOND_OPS_OK;
}
}  // namespace

int OpAllFinite(const DiondOpsCall* call, DiondIn x, int32_t* all_finite) {
  constexpr const char* kOp = "AllFinite";
  DIOND_RC(UseDevice(call, kOp));
  Scratch flag;
  DIOND_RC(flag.Allocate(call, kOp, sizeof(unsigned)));
  unsigned* f = flag.As<unsigned>();
  DIOND_CU(kOp, cudaMemsetAsync(f, 0, sizeof(unsigned), StreamOf(call)));
  const void* p = x->data;
  const int dt = x->dtype;
  DIOND_RC(Launch(call, kOp, NumElements(*x), [=] __device__(int64_t i) {
    if (math::NonFiniteBit(LoadAs(p, dt, i)) != 0u) atomicOr(f, 1u);
  }));
  return FiniteFlagToHost(call, kOp, f, all_finite);
}

int OpWidenScaleCheckFinite(const DiondOpsCall* call, DiondIn x, float scale, DiondOut out,
                            int32_t* all_finite) {
  constexpr const char* kOp = "WidenScaleCheckFinite";
  DIOND_RC(UseDevice(call, kOp));
  Scratch flag;
  DIOND_RC(flag.Allocate(call, kOp, sizeof(unsigned)));
  unsigned* f = flag.As<unsigned>();
  DIOND_CU(kOp, cudaMemsetAsync(f, 0, sizeof(unsigned), StreamOf(call)));
  const void* p = x->data;
  const int dt = x->dtype;
  float* o = static_cast<float*>(out->data);
  const bool unit = scale == 1.0f;  // as the CPU: no multiply at scale 1
  DIOND_RC(Launch(call, kOp, NumElements(*x), [=] __device__(int64_t i) {
    const float v = unit ? LoadAs(p, dt, i) : LoadAs(p, dt, i) * scale;
    o[i] = v;
    if (math::NonFiniteBit(v) != 0u) atomicOr(f, 1u);
  }));
  return FiniteFlagToHost(call, kOp, f, all_finite);
}

// asynccopy: the scans above with the answer left on the device. Every thread that finds a
// non-finite element stores 1.0f into the flag (the same value: the race is benign); nothing is
// read back, so these are not sync points.
int OpAllFiniteFlag(const DiondOpsCall* call, DiondIn x, DiondOut nonfinite) {
  constexpr const char* kOp = "AllFiniteFlag";
  DIOND_RC(UseDevice(call, kOp));
  const void* p = x->data;
  const int dt = x->dtype;
  float* f = static_cast<float*>(nonfinite->data);
  return Launch(call, kOp, NumElements(*x), [=] __device__(int64_t i) {
    if (math::NonFiniteBit(LoadAs(p, dt, i)) != 0u) *f = 1.0f;
  });
}

int OpWidenScaleCheckFiniteFlag(const DiondOpsCall* call, DiondIn x, float scale, DiondOut out,
                                DiondOut nonfinite) {
  constexpr const char* kOp = "WidenScaleCheckFiniteFlag";
  DIOND_RC(UseDevice(call, kOp));
  const void* p = x->data;
  const int dt = x->dtype;
  float* o = static_cast<float*>(out->data);
  float* f = static_cast<float*>(nonfinite->data);
  const bool unit = scale == 1.0f;  // as the CPU: no multiply at scale 1
  return Launch(call, kOp, NumElements(*x), [=] __device__(int64_t i) {
    const float v = unit ? LoadAs(p, dt, i) : LoadAs(p, dt, i) * scale;
    o[i] = v;
    if (math::NonFiniteBit(v) != 0u) *f = 1.0f;
  });
}

// FNV-1a chains every byte, so it is serial by definition: the bytes come to the host (one copy,
// a sync point) and are hashed there with the CPU's per-byte function. Only the world's replica
// checksums use it, once per step over the replicated tensors.
int OpFnv1aChecksum(const DiondOpsCall* call, DiondIn x, uint64_t* checksum) {
  constexpr const char* kOp = "Fnv1aChecksum";
  DIOND_RC(UseDevice(call, kOp));
  const size_t bytes = static_cast<size_t>(NumElements(*x)) * 4;
  std::vector<unsigned char> host(bytes);
  if (bytes > 0) {
    DIOND_CU(kOp,
             cudaMemcpyAsync(host.data(), x->data, bytes, cudaMemcpyDeviceToHost, StreamOf(call)));
    DIOND_RC(Sync(call, kOp));
  }
  unsigned long long h = 0xcbf29ce484222325ull;
  for (unsigned char b : host) h = math::Fnv1aByte(h, b);
  *checksum = h;
  return DIOND_OPS_OK;
}

}  // namespace diond::cuda
