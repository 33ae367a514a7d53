// The top-k order of the CUDA backend's TopKByL1Norm (elementwise_math.h TopKOrderKey /
// TopKBefore) against the CPU backend's TopKByL1Norm: the GPU sorts (key, index) pairs of the
// L1 scores with a stable descending radix sort, which is std::stable_sort by key here; both
// must give the CPU's indices bit for bit, ties, ±0, +Inf, subnormals and NaN included. The
// scores are the columns' L1 norms of a 1×n matrix (|a_j|, exact) or of a 2×n one (sums).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;

std::vector<float> Adversarial(uint32_t seed, int64_t n) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> specials = {0.0f,    -0.0f,    nan,     -nan,     inf,    -inf,
                                       1.0f,    -1.0f,    FLT_MIN, -FLT_MIN, 1e-45f, -1e-45f,
                                       FLT_MAX, -FLT_MAX, 0.5f,    3.0f};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, specials.size() - 1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    // Half specials (many exact ties), half rounded normals (more ties), a few plain normals.
    const uint32_t r = rng() % 8;
    x = r < 4 ? specials[pick(rng)] : (r < 7 ? std::round(normal(rng)) : normal(rng));
  }
  return v;
}

TEST(TopKOrder, StableDescendingKeySortIsTheCpuOrder) {
  auto ctx = Context::CpuDefault(1);
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const int64_t n = 50 + seed * 37;
    const int64_t rows = seed % 2 == 0 ? 1 : 2;
    const std::vector<float> a = Adversarial(seed, rows * n);
    std::vector<float> s(static_cast<size_t>(n));  // the L1 scores, from the CPU op itself
    std::vector<int64_t> cpu(static_cast<size_t>(n));
    ASSERT_THAT(TopKByL1Norm(*ctx, MakeView(a.data(), {rows, n}), Axis::kCols, n,
                             absl::MakeSpan(cpu), MakeView(s.data(), {n})),
                IsOk());
    if (rows == 1) {
      for (int64_t j = 0; j < n; ++j) {  // |a_j| exactly, NaN stays NaN
        if (!std::isnan(a[j])) {
          ASSERT_EQ(s[j], std::fabs(a[j])) << j;
        }
      }
    }

    std::vector<int64_t> by_key(static_cast<size_t>(n));
    std::iota(by_key.begin(), by_key.end(), int64_t{0});
    std::stable_sort(by_key.begin(), by_key.end(), [&](int64_t i, int64_t j) {
      return math::TopKOrderKey(s[i]) > math::TopKOrderKey(s[j]);
    });
    EXPECT_EQ(by_key, cpu) << "seed " << seed;

    std::vector<int64_t> by_before(static_cast<size_t>(n));
    std::iota(by_before.begin(), by_before.end(), int64_t{0});
    std::sort(by_before.begin(), by_before.end(),
              [&](int64_t i, int64_t j) { return math::TopKBefore(s[i], i, s[j], j); });
    EXPECT_EQ(by_before, cpu) << "seed " << seed;

    // The first k of the full order are the top k for every k (what the GPU copies out).
    for (int64_t k : {int64_t{1}, n / 3, n - 1}) {
      std::vector<int64_t> top(static_cast<size_t>(k));
      ASSERT_THAT(
          TopKByL1Norm(*ctx, MakeView(a.data(), {rows, n}), Axis::kCols, k, absl::MakeSpan(top)),
          IsOk());
      EXPECT_TRUE(std::equal(top.begin(), top.end(), by_key.begin())) << "k " << k;
    }
  }
}

// The key is monotone in the score on random bit patterns: key order == float order for
// numbers, equal keys exactly for equal numbers (±0), NaN below everything.
TEST(TopKOrder, KeyIsMonotoneOnRandomBitPatterns) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t ua = rng(), ub = rng() >> (rng() % 32);
    float a, b;
    std::memcpy(&a, &ua, 4);
    std::memcpy(&b, &ub, 4);
    const uint32_t ka = math::TopKOrderKey(a), kb = math::TopKOrderKey(b);
    if (std::isnan(a) || std::isnan(b)) {
      ASSERT_EQ(ka == 0u, static_cast<bool>(std::isnan(a)));
      ASSERT_EQ(kb == 0u, static_cast<bool>(std::isnan(b)));
      continue;
    }
    ASSERT_EQ(ka > kb, a > b) << a << " vs " << b;
    ASSERT_EQ(ka == kb, a == b) << a << " vs " << b;
  }
  EXPECT_EQ(math::TopKOrderKey(0.0f), math::TopKOrderKey(-0.0f));
  EXPECT_GT(math::TopKOrderKey(-std::numeric_limits<float>::infinity()),
            math::TopKOrderKey(std::numeric_limits<float>::quiet_NaN()));
}

}  // namespace
}  // namespace diond::kernels
