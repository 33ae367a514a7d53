// Tests of Gemm and SymmetricProduct against a naive double-precision triple loop.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/engine_choice.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using testing::AbsGemm;
using testing::NaiveGemm;
using testing::RandomVector;

struct GemmCase {
  int64_t m, n, k;
  bool ta, tb;
  Fp32GemmEngine engine;
};

class Fp32GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Fp32GemmTest, MatchesNaiveLoop) {
  const GemmCase c = GetParam();
  auto ctx = Context::CpuDefault();
  const auto a = RandomVector(c.m * c.k, 1), b = RandomVector(c.k * c.n, 2);
  auto c0 = RandomVector(c.m * c.n, 3);
  std::vector<float> out = c0;
  GemmParams p;
  p.trans_a = c.ta ? Trans::kYes : Trans::kNo;
  p.trans_b = c.tb ? Trans::kYes : Trans::kNo;
  p.alpha = 0.75f;
  p.beta = -0.5f;
  p.engine = c.engine;
  ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data(), {c.ta ? c.k : c.m, c.ta ? c.m : c.k}),
                   MakeView(b.data(), {c.tb ? c.n : c.k, c.tb ? c.k : c.n}),
                   MakeView(out.data(), {c.m, c.n})),
              IsOk());
  const auto ref = NaiveGemm(a, b, c.m, c.n, c.k, c.ta, c.tb);
  const auto abs = AbsGemm(a, b, c.m, c.n, c.k, c.ta, c.tb);
  for (int64_t i = 0; i < c.m * c.n; ++i) {
    const double want = 0.75 * ref[i] - 0.5 * c0[i];
    // f32 dot product of length k: |error| <= k·u·Σ|a||b| (u = 2^-24, Higham's γ_k), plus the
    // alpha/beta scaling and final add: 2 more roundings of magnitude <= u·(|αab| + |βc|).
    const double tol = (c.k + 2) * 0x1p-24 * (0.75 * abs[i] + 0.5 * std::fabs(c0[i])) + 1e-30;
    ASSERT_NEAR(out[i], want, tol) << "entry " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp32GemmTest,
    ::testing::Values(GemmCase{13, 7, 29, false, false, Fp32GemmEngine::kOpenBlas},
                      GemmCase{13, 7, 29, true, false, Fp32GemmEngine::kOpenBlas},
                      GemmCase{13, 7, 29, false, true, Fp32GemmEngine::kOpenBlas},
                      GemmCase{13, 7, 29, true, true, Fp32GemmEngine::kOpenBlas},
                      GemmCase{1, 65, 3, false, false, Fp32GemmEngine::kOpenBlas},
                      GemmCase{13, 7, 29, false, false, Fp32GemmEngine::kOneDnn},
                      GemmCase{13, 7, 29, true, true, Fp32GemmEngine::kOneDnn},
                      GemmCase{67, 33, 130, true, false, Fp32GemmEngine::kOneDnn},
                      GemmCase{1, 65, 3, false, true, Fp32GemmEngine::kOneDnn}));

// Where oneDNN has no bf16 matmul, a bf16 GEMM is refused with the reason and the way out, not
// an INTERNAL error; where it has one, the same call runs.
TEST(Bf16Gemm, IsRefusedWithTheReasonExactlyWhereOneDnnHasNoBf16) {
  auto ctx = Context::CpuDefault();
  const auto a16 = testing::ToBf16(RandomVector(6 * 4, 3)),
             b16 = testing::ToBf16(RandomVector(4 * 5, 4));
  std::vector<float> c(6 * 5);
  const absl::Status st = Gemm(*ctx, {}, MakeView(a16.data(), {6, 4}), MakeView(b16.data(), {4, 5}),
                               MakeView(c.data(), {6, 5}));
  if (CpuHasOneDnnBf16Matmul()) {
    EXPECT_THAT(st, IsOk());
  } else {
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition,
                             ::testing::HasSubstr("no AVX-512 core")));
  }
}

