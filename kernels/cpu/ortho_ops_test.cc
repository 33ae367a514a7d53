// Tests of the orthogonalizers' ops (ops.h ortho block): Bf16RoundedAxpby against the sequence
// of eager bf16 ops it replaces (Copy to bf16, Scale, Axpby: each rounding once), and
// AddToDiagonal against a plain loop.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using testing::RandomVector;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(RoundToBf16Precision, MatchesTheBf16ConversionBitForBit) {
  std::mt19937 rng(3);
  std::vector<uint32_t> patterns = {0u,          0x80000000u, 0x7f800000u, 0xff800000u,
                                    0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x00008000u,
                                    0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x00000001u};
  for (int i = 0; i < 200000; ++i) patterns.push_back(rng());
  for (uint32_t u : patterns) {
    const float f = FromBits(u);
    const float got = math::RoundToBf16Precision(f), want = Bf16ToFloat(FloatToBf16(f));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << u;
      ASSERT_EQ(Bits(got), Bits(want)) << std::hex << u;  // the same quiet NaN
    } else {
      ASSERT_EQ(Bits(got), Bits(want)) << std::hex << u;
    }
  }
}

// The bf16 op sequence: t = bf(alpha·x16); u = bf(y); u = bf(beta·u); out = bf(t + u).
std::vector<float> ViaBf16Ops(const Context& ctx, float alpha, const std::vector<float>& x,
                              float beta, const std::vector<float>& y, bool with_x) {
  const int64_t n = static_cast<int64_t>(y.size());
  std::vector<BFloat16> x16 = testing::ToBf16(x), t16(n), u16(n), out16(n);
  EXPECT_THAT(Copy(ctx, MakeView(y.data(), {n}), MakeView(u16.data(), {n})), IsOk());
  EXPECT_THAT(Scale(ctx, beta, MakeView(u16.data(), {n}), MakeView(u16.data(), {n})), IsOk());
  if (!with_x) return testing::ToF32(u16);
  EXPECT_THAT(Scale(ctx, alpha, MakeView(x16.data(), {n}), MakeView(t16.data(), {n})), IsOk());
  EXPECT_THAT(Axpby(ctx, 1.0f, MakeView(t16.data(), {n}), 1.0f, MakeView(u16.data(), {n}),
                    MakeView(out16.data(), {n})),
              IsOk());
  return testing::ToF32(out16);
}

TEST(Bf16RoundedAxpby, EqualsTheSequenceOfEagerBf16Ops) {
  auto ctx = Context::CpuDefault(2);
  const int64_t n = 100003;  // several OpenMP ranges and a ragged tail
  std::vector<float> x = testing::ToF32(testing::ToBf16(RandomVector(n, 11))),
                     y = RandomVector(n, 12);
  // Values on and next to bf16 rounding ties, zeros of both signs, non-finite values.
  y[0] = FromBits(0x3f808000u);
  y[1] = FromBits(0x3f818000u);
  y[2] = FromBits(0x3f808001u);
  y[3] = -0.0f;
  y[4] = std::numeric_limits<float>::infinity();
  y[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = -0.0f;
  y[6] = 0.0f;
  for (auto [alpha, beta] : {std::pair<float, float>{3.8916678f, 1.0f},
                             {-2.7724843f, 0.50606483f},
                             {0.0f, 1.0f},
                             {0.0f, -1.7097828f}}) {
    const bool with_x = alpha != 0.0f;
    const std::vector<float> want = ViaBf16Ops(*ctx, alpha, x, beta, y, with_x);
    std::vector<float> out(n);
    ASSERT_THAT(Bf16RoundedAxpby(*ctx, alpha, MakeView(x.data(), {n}), beta,
                                 MakeView(y.data(), {n}), MakeView(out.data(), {n})),
                IsOk());
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(want[i])) {
        ASSERT_TRUE(std::isnan(out[i])) << i;
      } else {
        ASSERT_EQ(Bits(out[i]), Bits(want[i])) << "i " << i << " alpha " << alpha;
      }
    }
    // In place (out aliases x, the Polar Express update Y = bf(bf(a·Y) + bf(B·Y))).
    if (with_x) {
      std::vector<float> xi = x;
      ASSERT_THAT(Bf16RoundedAxpby(*ctx, alpha, MakeView(xi.data(), {n}), beta,
                                   MakeView(y.data(), {n}), MakeView(xi.data(), {n})),
                  IsOk());
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(want[i])) {
          ASSERT_TRUE(std::isnan(xi[i])) << i;
        } else {
          ASSERT_EQ(Bits(xi[i]), Bits(want[i])) << i;
        }
      }
    }
  }
}

