// Internal helpers of the CPU backend: dtype dispatch and the OpenMP range loop.
#ifndef DIOND_KERNELS_CPU_LOOPS_H_
#define DIOND_KERNELS_CPU_LOOPS_H_

#include <omp.h>

#include <cstdint>

#include "kernels/cpu/threading.h"
#include "kernels/tensor.h"

namespace diond::kernels::cpu {

inline float ToF32(float v) { return v; }
inline float ToF32(BFloat16 v) { return Bf16ToFloat(v); }
inline float ToF32(Float16 v) { return F16ToFloat(v); }

template <typename T>
inline T FromF32(float f);
template <>
inline float FromF32<float>(float f) {
  return f;
}
template <>
inline BFloat16 FromF32<BFloat16>(float f) {
  return FloatToBf16(f);
}
template <>
inline Float16 FromF32<Float16>(float f) {
  return FloatToF16(f);
}

// Calls f(T{}) with T the storage type of `t`.
template <typename F>
decltype(auto) DispatchDType(DType t, F&& f) {
  switch (t) {
    case DType::kBf16:
      return f(BFloat16{});
    case DType::kF16:
      return f(Float16{});
    case DType::kF32:
    default:
      return f(float{});
  }
}

// DIOND_CPU_CLONES on a range kernel (a free function over raw pointers): GCC builds it three
// times, for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline, and the loader picks
// the one the CPU runs (an ifunc, resolved once). The baseline build of the project targets plain
// x86-64 (SSE2), where std::fmaf is a libm call that keeps a loop scalar. The files that use it
// are compiled with -ffp-contract=off (no a·b + c contracted into an FMA the source does not
// write) and -fno-math-errno (sqrtf without the errno branch), so every clone computes the same
// bits: IEEE +, −, ×, ÷, √ and fma are correctly rounded whatever the vector width.
// Lambdas are not cloned: the clones are the functions that hold the loops. Not under
// ThreadSanitizer: GCC instruments the ifunc resolver, which then runs before the TSan runtime
// is up and crashes the process at load (measured with GCC 12); ASan/UBSan builds are fine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(__SANITIZE_THREAD__) && !defined(DIOND_NO_TARGET_CLONES)
#define DIOND_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DIOND_CPU_CLONES
#endif

// Partial sums of a double accumulation kept in kSumLanes interleaved lanes (element i of the
// range goes to lane i % kSumLanes, tail included), then added in lane order: the lanes are
// independent chains, so the loop vectorizes without reassociation, and the result is the same
// for every clone (it depends on the range only, as the split of ParallelSum already makes it).
inline constexpr int kSumLanes = 8;
inline double SumLanes(const double* lanes) {
  double s = 0.0;
  for (int l = 0; l < kSumLanes; ++l) s += lanes[l];
  return s;
}

// Σ_j |row[j]| (l1) or Σ_j row[j]² over one f32 row of `cols` contiguous elements, in double, in
// the row-sum order of math::FoldRowSumLanes (elementwise_math.h): the order of the CUDA
// backend's warp per row. Every row sum of the CPU backend (reduce.cc, NormalizeNeurons) uses it.
double RowSumF32(bool l1, const float* row, int64_t cols);

// Runs body(begin, end) over [0, n) split into one static range per OpenMP thread, or on the
// calling thread when n < grain. Results never depend on the split (elementwise work only).
template <typename F>
void ParallelRange(int64_t n, F&& body, int64_t grain = kParallelGrain) {
  if (n <= 0) return;
  if (n < grain || omp_get_max_threads() == 1) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b = n * t / nt, e = n * (t + 1) / nt;
    if (b < e) body(b, e);
  }
}

// Σ body(begin, end) over [0, n), split as ParallelRange; the per-thread partial sums are added
// in thread order, so the result is fixed for a fixed thread count.
template <typename F>
double ParallelSum(int64_t n, F&& body, int64_t grain = kParallelGrain) {
  if (n <= 0) return 0.0;
  if (n < grain || omp_get_max_threads() == 1) return body(int64_t{0}, n);
  constexpr int kMaxParts = 1024;  // Context::CpuDefault caps the thread count at 1024
  double partial[kMaxParts];
  int parts = 0;
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    parts = static_cast<int>(nt < kMaxParts ? nt : kMaxParts);
    if (t < kMaxParts) {
      const int64_t b = n * t / parts, e = n * (t + 1) / parts;
      partial[t] = b < e ? body(b, e) : 0.0;
    }
  }
  double sum = 0.0;
  for (int t = 0; t < parts; ++t) sum += partial[t];
  return sum;
}

}  // namespace diond::kernels::cpu

#endif  // DIOND_KERNELS_CPU_LOOPS_H_
