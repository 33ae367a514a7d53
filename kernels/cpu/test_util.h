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
