#include "kernels/engine_calibration.h"

#include <map>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using C = CalibrationCase;

// A timer that returns the time the test dictates without running the work (the choice rule
// is the property under test; RealTimerAndStore runs the work).
CalibrationTimer FakeTimer(std::map<C, double> seconds, std::map<C, int>* calls) {
  return [seconds, calls](C which, absl::FunctionRef<absl::Status()>) -> absl::StatusOr<double> {
    ++(*calls)[which];
    return seconds.at(which);
  };
}

std::map<C, double> Times(double gemm_onednn, double gemm_openblas, double sym_onednn,
                          double sym_openblas, double bf16_onednn, double bf16_f32) {
  return {{C::kFp32GemmOneDnn, gemm_onednn},     {C::kFp32GemmOpenBlas, gemm_openblas},
          {C::kFp32SymmetricOneDnn, sym_onednn}, {C::kFp32SymmetricOpenBlas, sym_openblas},
          {C::kBf16OneDnn, bf16_onednn},         {C::kBf16Float32Gemm, bf16_f32}};
}

TEST(EngineCalibration, PicksWhatTheTimerSays) {
  auto ctx = Context::CpuDefault(1);
  struct Case {
    std::map<C, double> t;
    bool bf16_default_onednn;
    Fp32GemmEngine gemm, sym;
    bool bf16_onednn;
  };
  const Case cases[] = {
      // The Emerald Rapids report: OpenBLAS on Prescott is 6x slower, oneDNN bf16 below fp32.
      {Times(1.0, 6.0, 1.0, 6.0, 1.6, 6.5), true, Fp32GemmEngine::kOneDnn, Fp32GemmEngine::kOneDnn,
       true},
      // With the right core, OpenBLAS's fp32 beats oneDNN's bf16: the widened GEMM wins.
      {Times(1.0, 1.1, 1.0, 0.8, 1.6, 1.2), true, Fp32GemmEngine::kOneDnn,
       Fp32GemmEngine::kOpenBlas, false},
      {Times(2.0, 1.0, 2.0, 1.0, 1.0, 1.0), false, Fp32GemmEngine::kOpenBlas,
       Fp32GemmEngine::kOpenBlas, false},
      // Within the 5 % margin the default stays.
      {Times(1.0, 0.97, 1.0, 0.97, 1.0, 0.97), true, Fp32GemmEngine::kOneDnn,
       Fp32GemmEngine::kOneDnn, true},
      {Times(1.0, 0.97, 1.0, 0.97, 0.97, 1.0), false, Fp32GemmEngine::kOneDnn,
       Fp32GemmEngine::kOneDnn, false},
      // Clearly faster displaces the default either way.
      {Times(1.0, 0.9, 1.0, 0.9, 0.9, 1.0), false, Fp32GemmEngine::kOpenBlas,
       Fp32GemmEngine::kOpenBlas, true},
  };
  for (const Case& c : cases) {
    std::map<C, int> calls;
    absl::StatusOr<Calibration> got =
        CalibrateAutoEngines(*ctx, c.bf16_default_onednn, FakeTimer(c.t, &calls));
    ASSERT_THAT(got, IsOk());
    const Calibration& cal = *got;
    EXPECT_EQ(cal.engines.fp32_gemm, c.gemm);
    EXPECT_EQ(cal.engines.fp32_symmetric, c.sym);
    EXPECT_TRUE(cal.engines.bf16_measured);
    EXPECT_EQ(cal.engines.bf16_onednn, c.bf16_onednn);
    EXPECT_EQ(calls.size(), static_cast<size_t>(kCalibrationCases));
    for (const auto& [which, n] : calls) {
      EXPECT_EQ(n, kCalibrationRounds + 1) << CalibrationCaseName(which);  // + warm-up
    }
    for (const auto& [which, s] : c.t) EXPECT_EQ(cal.seconds[static_cast<int>(which)], s);
    // The report names each choice and each time.
    const std::string d = cal.Describe();
    EXPECT_NE(d.find(std::string("fp32 GEMM ") +
                     (c.gemm == Fp32GemmEngine::kOneDnn ? "onednn" : "openblas")),
              std::string::npos)
        << d;
    EXPECT_NE(d.find(std::string("bf16_reference ") + (c.bf16_onednn ? "onednn" : "float32_gemm")),
              std::string::npos)
        << d;
    EXPECT_NE(d.find(absl::StrFormat("openblas %.2f ms", c.t.at(C::kFp32GemmOpenBlas) * 1e3)),
              std::string::npos)
        << d;
  }
}

TEST(EngineCalibration, ChooseIgnoresMissingMeasurements) {
  double s[kCalibrationCases] = {1.0, 0.0, 1.0, -1.0, 0.0, 0.0};
  AutoEngines e = ChooseAutoEngines(s, true);
  EXPECT_EQ(e.fp32_gemm, Fp32GemmEngine::kOneDnn);
  EXPECT_EQ(e.fp32_symmetric, Fp32GemmEngine::kOneDnn);
  EXPECT_TRUE(e.bf16_onednn);
  e = ChooseAutoEngines(s, false);
  EXPECT_FALSE(e.bf16_onednn);
}