TEST(Bf16Gemm, RoundsTheF32AccumulationOnce) {
  if (!CpuHasOneDnnBf16Matmul())
    GTEST_SKIP() << "oneDNN 2.6 has no bf16 matmul on this CPU (no AVX-512 core)";
  auto ctx = Context::CpuDefault();
  const int64_t m = 37, n = 45, k = 70;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const auto af = RandomVector(m * k, 11), bf = RandomVector(k * n, 12);
      const auto a16 = testing::ToBf16(af), b16 = testing::ToBf16(bf);
      const auto aw = testing::ToF32(a16), bw = testing::ToF32(b16);  // exact widening
      std::vector<BFloat16> c16(m * n);
      std::vector<float> c32(m * n);
      GemmParams p;
      p.trans_a = ta ? Trans::kYes : Trans::kNo;
      p.trans_b = tb ? Trans::kYes : Trans::kNo;
      ConstTensorView av = MakeView(a16.data(), {ta ? k : m, ta ? m : k});
      ConstTensorView bv = MakeView(b16.data(), {tb ? n : k, tb ? k : n});
      ASSERT_THAT(Gemm(*ctx, p, av, bv, MakeView(c16.data(), {m, n})), IsOk());
      ASSERT_THAT(Gemm(*ctx, p, av, bv, MakeView(c32.data(), {m, n})), IsOk());
      const auto ref = NaiveGemm(aw, bw, m, n, k, ta, tb);
      const auto abs = AbsGemm(aw, bw, m, n, k, ta, tb);
      int64_t exact_matches = 0;
      for (int64_t i = 0; i < m * n; ++i) {
        // f32 output: only the f32 accumulation error, |e| <= k·2^-24·Σ|a||b| (products of
        // bf16 values are exact in f32).
        const double acc_tol = k * 0x1p-24 * abs[i];
        ASSERT_NEAR(c32[i], ref[i], acc_tol) << "f32 entry " << i;
        // bf16 output = bf(f32 accumulation). It equals bf(exact) unless the exact value lies
        // within acc_tol of a rounding boundary; then it is the neighbouring bf16 value. So it is
        // within half a bf16 ulp (2^-9 relative) plus acc_tol of the exact value.
        const float got = Bf16ToFloat(c16[i]);
        const float want = RoundToBf16(static_cast<float>(ref[i]));
        ASSERT_NEAR(got, ref[i], std::ldexp(std::fabs(ref[i]), -8) + acc_tol) << "bf16 entry " << i;
        exact_matches += got == want;
        // And bf(c32) is the same rounding of (nearly) the same f32 value.
        EXPECT_LE(std::fabs(got - RoundToBf16(c32[i])), std::ldexp(std::fabs(ref[i]), -7));
      }
      // Boundary cases are rare: the f32 error (~1e-7 relative) is ~4·10⁻⁵ of a bf16 ulp.
      EXPECT_GE(exact_matches, m * n - 2) << "ta " << ta << " tb " << tb;
    }
  }
}

TEST(Gemm, BatchedEqualsOneByOneAndBroadcasts) {
  auto ctx = Context::CpuDefault();
  const int64_t batch = 3, m = 9, n = 11, k = 5;
  const auto a = RandomVector(batch * m * k, 21), b = RandomVector(k * n, 22);
  std::vector<float> c(batch * m * n), single(m * n);
  GemmParams p;
  // b is rank 2: broadcast against the batch.
  ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data(), {batch, m, k}), MakeView(b.data(), {k, n}),
                   MakeView(c.data(), {batch, m, n})),
              IsOk());
  for (int64_t i = 0; i < batch; ++i) {
    ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data() + i * m * k, {m, k}), MakeView(b.data(), {k, n}),
                     MakeView(single.data(), {m, n})),
                IsOk());
    for (int64_t j = 0; j < m * n; ++j) ASSERT_EQ(c[i * m * n + j], single[j]);
  }
}

