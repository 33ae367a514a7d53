// The session's ops ("steps" block of kernels/ops.h) against independent per-element
// expectations: std::isfinite, the widen/scale of kernels/tensor.h done element by element, and
// FNV-1a 64 written out byte by byte (with the published test vector of the empty input).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

std::unique_ptr<Context> Ctx() { return *Context::Create(ContextOptions{}); }

std::vector<float> Values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// Sizes below and above the parallel grain (the threads' split must not matter).
const std::vector<int64_t> kSizes = {1, 7, 1000, 100003};

TEST(SessionOps, AllFiniteFindsEveryNanAndInfInEveryDtype) {
  auto ctx = Ctx();
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (int64_t n : kSizes) {
    std::vector<float> f = Values(static_cast<size_t>(n), 1);
    f[0] = std::numeric_limits<float>::max();  // large but finite
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (float special : specials) {
        std::vector<float> g = f;
        g[static_cast<size_t>(at)] = special;
        std::vector<BFloat16> b(g.size());
        std::vector<Float16> h(g.size());
        for (size_t i = 0; i < g.size(); ++i) {
          b[i] = FloatToBf16(g[i]);
          h[i] = FloatToF16(std::isfinite(g[i]) ? std::fmod(g[i], 1000.0f) : g[i]);
        }
        bool ok = true;
        ASSERT_THAT(AllFinite(*ctx, MakeView(g.data(), {n}), &ok), IsOk());
        EXPECT_FALSE(ok) << n << " at " << at;
        ASSERT_THAT(AllFinite(*ctx, MakeView(b.data(), {n}), &ok), IsOk());
        EXPECT_FALSE(ok) << "bf16 " << n << " at " << at;
        ASSERT_THAT(AllFinite(*ctx, MakeView(h.data(), {n}), &ok), IsOk());
        EXPECT_FALSE(ok) << "f16 " << n << " at " << at;
      }
    }
    bool ok = false;
    ASSERT_THAT(AllFinite(*ctx, MakeView(f.data(), {n}), &ok), IsOk());
    EXPECT_TRUE(ok) << n;
  }
}

TEST(SessionOps, WidenScaleCheckFiniteIsTheElementwiseProductAndItsScan) {
  auto ctx = Ctx();
  for (int64_t n : kSizes) {
    std::vector<float> f = Values(static_cast<size_t>(n), 2);
    std::vector<BFloat16> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = FloatToBf16(f[i]);
    for (float scale : {1.0f, 0.125f, 3.3f, 1e38f}) {
      std::vector<float> out(f.size()), want(f.size());
      bool ok = false, want_ok = true;
      for (size_t i = 0; i < f.size(); ++i) {
        want[i] = scale == 1.0f ? Bf16ToFloat(b[i]) : Bf16ToFloat(b[i]) * scale;
        want_ok = want_ok && std::isfinite(want[i]);
      }
      ASSERT_THAT(WidenScaleCheckFinite(*ctx, MakeView(b.data(), {n}), scale,
                                        MakeView(out.data(), {n}), &ok),
                  IsOk());
      EXPECT_EQ(0, std::memcmp(out.data(), want.data(), out.size() * 4)) << n << " " << scale;
      EXPECT_EQ(ok, want_ok) << n << " " << scale;
      // f32 in place (out aliases x).
      std::vector<float> g = f, gw(f.size());
      for (size_t i = 0; i < f.size(); ++i) gw[i] = scale == 1.0f ? f[i] : f[i] * scale;
      ASSERT_THAT(
          WidenScaleCheckFinite(*ctx, MakeView(g.data(), {n}), scale, MakeView(g.data(), {n}), &ok),
          IsOk());
      EXPECT_EQ(0, std::memcmp(g.data(), gw.data(), g.size() * 4)) << n << " " << scale;
    }
  }
  std::vector<BFloat16> b(4);
  std::vector<float> out(3);
  bool ok;
  EXPECT_THAT(
      WidenScaleCheckFinite(*ctx, MakeView(b.data(), {4}), 1.0f, MakeView(out.data(), {3}), &ok),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      WidenScaleCheckFinite(*ctx, MakeView(b.data(), {3}), std::numeric_limits<float>::infinity(),
                            MakeView(out.data(), {3}), &ok),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SessionOps, Fnv1aChecksumIsFnv1a64OfTheBytes) {
  auto ctx = Ctx();
  uint64_t h = 0;
  ASSERT_THAT(Fnv1aChecksum(*ctx, MakeView(static_cast<const float*>(nullptr), {0}), &h), IsOk());
  EXPECT_EQ(h, 0xcbf29ce484222325ull);  // the offset basis: FNV-1a 64 of no bytes
  for (int64_t n : kSizes) {
    std::vector<float> f = Values(static_cast<size_t>(n), 3);
    uint64_t want = 0xcbf29ce484222325ull;
    const auto* p = reinterpret_cast<const unsigned char*>(f.data());
    for (size_t i = 0; i < f.size() * 4; ++i) {
      want ^= p[i];
      want *= 0x100000001b3ull;
    }
    ASSERT_THAT(Fnv1aChecksum(*ctx, MakeView(f.data(), {n}), &h), IsOk());
    EXPECT_EQ(h, want) << n;
    f[static_cast<size_t>(n / 2)] = std::nextafter(f[static_cast<size_t>(n / 2)], 1e9f);
    uint64_t changed = 0;
    ASSERT_THAT(Fnv1aChecksum(*ctx, MakeView(f.data(), {n}), &changed), IsOk());
    EXPECT_NE(changed, h) << n;
  }
}

}  // namespace
}  // namespace diond::kernels
