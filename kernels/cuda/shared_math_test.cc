// The per-element functions the CUDA kernels call (kernels/elementwise_math.h, the "cuda" block)
// against the CPU backend: bf16 conversion bits, Unary and Binary on adversarial values.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<float> Values() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {
      0.0f,    -0.0f,    1.0f,    -1.0f,  inf,   -inf, std::numeric_limits<float>::quiet_NaN(),
      FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f, -2.5f, 3.0f, 0.1f};
  std::mt19937 rng(3);
  for (int i = 0; i < 4000; ++i) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
  return v;
}

TEST(SharedMath, Bf16ConversionIsTensorHs) {
  for (float f : Values()) {
    ASSERT_EQ(math::Bf16BitsFromFloat(f), FloatToBf16(f).bits) << f;
    const uint16_t h = static_cast<uint16_t>(Bits(f) >> 16);
    ASSERT_EQ(Bits(math::FloatFromBf16Bits(h)), Bits(Bf16ToFloat(BFloat16{h})));
  }
}

TEST(SharedMath, UnaryElementIsCpuUnary) {
  auto ctx = Context::CpuDefault(1);
  const std::vector<float> x = Values();
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> out(x.size());
  for (int op = math::kUnarySign; op <= math::kUnaryNanToNum; ++op) {
    ASSERT_THAT(
        Unary(*ctx, static_cast<UnaryOp>(op), MakeView(x.data(), {n}), MakeView(out.data(), {n})),
        IsOk());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(Bits(math::UnaryElement(op, x[i])), Bits(out[i])) << "op " << op << " x " << x[i];
    }
  }
}

TEST(SharedMath, BinaryElementIsCpuBinary) {
  auto ctx = Context::CpuDefault(1);
  const std::vector<float> x = Values();
  std::vector<float> y = x;
  std::mt19937 rng(5);
  std::shuffle(y.begin(), y.end(), rng);
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> out(x.size());
  for (int op = math::kBinaryAdd; op <= math::kBinaryMin; ++op) {
    ASSERT_THAT(Binary(*ctx, static_cast<BinaryOp>(op), MakeView(x.data(), {n}),
                       MakeView(y.data(), {n}), MakeView(out.data(), {n})),
                IsOk());
    for (size_t i = 0; i < x.size(); ++i) {
      const float got = math::BinaryElement(op, x[i], y[i]);
      if (std::isnan(out[i])) {
        ASSERT_TRUE(std::isnan(got)) << "op " << op;  // NaN payloads of a ± b are the FPU's
      } else {
        ASSERT_EQ(Bits(got), Bits(out[i])) << "op " << op << " " << x[i] << ", " << y[i];
      }
    }
  }
}

}  // namespace
}  // namespace diond::kernels
