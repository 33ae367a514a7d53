// Tests of kernels/tensor.h (conversions, layouts, arena, Tensor) and kernels/context.h.
#include "kernels/tensor.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/context.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 (mantissa ...0) and 1 + 2^-7 (...1): ties to even.
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  // Just above the tie rounds up; just below rounds down.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)).bits, 0x3f81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fffu)).bits, 0x3f80);
  EXPECT_EQ(FloatToBf16(-1.0f - 0x1p-8f).bits, 0xbf80);
  EXPECT_EQ(Bf16ToFloat(BFloat16{0x3f81}), 1.0f + 0x1p-7f);
}

TEST(Bf16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBf16(inf).bits, 0x7f80);
  EXPECT_EQ(FloatToBf16(-inf).bits, 0xff80);
  EXPECT_EQ(FloatToBf16(0.0f).bits, 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f).bits, 0x8000);
  // NaN stays NaN even when its payload sits only in the low 16 bits (plain truncation would
  // give Inf); the sign is kept.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(FloatToBf16(FromBits(0xffc00000u)).bits & 0x8000, 0x8000);
  // The largest finite f32 rounds past the largest bf16 (0x7f7f) to Inf under RNE.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()).bits, 0x7f80);
  // Subnormals round like any other value.
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)).bits, 0x0002);  // tie, 1 is odd: up to 2
}

TEST(Bf16, EveryBf16ValueRoundTrips) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = Bf16ToFloat(BFloat16{static_cast<uint16_t>(b)});
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f).bits, b);
  }
}

TEST(F16, EveryF16ValueRoundTripsAndTiesGoToEven) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = F16ToFloat(Float16{static_cast<uint16_t>(b)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
      continue;
    }
    ASSERT_EQ(FloatToF16(f).bits, b) << "f16 pattern " << b;
  }
  EXPECT_EQ(FloatToF16(1.0f + 0x1p-11f).bits, 0x3c00);      // tie -> even
  EXPECT_EQ(FloatToF16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToF16(65520.0f).bits, 0x7c00);             // rounds to Inf
  EXPECT_EQ(FloatToF16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(FloatToF16(0x1p-25f).bits, 0x0000);  // tie with 0 -> 0
  EXPECT_EQ(FloatToF16(0x1.8p-25f).bits, 0x0001);
}

TEST(TensorLayout, ContiguityAndMatrixViews) {
  TensorLayout l = ContiguousLayout(DType::kF32, {2, 3, 5});
  EXPECT_TRUE(l.IsContiguous());
  EXPECT_EQ(l.Batch(), 2);
  EXPECT_EQ(l.Rows(), 3);
  EXPECT_EQ(l.Cols(), 5);
  EXPECT_EQ(l.DebugString(), "[2, 3, 5] f32");
  std::vector<float> buf(30);
  TensorView v(buf.data(), l);
  TensorView m1 = v.Matrix(1);
  EXPECT_EQ(m1.As<float>(), buf.data() + 15);
  EXPECT_FALSE(v.Transposed().IsContiguous());
  EXPECT_FALSE(v.ColRange(1, 2).IsContiguous());
  EXPECT_TRUE(v.Matrix(0).RowRange(1, 2).IsContiguous());
}

TEST(ScratchArena, ReusesMemoryAfterRewind) {
  ScratchArena arena(1 << 16);
  void* first = nullptr;
  {
    ScratchArena::Scope scope(arena);
    auto p = arena.Allocate(1000);
    ASSERT_THAT(p.status(), IsOk());
    first = *p;
    auto q = arena.Allocate(100000);  // bigger than a block: gets its own block
    ASSERT_THAT(q.status(), IsOk());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*q) % 64, 0u);
  }
  auto again = arena.Allocate(10);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(*again, first);
  EXPECT_THAT(arena.Allocate(8, 3).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Tensor, AllocateAndValidate) {
  auto t = Tensor::Zeros(DType::kBf16, {3, 4});
  ASSERT_THAT(t.status(), IsOk());
  EXPECT_EQ(t->bytes(), 24u);
  EXPECT_EQ(t->As<BFloat16>()[11].bits, 0);
  EXPECT_THAT(Tensor::Allocate(DType::kF32, {2, -1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Tensor::Allocate(DType::kF32, std::vector<int64_t>{1, 2, 3, 4}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Context, ValidatesOptions) {
  ContextOptions o;
  o.device.type = DeviceType::kCuda;
  EXPECT_THAT(Context::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = ContextOptions();
  int dummy = 0;
  o.stream = &dummy;
  EXPECT_THAT(Context::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = ContextOptions();
  o.num_threads = 3;
  auto ctx = Context::Create(o);
  ASSERT_THAT(ctx.status(), IsOk());
  EXPECT_EQ((*ctx)->num_threads(), 3);
  EXPECT_GE(Context::CpuDefault()->num_threads(), 1);
}

}  // namespace
}  // namespace diond::kernels
