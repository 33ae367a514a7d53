// Test helpers for the CPU backend tests: deterministic random fills and naive references.
#ifndef DIOND_KERNELS_CPU_TEST_UTIL_H_
#define DIOND_KERNELS_CPU_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tensor.h"

namespace diond::kernels::testing {

inline std::vector<float> RandomVector(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

inline std::vector<BFloat16> ToBf16(const std::vector<float>& v) {
  std::vector<BFloat16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = FloatToBf16(v[i]);
  return o;
}

inline std::vector<float> ToF32(const std::vector<BFloat16>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = Bf16ToFloat(v[i]);
  return o;
}

// The row-sum order of elementwise_math.h (FoldRowSumLanes) written out as a CUDA warp runs it:
// thread t of 32 adds the terms t, t + 32, t + 64, ... in order; then, for h = 16, 8, 4, 2, 1,
// thread t < h adds thread t + h's partial to its own; thread 0 holds the sum.
inline double WarpOrderSum(const std::vector<double>& terms) {
  double part[32] = {};
  for (size_t j = 0; j < terms.size(); ++j) part[j % 32] += terms[j];
  for (int h = 16; h >= 1; h /= 2) {
    for (int t = 0; t < h; ++t) part[t] = part[t] + part[t + h];
  }
  return part[0];
}
inline double IndexOrderSum(const std::vector<double>& terms) {
  double s = 0.0;
  for (double t : terms) s += t;
  return s;
}

// A row of `cols` (>= 160) f32 values whose L1 norm (squares = false) or sum of squares (true),
// summed in double and rounded to f32, is 1 + 2^-23 in the row-sum (warp) order but 1 in index
// order: its terms are 1 (column 0), 2^-24 (column 1) and sixty-four terms of 2^-58 in the odd
// lanes from 3 on. Index order adds each 2^-58 to 1 + 2^-24 and loses it (below half an ulp),
// leaving the f32 midpoint 1 + 2^-24, which rounds to even (1); the warp order sums the small
// terms exactly within lane 1's half of the fold and adds 1 + ... + 2^-24 + 2^-52 last, just
// above the midpoint. The values are exact in bf16 too.
inline std::vector<float> OrderProbeRow(int64_t cols, bool squares) {
  std::vector<float> row(static_cast<size_t>(cols), 0.0f);
  row[0] = 1.0f;
  row[1] = squares ? 0x1p-12f : 0x1p-24f;
  int placed = 0;
  for (int64_t j = 3; j < cols && placed < 64; ++j) {
    if (j % 32 % 2 == 1 && j % 32 >= 3) {
      row[static_cast<size_t>(j)] = squares ? 0x1p-29f : 0x1p-58f;
      ++placed;
    }
  }
  return placed == 64 ? row : std::vector<float>();
}

// C = op(A)·op(B) in double, row-major, A stored m×k (or k×m if ta), B k×n (or n×k if tb).
inline std::vector<double> NaiveGemm(const std::vector<float>& a, const std::vector<float>& b,
                                     int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * m + i] : a[i * k + p];
        const double bv = tb ? b[j * k + p] : b[p * n + j];
        s += av * bv;
      }
      c[i * n + j] = s;
    }
  }
  return c;
}

// Σ_p |a_ip|·|b_pj| for error bounds of the GEMM entry (i, j).
inline std::vector<double> AbsGemm(const std::vector<float>& a, const std::vector<float>& b,
                                   int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  std::vector<float> aa(a), bb(b);
  for (float& x : aa) x = x < 0 ? -x : x;
  for (float& x : bb) x = x < 0 ? -x : x;
  return NaiveGemm(aa, bb, m, n, k, ta, tb);
}

}  // namespace diond::kernels::testing

#endif  // DIOND_KERNELS_CPU_TEST_UTIL_H_