TEST(Gemm, ZeroInnerDimensionScalesC) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a, b, c = {1, 2, 3, 4};
  GemmParams p;
  p.beta = 2.0f;
  ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data(), {2, 0}), MakeView(b.data(), {0, 2}),
                   MakeView(c.data(), {2, 2})),
              IsOk());
  EXPECT_EQ(c, (std::vector<float>{2, 4, 6, 8}));
}

TEST(Gemm, RejectsBadArguments) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12), b(12), c(16, 7.0f);
  GemmParams p;
  auto code = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(Gemm(*ctx, p, MakeView(a.data(), {3, 4}), MakeView(b.data(), {3, 4}),
                   MakeView(c.data(), {3, 4})),
              StatusIs(code, ::testing::HasSubstr("inner dims")));
  EXPECT_THAT(Gemm(*ctx, p, MakeView(a.data(), {3, 4}), MakeView(b.data(), {4, 3}),
                   MakeView(c.data(), {4, 4})),
              StatusIs(code, ::testing::HasSubstr("c is [4, 4] f32")));
  std::vector<BFloat16> a16(12);
  EXPECT_THAT(Gemm(*ctx, p, MakeView(a16.data(), {3, 4}), MakeView(b.data(), {4, 3}),
                   MakeView(c.data(), {3, 3})),
              StatusIs(code, ::testing::HasSubstr("unsupported dtypes")));
  EXPECT_THAT(Gemm(*ctx, p, ConstTensorView(nullptr, ContiguousLayout(DType::kF32, {3, 4})),
                   MakeView(b.data(), {4, 3}), MakeView(c.data(), {3, 3})),
              StatusIs(code, ::testing::HasSubstr("null")));
  EXPECT_THAT(Gemm(*ctx, p, MakeView(a.data(), {3, 4}).Transposed(), MakeView(b.data(), {3, 4}),
                   MakeView(c.data(), {4, 4})),
              StatusIs(code, ::testing::HasSubstr("column stride")));
  p.alpha = NAN;
  EXPECT_THAT(Gemm(*ctx, p, MakeView(a.data(), {3, 4}), MakeView(b.data(), {4, 3}),
                   MakeView(c.data(), {3, 3})),
              StatusIs(code, ::testing::HasSubstr("alpha")));
  for (float v : c) EXPECT_EQ(v, 7.0f);  // nothing written on error
}

