// kops's fused optimizer phases on the CUDA backend (ops.h "kops" block): tracked AdamW/Lion,
// MomentumUpdate, ApplyUpdate, NormalizeNeurons, CopyWithChange, DecayScatterWithChange (Dion2's
// deferred parameter write). NEVER RUN ON A GPU so far (no
// GPU was available when they were written); cuda_ops_test (label gpu) checks them.
//
// Per element, every kernel calls the op's function of kernels/elementwise_math.h, the one the
// CPU loops call (built with --fmad=false): x, m, v, u and the normalized O are bit-identical to
// the CPU's wherever the inputs to those functions are.
//
// Sums that differ in order from the CPU's (docs/GPU.md, "Summation order"):
//   * update_sq (the tracked steps, CopyWithChange): Σ(x_after − x_before)² in double, each thread
//     over a grid-stride set of elements, a tree in shared memory per block, then the block
//     partials in block order by one thread; the CPU sums in element order per thread range.
//     Both are double sums of non-negative terms rounded once to f32, so they differ by at most
//     one f32 ulp (relative 2^-23) on any realistic n.
// NormalizeNeurons is the CPU's bit for bit: the row sums of O² (hence ν and V) and of D² are a
// warp per row in the row-sum order of math::FoldRowSumLanes (the CPU's), and ‖O‖², ‖D‖² of a
// unit are those row sums added in row order, as on the CPU.
#include <vector>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {
namespace {

namespace math = ::diond::kernels::math;

__device__ __forceinline__ double Sq(float after, float before) {
  const double d = static_cast<double>(after) - static_cast<double>(before);
  return d * d;
}

// ---- a double sum next to an elementwise pass ------------------------------------------------
// LaunchSum(call, op, n, f, out) runs f(i) (a __device__ lambda returning a double term) for i in
// [0, n) and writes the sum of the terms, rounded once, to the f32 *out (device memory).
constexpr unsigned kMaxSumBlocks = 1024;

template <typename F>
__global__ void SumKernel(int64_t n, F f, double* partial) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc += f(i);
  }
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

__global__ void FinishSum(const double* partial, unsigned parts, float* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = 0.0;
  for (unsigned i = 0; i < parts; ++i) s += partial[i];
  *out = static_cast<float>(s);
}

template <typename F>
int LaunchSum(const DiondOpsCall* call, const char* op, int64_t n, F f, float* out) {
  if (n <= 0) {
    DIOND_CU(op, cudaMemsetAsync(out, 0, sizeof(float), StreamOf(call)));  // +0.0f
    return DIOND_OPS_OK;
  }
  const unsigned grid = GridFor(n);
  const unsigned blocks = grid < kMaxSumBlocks ? grid : kMaxSumBlocks;
  Scratch partial;
  DIOND_RC(partial.Allocate(call, op, blocks * sizeof(double)));
  SumKernel<<<blocks, kThreads, 0, StreamOf(call)>>>(n, f, partial.As<double>());
  DIOND_RC(CheckLaunch(call, op));
  FinishSum<<<1, 1, 0, StreamOf(call)>>>(partial.As<double>(), blocks, out);
  DIOND_RC(CheckLaunch(call, op));
  return DIOND_OPS_OK;
}

template <typename Scalars>
int AdamWTracked(const DiondOpsCall* call, Scalars scalars, DiondIn grad, DiondOut x, DiondOut m,
                 DiondOut v, DiondOut update_sq) {
  constexpr const char* kOp = "AdamWStep (tracked)";
  DIOND_RC(UseDevice(call, kOp));
  const float* g = static_cast<const float*>(grad->data);
  float* xp = static_cast<float*>(x->data);
  float* mp = static_cast<float*>(m->data);
  float* vp = static_cast<float*>(v->data);
  return LaunchSum(
      call, kOp, NumElements(*x),
      [=] __device__(int64_t i) {
        const math::AdamWScalars s = scalars();
        const float before = xp[i];
        float xi = before, mi = mp[i], vi = vp[i];
        math::AdamWElement(s, g[i], xi, mi, vi);
        xp[i] = xi;
        mp[i] = mi;
        vp[i] = vi;
        return Sq(xi, before);
      },
      static_cast<float*>(update_sq->data));
}

template <typename Scalars>
int LionTracked(const DiondOpsCall* call, Scalars scalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut update_sq) {
  constexpr const char* kOp = "LionStep (tracked)";
  DIOND_RC(UseDevice(call, kOp));
  const float* g = static_cast<const float*>(grad->data);
  float* xp = static_cast<float*>(x->data);
  float* mp = static_cast<float*>(m->data);
  return LaunchSum(
      call, kOp, NumElements(*x),
      [=] __device__(int64_t i) {
        const math::LionScalars s = scalars();
        const float before = xp[i];
        float xi = before, mi = mp[i];
        math::LionElement(s, g[i], xi, mi);
        xp[i] = xi;
        mp[i] = mi;
        return Sq(xi, before);
      },
      static_cast<float*>(update_sq->data));
}