// An engine whose op fails is unavailable and never chosen, even when it is the default; the
// calibration fails only when both engines of a pair fail.
TEST(EngineCalibration, FailingEngineIsNeverChosen) {
  auto ctx = Context::CpuDefault(1);
  auto no_bf16 = [](C which, absl::FunctionRef<absl::Status()>) -> absl::StatusOr<double> {
    if (which == C::kBf16OneDnn) return absl::InternalError("no bf16 primitive");
    return which == C::kBf16Float32Gemm ? 5.0 : 1.0;
  };
  absl::StatusOr<Calibration> got = CalibrateAutoEngines(*ctx, true, no_bf16);
  ASSERT_THAT(got, IsOk());
  EXPECT_FALSE(got->engines.bf16_onednn);
  EXPECT_EQ(got->unavailable[static_cast<int>(C::kBf16OneDnn)], "no bf16 primitive");
  EXPECT_NE(got->Describe().find("onednn unavailable"), std::string::npos) << got->Describe();
  auto no_openblas = [](C which, absl::FunctionRef<absl::Status()>) -> absl::StatusOr<double> {
    if (which == C::kFp32GemmOpenBlas) return absl::InternalError("broken");
    return which == C::kFp32GemmOneDnn ? 9.0 : 1.0;
  };
  got = CalibrateAutoEngines(*ctx, false, no_openblas);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->engines.fp32_gemm, Fp32GemmEngine::kOneDnn);
  auto neither = [](C which, absl::FunctionRef<absl::Status()>) -> absl::StatusOr<double> {
    if (which == C::kFp32SymmetricOneDnn || which == C::kFp32SymmetricOpenBlas) {
      return absl::InternalError("no symmetric product");
    }
    return 1.0;
  };
  EXPECT_EQ(CalibrateAutoEngines(*ctx, true, neither).status().code(), absl::StatusCode::kInternal);
}

// The real timer: positive times, a cost that includes them, and the process-wide choice is
// what SetAutoEngines stores.
TEST(EngineCalibration, RealTimerAndStore) {
  auto ctx = Context::CpuDefault(1);
  absl::StatusOr<Calibration> got = CalibrateAutoEngines(*ctx, false, BestOfTimer(1));
  ASSERT_THAT(got, IsOk());
  const Calibration& cal = *got;
  double sum = 0;
  for (int i = 0; i < kCalibrationCases; ++i) {
    // Only oneDNN's bf16 matmul may be missing (oneDNN 2.6 has none without AVX-512).
    if (static_cast<C>(i) == C::kBf16OneDnn && !cal.unavailable[i].empty()) {
      EXPECT_EQ(cal.seconds[i], 0);
      EXPECT_FALSE(cal.engines.bf16_onednn);
      continue;
    }
    EXPECT_TRUE(cal.unavailable[i].empty())
        << CalibrationCaseName(static_cast<C>(i)) << ": " << cal.unavailable[i];
    EXPECT_GT(cal.seconds[i], 0) << CalibrationCaseName(static_cast<C>(i));
    sum += cal.seconds[i];
  }
  EXPECT_GE(cal.cost_seconds, sum);
  const AutoEngines before = CurrentAutoEngines();
  SetAutoEngines(cal.engines);
  const AutoEngines now = CurrentAutoEngines();
  EXPECT_EQ(now.fp32_gemm, cal.engines.fp32_gemm);
  EXPECT_EQ(now.fp32_symmetric, cal.engines.fp32_symmetric);
  EXPECT_EQ(now.bf16_onednn, cal.engines.bf16_onednn);
  EXPECT_TRUE(now.bf16_measured);
  SetAutoEngines(before);
}

// kAuto follows the stored choice for a large GEMM: with OpenBLAS stored, a kAuto GEMM gives
// OpenBLAS's bits, with oneDNN stored oneDNN's. The bits differ only where the two split the
// reduction differently, which depends on the CPU's kernels (on an AVX-512 Zen 4 both sum 256
// terms in one pass and agree), so the depth is the first of several at which they differ.
TEST(EngineCalibration, AutoGemmFollowsTheStore) {
  auto ctx = Context::CpuDefault(1);
  const int64_t m = 128;  // m·m·k at least 128³: the size from which kAuto asks the store
  const AutoEngines before = CurrentAutoEngines();
  bool told_apart = false;
  for (int64_t k : {256, 1024, 2560, 4096}) {
    SCOPED_TRACE(k);
    std::vector<float> a(m * k), b(k * m), c_auto(m * m), c_ref(m * m);
    for (int64_t i = 0; i < m * k; ++i) {
      a[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
      b[i] = static_cast<float>((i * 53) % 97) / 97.0f - 0.5f;
    }
    std::vector<std::vector<float>> per_engine;
    for (Fp32GemmEngine e : {Fp32GemmEngine::kOpenBlas, Fp32GemmEngine::kOneDnn}) {
      AutoEngines set = before;
      set.fp32_gemm = e;
      SetAutoEngines(set);
      GemmParams p;
      ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data(), {m, k}), MakeView(b.data(), {k, m}),
                       MakeView(c_auto.data(), {m, m})),
                  IsOk());
      p.engine = e;
      ASSERT_THAT(Gemm(*ctx, p, MakeView(a.data(), {m, k}), MakeView(b.data(), {k, m}),
                       MakeView(c_ref.data(), {m, m})),
                  IsOk());
      EXPECT_EQ(c_auto, c_ref);
      per_engine.push_back(c_ref);
    }
    if (per_engine[0] != per_engine[1]) {
      told_apart = true;
      break;
    }
  }
  SetAutoEngines(before);
  // Otherwise the checks above could not tell the engines apart.
  EXPECT_TRUE(told_apart) << "OpenBLAS and oneDNN gave the same bits at every depth tried";
}

}  // namespace
}  // namespace diond::kernels