// Every engine: ssyrk (kOpenBlas), the lower block triangle of oneDNN GEMMs (kOneDnn; 300 rows
// are 3 panels of 128, 128, 44) and kAuto, on small and multi-panel shapes, batched.
TEST(SymmetricProduct, MatchesGemmAndIsExactlySymmetric) {
  for (Fp32GemmEngine engine :
       {Fp32GemmEngine::kOpenBlas, Fp32GemmEngine::kOneDnn, Fp32GemmEngine::kAuto}) {
    ContextOptions options;
    options.fp32_gemm = engine;
    auto ctx_or = Context::Create(options);
    ASSERT_THAT(ctx_or.status(), IsOk());
    const Context& ctx = **ctx_or;
    for (auto [m, n] : {std::pair<int64_t, int64_t>{19, 33}, {300, 140}}) {
      const int64_t batch = 2;
      const auto a = RandomVector(batch * m * n, 31);
      for (GramSide side : {GramSide::kAAt, GramSide::kAtA}) {
        SCOPED_TRACE(::testing::Message() << "engine " << static_cast<int>(engine) << " " << m
                                          << "x" << n << " side " << static_cast<int>(side));
        const int64_t g = side == GramSide::kAAt ? m : n;
        auto c0 = RandomVector(batch * g * g, 32);
        for (int64_t b = 0; b < batch; ++b) {
          float* cb = c0.data() + b * g * g;
          for (int64_t i = 0; i < g; ++i) {
            for (int64_t j = 0; j < i; ++j) cb[j * g + i] = cb[i * g + j];  // symmetric C
          }
        }
        std::vector<float> c = c0;
        ASSERT_THAT(SymmetricProduct(ctx, side, 2.0f, MakeView(a.data(), {batch, m, n}), 0.5f,
                                     MakeView(c.data(), {batch, g, g})),
                    IsOk());
        const bool aat = side == GramSide::kAAt;
        const int64_t k = aat ? n : m;
        for (int64_t b = 0; b < batch; ++b) {
          const std::vector<float> ab(a.begin() + b * m * n, a.begin() + (b + 1) * m * n);
          const auto ref = NaiveGemm(ab, ab, g, g, k, !aat, aat);
          const auto abs = AbsGemm(ab, ab, g, g, k, !aat, aat);
          const float* cb = c.data() + b * g * g;
          const float* c0b = c0.data() + b * g * g;
          for (int64_t i = 0; i < g; ++i) {
            for (int64_t j = 0; j < g; ++j) {
              ASSERT_EQ(cb[i * g + j], cb[j * g + i]);
              // As the f32 GEMM bound: (k + 2)·u·(|α|Σ|a||a| + |β||c|).
              const double want = 2.0 * ref[i * g + j] + 0.5 * c0b[i * g + j];
              const double tol =
                  (k + 2) * 0x1p-24 * (2.0 * abs[i * g + j] + 0.5 * std::fabs(c0b[i * g + j]));
              ASSERT_NEAR(cb[i * g + j], want, tol);
            }
          }
        }
      }
    }
  }
}