// NormalizeNeurons' rows, a warp per row (ops_common.cuh "row sums"): Σo² (kept for the unit's
// ‖O‖²), V ← lerp(V, ν, w) by lane 0 (broadcast to the warp before anyone writes), the row
// divided in place, and ΣD² (kept for ‖D‖²).
__global__ void NormalizeRowsKernel(float* op, float* vp, int64_t rows, int64_t cols, float fcols,
                                    float w, double* o_sq, double* d_sq) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / kWarp; i < rows;
       i += warps) {
    float* row = op + i * cols;
    double ss = 0.0;
    for (int64_t c = lane; c < cols; c += kWarp) ss += static_cast<double>(row[c]) * row[c];
    ss = FoldWarp(ss);
    float vi = 0.0f;
    if (lane == 0) {
      vi = math::NeuronVarianceElement(vp[i], ss, fcols, w);
      vp[i] = vi;
      o_sq[i] = ss;
    }
    vi = __shfl_sync(0xffffffffu, vi, 0);
    const float denom = math::NeuronDenominator(vi);
    double dd = 0.0;
    for (int64_t c = lane; c < cols; c += kWarp) {
      const float q = row[c] / denom;
      row[c] = q;
      dd += static_cast<double>(q) * q;
    }
    dd = FoldWarp(dd);
    if (lane == 0) d_sq[i] = dd;
  }
}

}  // namespace

int OpAdamWStepTracked(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad,
                       DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq) {
  return AdamWTracked(call, AdamWByValue{AdamWOf(c)}, grad, x, m, v, update_sq);
}
int OpAdamWStepTrackedDev(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad,
                          DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq) {
  return AdamWTracked(call, AdamWOnDevice{c}, grad, x, m, v, update_sq);
}
int OpLionStepTracked(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
                      DiondOut m, DiondOut update_sq) {
  return LionTracked(call, LionByValue{LionOf(c)}, grad, x, m, update_sq);
}
int OpLionStepTrackedDev(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad,
                         DiondOut x, DiondOut m, DiondOut update_sq) {
  return LionTracked(call, LionOnDevice{c}, grad, x, m, update_sq);
}

int OpMomentumUpdate(const DiondOpsCall* call, float mu, int32_t nesterov, DiondIn grad,
                     DiondIn m_in, DiondOut m, DiondOut u) {
  constexpr const char* kOp = "MomentumUpdate";
  DIOND_RC(UseDevice(call, kOp));
  const float* gp = static_cast<const float*>(grad->data);
  const float* ip = static_cast<const float*>(m_in->data);  // may be m itself
  float* mp = static_cast<float*>(m->data);
  float* up = static_cast<float*>(u->data);
  const bool nest = nesterov != 0;
  return Launch(call, kOp, NumElements(*m), [=] __device__(int64_t i) {
    float mi = ip[i];
    up[i] = math::MomentumElement(mu, nest, gp[i], mi);
    mp[i] = mi;
  });
}

namespace {
template <typename Scalars>
int ApplyUpdateWith(const DiondOpsCall* call, Scalars scalars, DiondIn update, DiondIn x_in,
                    DiondOut x) {
  constexpr const char* kOp = "ApplyUpdate";
  DIOND_RC(UseDevice(call, kOp));
  const float* up = static_cast<const float*>(update->data);
  const float* ip = static_cast<const float*>(x_in->data);  // may be x itself
  float* xp = static_cast<float*>(x->data);
  return Launch(call, kOp, NumElements(*x), [=] __device__(int64_t i) {
    xp[i] = math::ApplyUpdateElement(scalars(), ip[i], up[i]);
  });
}
}  // namespace

int OpApplyUpdate(const DiondOpsCall* call, const DiondApplyUpdateScalars* c, DiondIn update,
                  DiondIn x_in, DiondOut x) {
  return ApplyUpdateWith(call, ApplyUpdateByValue{ApplyUpdateOf(c)}, update, x_in, x);
}
int OpApplyUpdateDev(const DiondOpsCall* call, const DiondApplyUpdateScalars* c, DiondIn update,
                     DiondIn x_in, DiondOut x) {
  return ApplyUpdateWith(call, ApplyUpdateOnDevice{c}, update, x_in, x);
}