// On bf16 storage the op is the eager sequence Scale, Scale, Axpby of bf16 tensors, each rounding
// once; the expectation is written out element by element with the tensor.h conversions.
TEST(Bf16RoundedAxpby, OnBf16StorageEqualsTheEagerBf16Sequence) {
  auto ctx = Context::CpuDefault(2);
  const int64_t n = 100003;
  std::vector<BFloat16> x = testing::ToBf16(RandomVector(n, 21));
  std::vector<BFloat16> y = testing::ToBf16(RandomVector(n, 22));
  y[0] = FloatToBf16(std::numeric_limits<float>::infinity());
  y[1] = FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  x[2] = FloatToBf16(-0.0f);
  y[2] = FloatToBf16(0.0f);
  x[3] = FloatToBf16(1e38f);  // alpha·x overflows to inf
  for (auto [alpha, beta] :
       {std::pair<float, float>{8.156554f, 15.878770f}, {-2.7724843f, 1.0f}, {0.0f, 0.42323551f}}) {
    std::vector<BFloat16> out(n), alias = x;
    ASSERT_THAT(Bf16RoundedAxpby(*ctx, alpha, MakeView(x.data(), {n}), beta,
                                 MakeView(y.data(), {n}), MakeView(out.data(), {n})),
                IsOk());
    ASSERT_THAT(Bf16RoundedAxpby(*ctx, alpha, MakeView(alias.data(), {n}), beta,
                                 MakeView(y.data(), {n}), MakeView(alias.data(), {n})),
                IsOk());
    for (int64_t i = 0; i < n; ++i) {
      const float u = Bf16ToFloat(FloatToBf16(beta * Bf16ToFloat(y[i])));
      float want = u;
      if (alpha != 0.0f) {
        const float t = Bf16ToFloat(FloatToBf16(alpha * Bf16ToFloat(x[i])));
        want = Bf16ToFloat(FloatToBf16(t + u));
      }
      for (const auto* got : {&out[i], &alias[i]}) {
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(Bf16ToFloat(*got))) << i;
        } else {
          ASSERT_EQ(got->bits, FloatToBf16(want).bits) << "i " << i << " alpha " << alpha;
        }
      }
    }
  }
}

// The contiguous same-dtype Axpby and Scale (range kernels built per ISA) against the formula,
// element by element: one rounding of alpha·x + beta·y to the output dtype.
TEST(AxpbyFastPaths, MatchTheFormulaInF32AndBf16) {
  auto ctx = Context::CpuDefault(2);
  const int64_t n = 70001;
  const std::vector<float> x = RandomVector(n, 31), y = RandomVector(n, 32);
  const std::vector<BFloat16> x16 = testing::ToBf16(x), y16 = testing::ToBf16(y);
  for (auto [alpha, beta] : {std::pair<float, float>{0.95f, 1.0f}, {-1.5f, 0.0f}, {3.0f, -0.25f}}) {
    std::vector<float> o(n);
    std::vector<BFloat16> o16(n);
    ASSERT_THAT(Axpby(*ctx, alpha, MakeView(x.data(), {n}), beta, MakeView(y.data(), {n}),
                      MakeView(o.data(), {n})),
                IsOk());
    ASSERT_THAT(Axpby(*ctx, alpha, MakeView(x16.data(), {n}), beta, MakeView(y16.data(), {n}),
                      MakeView(o16.data(), {n})),
                IsOk());
    for (int64_t i = 0; i < n; ++i) {
      const float want = beta == 0.0f ? alpha * x[i] : alpha * x[i] + beta * y[i];
      ASSERT_EQ(Bits(o[i]), Bits(want)) << i;
      const float xb = Bf16ToFloat(x16[i]), yb = Bf16ToFloat(y16[i]);
      const float want16 = beta == 0.0f ? alpha * xb : alpha * xb + beta * yb;
      ASSERT_EQ(o16[i].bits, FloatToBf16(want16).bits) << i;
    }
  }
}

TEST(Bf16RoundedAxpby, RejectsBadArguments) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12), b(12), c(12);
  std::vector<BFloat16> a16(12);
  EXPECT_THAT(Bf16RoundedAxpby(*ctx, 1.0f, MakeView(a.data(), {3, 4}), 1.0f,
                               MakeView(b.data(), {4, 3}), MakeView(c.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("y is [4, 3]")));
  EXPECT_THAT(Bf16RoundedAxpby(*ctx, 1.0f, MakeView(a16.data(), {3, 4}), 1.0f,
                               MakeView(b.data(), {3, 4}), MakeView(c.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("x")));
  // bf16 out with an f32 y: all three must share one dtype.
  EXPECT_THAT(Bf16RoundedAxpby(*ctx, 0.0f, {}, 1.0f, MakeView(b.data(), {3, 4}),
                               MakeView(a16.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("y")));
  EXPECT_THAT(Bf16RoundedAxpby(*ctx, NAN, MakeView(a.data(), {3, 4}), 1.0f,
                               MakeView(b.data(), {3, 4}), MakeView(c.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("alpha")));
  // alpha == 0 does not need x.
  EXPECT_THAT(Bf16RoundedAxpby(*ctx, 0.0f, ConstTensorView(), 1.0f, MakeView(b.data(), {3, 4}),
                               MakeView(c.data(), {3, 4})),
              IsOk());
}

TEST(AddToDiagonal, AddsOnEveryMatrixOfAStridedBatch) {
  auto ctx = Context::CpuDefault();
  const int64_t batch = 3, n = 5, ld = 7;  // row stride 7 > cols 5
  std::vector<float> a = RandomVector(batch * n * ld, 21), want = a;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) want[b * n * ld + i * ld + i] += 0.25f;
  }
  TensorLayout l;
  l.dtype = DType::kF32;
  l.rank = 3;
  l.dims[0] = batch;
  l.dims[1] = n;
  l.dims[2] = n;
  l.strides[0] = n * ld;
  l.strides[1] = ld;
  l.strides[2] = 1;
  ASSERT_THAT(AddToDiagonal(*ctx, 0.25f, TensorView(a.data(), l, ctx->device())), IsOk());
  EXPECT_EQ(a, want);  // off-diagonal entries and the gaps untouched
}

TEST(AddToDiagonal, RejectsBadArguments) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12);
  std::vector<BFloat16> a16(16);
  EXPECT_THAT(AddToDiagonal(*ctx, 1.0f, MakeView(a.data(), {3, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("square")));
  EXPECT_THAT(AddToDiagonal(*ctx, 1.0f, MakeView(a16.data(), {4, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AddToDiagonal(*ctx, INFINITY, MakeView(a.data(), {2, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("value")));
}

}  // namespace
}  // namespace diond::kernels