TEST(SymmetricProduct, RejectsBadArguments) {
  auto ctx = Context::CpuDefault();
  std::vector<float> a(12), c(16);
  EXPECT_THAT(SymmetricProduct(*ctx, GramSide::kAAt, 1.0f, MakeView(a.data(), {3, 4}), 0.0f,
                               MakeView(c.data(), {4, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("want [3, 3]")));
  std::vector<BFloat16> a16(12);
  EXPECT_THAT(SymmetricProduct(*ctx, GramSide::kAtA, 1.0f, MakeView(a16.data(), {3, 4}), 0.0f,
                               MakeView(c.data(), {4, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("dtype")));
}

}  // namespace
}  // namespace diond::kernels

namespace diond::kernels {
namespace {

// SymmetricProductBf16 computes only the lower block triangle, in column panels, and mirrors it.
// Its contract (ops.h) is stronger than closeness: every entry is bit for bit what the full bf16
// Gemm(A, A, trans_b) writes into a C of the same dtype, which is what lets the orthogonalizers
// use it without changing a value. Checked on f32 and bf16 C, padded and contiguous rows (oneDNN's
// AMX kernels give panels of a contiguous A with a long k other bits, where the op computes the
// full product instead), a batch, a block that does not divide n, and 1 and 2 threads; and
// against a double-precision product.
struct HalfGramCase {
  int64_t batch, n, k, block;
  bool contiguous = false;
};
class SymmetricProductBf16Test : public ::testing::TestWithParam<HalfGramCase> {};

TEST_P(SymmetricProductBf16Test, IsTheFullGemmBitForBitAndExactlySymmetric) {
  if (!CpuHasOneDnnBf16Matmul())
    GTEST_SKIP() << "oneDNN 2.6 has no bf16 matmul on this CPU (no AVX-512 core)";
  const HalfGramCase tc = GetParam();
  const int64_t batch = tc.batch, n = tc.n, k = tc.k, ld = k + (tc.contiguous ? 0 : 5);
  const auto af = testing::RandomVector(batch * n * ld, 7);
  std::vector<BFloat16> a(af.size());
  for (size_t i = 0; i < af.size(); ++i) a[i] = FloatToBf16(af[i]);
  TensorLayout al = ContiguousLayout(DType::kBf16, {batch, n, k});
  al.strides[1] = ld;
  al.strides[0] = n * ld;
  ConstTensorView av(a.data(), al);
  GemmParams p;
  p.trans_b = Trans::kYes;
  for (int threads : {1, 2}) {
    auto ctx = Context::CpuDefault(threads);
    std::vector<float> c(batch * n * n, -1.0f), full(batch * n * n);
    ASSERT_THAT(SymmetricProductBf16(*ctx, av, tc.block, MakeView(c.data(), {batch, n, n})),
                IsOk());
    ASSERT_THAT(Gemm(*ctx, p, av, av, MakeView(full.data(), {batch, n, n})), IsOk());
    std::vector<BFloat16> c16(batch * n * n, FloatToBf16(-1.0f)), full16(batch * n * n);
    ASSERT_THAT(SymmetricProductBf16(*ctx, av, tc.block, MakeView(c16.data(), {batch, n, n})),
                IsOk());
    ASSERT_THAT(Gemm(*ctx, p, av, av, MakeView(full16.data(), {batch, n, n})), IsOk());
    int64_t differ = 0, differ16 = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = (b * n + i) * n + j, mirror = (b * n + j) * n + i;
          differ += c[at] != full[at];
          differ16 += std::memcmp(&c16[at], &full16[at], 2) != 0;
          ASSERT_EQ(c[at], c[mirror]);
          ASSERT_EQ(std::memcmp(&c16[at], &c16[mirror], 2), 0);
          if ((i * 31 + j) % 97 == 0) {  // a sample against a double-precision product
            double ref = 0;
            for (int64_t t = 0; t < k; ++t) {
              ref += static_cast<double>(Bf16ToFloat(a[(b * n + i) * ld + t])) *
                     Bf16ToFloat(a[(b * n + j) * ld + t]);
            }
            EXPECT_NEAR(c[at], ref, 1e-4 * (1.0 + std::fabs(ref)) * std::sqrt(double(k)));
          }
        }
      }
    }
    EXPECT_EQ(differ, 0) << "f32 C, " << threads << " threads";
    EXPECT_EQ(differ16, 0) << "bf16 C, " << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SymmetricProductBf16Test,
    ::testing::Values(HalfGramCase{2, 70, 48, 32}, HalfGramCase{1, 300, 200, 64},
                      HalfGramCase{1, 768, 768, 160}, HalfGramCase{2, 192, 3072, 64},
                      HalfGramCase{1, 129, 17, 32}, HalfGramCase{1, 129, 64, 1},
                      HalfGramCase{1, 129, 64, 8}, HalfGramCase{1, 130, 64, 16},
                      HalfGramCase{1, 200, 2000, 64, true}, HalfGramCase{2, 192, 3072, 64, true},
                      HalfGramCase{1, 300, 200, 64, true}));

TEST(SymmetricProductBf16, RejectsBadArguments) {
  auto ctx = Context::CpuDefault();
  std::vector<BFloat16> a(8 * 4);
  std::vector<float> c(8 * 8), af(8 * 4);
  EXPECT_THAT(SymmetricProductBf16(*ctx, MakeView(a.data(), {8, 4}), 0, MakeView(c.data(), {8, 8})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("block")));
  EXPECT_THAT(
      SymmetricProductBf16(*ctx, MakeView(a.data(), {8, 4}), 4, MakeView(c.data(), {4, 16})),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("want [8, 8]")));
  EXPECT_THAT(
      SymmetricProductBf16(*ctx, MakeView(af.data(), {8, 4}), 4, MakeView(c.data(), {8, 8})),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("bf16")));
  std::vector<Float16> h(8 * 8);
  EXPECT_THAT(SymmetricProductBf16(*ctx, MakeView(a.data(), {8, 4}), 4, MakeView(h.data(), {8, 8})),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("f32 or bf16")));
}

}  // namespace
}  // namespace diond::kernels