int OpNormalizeNeurons(const DiondOpsCall* call, float w, DiondOut o, DiondOut v) {
  constexpr const char* kOp = "NormalizeNeurons";
  DIOND_RC(UseDevice(call, kOp));
  const int r = o->rank;
  const int64_t batch = r == 3 ? o->dims[0] : 1;
  const int64_t rows = o->dims[r - 2], cols = o->dims[r - 1];
  const int64_t units_rows = batch * rows;
  if (units_rows == 0 || cols == 0) {
    // No element: V still moves towards ν = 0/cols as on the CPU (NaN for cols == 0, 0 rows).
    float* vp = static_cast<float*>(v->data);
    const float fcols = static_cast<float>(cols);
    return Launch(call, kOp, units_rows, [=] __device__(int64_t i) {
      vp[i] = math::NeuronVarianceElement(vp[i], 0.0, fcols, w);
    });
  }
  float* op = static_cast<float*>(o->data);
  float* vp = static_cast<float*>(v->data);
  Scratch sums;  // per row: Σ O², then Σ D²; per unit: the rescale factor
  DIOND_RC(sums.Allocate(call, kOp,
                         static_cast<size_t>(2 * units_rows) * sizeof(double) +
                             static_cast<size_t>(batch) * sizeof(float)));
  double* o_sq = sums.As<double>();
  double* d_sq = o_sq + units_rows;
  float* scale = reinterpret_cast<float*>(d_sq + units_rows);
  const float fcols = static_cast<float>(cols);
  // A warp per row: ν, V, D = O / (√V + 1e-8) and Σ D², each row sum in the CPU's row-sum order.
  NormalizeRowsKernel<<<RowGrid(units_rows), kThreads, 0, StreamOf(call)>>>(
      op, vp, units_rows, cols, fcols, w, o_sq, d_sq);
  DIOND_RC(CheckLaunch(call, kOp));
  // One thread per unit: the rescale factor from the row sums, added in row order.
  DIOND_RC(Launch(call, kOp, batch, [=] __device__(int64_t b) {
    double f2 = 0.0, d2 = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
      f2 += o_sq[b * rows + i];
      d2 += d_sq[b * rows + i];
    }
    scale[b] = math::NeuronRescale(f2, d2);
  }));
  const int64_t per_unit = rows * cols;
  return Launch(call, kOp, batch * per_unit,
                [=] __device__(int64_t e) { op[e] *= scale[e / per_unit]; });
}

int OpCopyWithChange(const DiondOpsCall* call, DiondIn src, DiondOut dst, DiondOut update_sq) {
  constexpr const char* kOp = "CopyWithChange";
  DIOND_RC(UseDevice(call, kOp));
  const float* sp = static_cast<const float*>(src->data);
  float* dp = static_cast<float*>(dst->data);
  return LaunchSum(
      call, kOp, NumElements(*dst),
      [=] __device__(int64_t i) {
        const double t = Sq(sp[i], dp[i]);
        dp[i] = sp[i];
        return t;
      },
      static_cast<float*>(update_sq->data));
}

// One thread per element of x: its row (kRows) or column (kCols) has a slot in src or -1, from
// a map built on the host from the indices and uploaded once per call (batch·rows or
// batch·cols int32; pageable memory, so the copy has left `map` when cudaMemcpyAsync returns).
int OpDecayScatterWithChange(const DiondOpsCall* call, float decay, DiondIn src, int32_t axis,
                             const int64_t* indices, int64_t count, float alpha, DiondOut x,
                             DiondOut update_sq) {
  constexpr const char* kOp = "DecayScatterWithChange";
  DIOND_RC(UseDevice(call, kOp));
  const int64_t batch = x->rank == 3 ? x->dims[0] : 1;
  const int64_t rows = x->dims[x->rank - 2], cols = x->dims[x->rank - 1];
  const int64_t k = batch > 0 ? count / batch : 0;
  const bool by_rows = axis == 0;
  const int64_t len = by_rows ? rows : cols;
  std::vector<int32_t> map(static_cast<size_t>(batch * len), -1);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < k; ++j) {
      map[static_cast<size_t>(b * len + indices[b * k + j])] = static_cast<int32_t>(j);
    }
  }
  Scratch slots;
  DIOND_RC(slots.Allocate(call, kOp, map.size() * sizeof(int32_t)));
  if (!map.empty()) {
    DIOND_CU(kOp, cudaMemcpyAsync(slots.As<int32_t>(), map.data(), map.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, StreamOf(call)));
  }
  const int32_t* sl = slots.As<int32_t>();
  const float* sp = static_cast<const float*>(src->data);
  float* xp = static_cast<float*>(x->data);
  const int64_t per = rows * cols, sub = by_rows ? k * cols : rows * k;
  return LaunchSum(
      call, kOp, batch * per,
      [=] __device__(int64_t e) {
        const int64_t b = e / per, r = (e % per) / cols, c = e % cols;
        const int32_t j = sl[b * len + (by_rows ? r : c)];
        const float before = xp[e];
        const float after =
            j < 0 ? math::DecayElement(decay, before)
                  : math::DecayScatterElement(
                        decay, alpha, before,
                        sp[b * sub + (by_rows ? static_cast<int64_t>(j) * cols + c : r * k + j)]);
        xp[e] = after;
        return Sq(after, before);
      },
      static_cast<float*>(update_sq->data));
}

}  // namespace diond::cuda
