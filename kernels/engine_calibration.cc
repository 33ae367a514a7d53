#include "kernels/engine_calibration.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

// 512³: the size class of the rules' GPT-2 layers (768-3072), small enough that the whole
// calibration stays well under a second even on a generic OpenBLAS core (36 GFLOP/s: 7.5 ms a
// product).
constexpr int64_t kN = 512;
// A candidate displaces the default only when it is faster by more than this factor.
constexpr double kMargin = 0.95;

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

const char* EngineName(Fp32GemmEngine e) {
  return e == Fp32GemmEngine::kOpenBlas ? "openblas" : "onednn";
}

// Pick `other` over `def` when `def` is unavailable (time <= 0) and `other` ran, or when
// `other` is clearly faster.
bool Prefer(double other, double def) {
  if (other <= 0) return false;
  return def <= 0 || other < kMargin * def;
}

}  // namespace

const char* CalibrationCaseName(CalibrationCase c) {
  switch (c) {
    case CalibrationCase::kFp32GemmOneDnn:
      return "fp32_gemm_onednn";
    case CalibrationCase::kFp32GemmOpenBlas:
      return "fp32_gemm_openblas";
    case CalibrationCase::kFp32SymmetricOneDnn:
      return "fp32_symmetric_onednn";
    case CalibrationCase::kFp32SymmetricOpenBlas:
      return "fp32_symmetric_openblas";
    case CalibrationCase::kBf16OneDnn:
      return "bf16_onednn";
    case CalibrationCase::kBf16Float32Gemm:
      return "bf16_float32_gemm";
  }
  return "unknown";
}

CalibrationTimer BestOfTimer(int runs) {
  return [runs](CalibrationCase, absl::FunctionRef<absl::Status()> work) -> absl::StatusOr<double> {
    double best = 0;
    for (int i = 0; i < std::max(runs, 1); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      DIOND_RETURN_IF_ERROR(work());
      const double s = Seconds(std::chrono::steady_clock::now() - t0);
      best = i == 0 ? s : std::min(best, s);
    }
    return best;
  };
}

AutoEngines ChooseAutoEngines(const double (&s)[kCalibrationCases], bool bf16_default_onednn) {
  auto at = [&](CalibrationCase c) { return s[static_cast<int>(c)]; };
  AutoEngines e;
  e.fp32_gemm = Prefer(at(CalibrationCase::kFp32GemmOpenBlas), at(CalibrationCase::kFp32GemmOneDnn))
                    ? Fp32GemmEngine::kOpenBlas
                    : Fp32GemmEngine::kOneDnn;
  e.fp32_symmetric =
      Prefer(at(CalibrationCase::kFp32SymmetricOpenBlas), at(CalibrationCase::kFp32SymmetricOneDnn))
          ? Fp32GemmEngine::kOpenBlas
          : Fp32GemmEngine::kOneDnn;
  const double onednn = at(CalibrationCase::kBf16OneDnn);
  const double f32 = at(CalibrationCase::kBf16Float32Gemm);
  e.bf16_measured = true;
  e.bf16_onednn = bf16_default_onednn ? !Prefer(f32, onednn) : Prefer(onednn, f32);
  return e;
}

std::string Calibration::Describe() const {
  auto ms = [&](CalibrationCase c) {
    const int i = static_cast<int>(c);
    if (!unavailable[i].empty()) return std::string("unavailable");
    return absl::StrFormat("%.2f ms", seconds[i] * 1e3);
  };
  return absl::StrCat(
      "auto engines (512³, calibrated): fp32 GEMM ", EngineName(engines.fp32_gemm), " (onednn ",
      ms(CalibrationCase::kFp32GemmOneDnn), ", openblas ", ms(CalibrationCase::kFp32GemmOpenBlas),
      "); fp32 symmetric ", EngineName(engines.fp32_symmetric), " (onednn ",
      ms(CalibrationCase::kFp32SymmetricOneDnn), ", openblas ",
      ms(CalibrationCase::kFp32SymmetricOpenBlas), "); bf16_reference ",
      engines.bf16_onednn ? "onednn" : "float32_gemm", " (onednn ",
      ms(CalibrationCase::kBf16OneDnn), ", float32_gemm ", ms(CalibrationCase::kBf16Float32Gemm),
      "; default without a measurement ", bf16_default_onednn ? "onednn" : "float32_gemm",
      "); calibration took ", absl::StrFormat("%.0f ms", cost_seconds * 1e3));
}

absl::StatusOr<Calibration> CalibrateAutoEngines(const Context& ctx, bool bf16_default_onednn,
                                                 const CalibrationTimer& timer) {
  const auto t0 = std::chrono::steady_clock::now();
  Calibration cal;
  cal.bf16_default_onednn = bf16_default_onednn;
  // Operands: a fixed pattern in [-1, 1), bf16-exact so the f32 and bf16 operands are equal.
  std::vector<float> host(static_cast<size_t>(kN * kN));
  for (size_t i = 0; i < host.size(); ++i) {
    host[i] = static_cast<float>(static_cast<int>((i * 2654435761u) >> 24) % 256 - 128) / 128.0f;
  }
  DIOND_ASSIGN_OR_RETURN(Buffer a, ctx.Allocate(DType::kF32, {kN, kN}));
  DIOND_ASSIGN_OR_RETURN(Buffer b, ctx.Allocate(DType::kF32, {kN, kN}));
  DIOND_ASSIGN_OR_RETURN(Buffer c, ctx.Allocate(DType::kF32, {kN, kN}));
  DIOND_ASSIGN_OR_RETURN(Buffer a16, ctx.Allocate(DType::kBf16, {kN, kN}));
  DIOND_ASSIGN_OR_RETURN(Buffer b16, ctx.Allocate(DType::kBf16, {kN, kN}));
  DIOND_ASSIGN_OR_RETURN(Buffer c16, ctx.Allocate(DType::kBf16, {kN, kN}));
  DIOND_RETURN_IF_ERROR(CopyFromHost(ctx, MakeView(host.data(), {kN, kN}), a.view()));
  DIOND_RETURN_IF_ERROR(CopyFromHost(ctx, MakeView(host.data(), {kN, kN}), b.view()));
  DIOND_RETURN_IF_ERROR(Copy(ctx, a.view(), a16.view()));
  DIOND_RETURN_IF_ERROR(Copy(ctx, b.view(), b16.view()));

  ContextOptions opts;
  opts.device = ctx.device();
  opts.num_threads = ctx.num_threads();
  opts.fp32_gemm = Fp32GemmEngine::kOneDnn;
  DIOND_ASSIGN_OR_RETURN(auto onednn_ctx, Context::Create(opts));
  opts.fp32_gemm = Fp32GemmEngine::kOpenBlas;
  DIOND_ASSIGN_OR_RETURN(auto openblas_ctx, Context::Create(opts));

  auto gemm = [&](Fp32GemmEngine engine) {
    GemmParams p;
    p.engine = engine;
    return Gemm(ctx, p, a.view(), b.view(), c.view());
  };
  auto symmetric = [&](const Context& sctx) {
    return SymmetricProduct(sctx, GramSide::kAAt, 1.0f, a.view(), 0.0f, c.view());
  };
  // bf16_reference's two engines as the orthogonalizers run them (kernels/optim/orthogonalize.cc):
  // a oneDNN bf16 GEMM with a bf16 result, or the OpenBLAS sgemm of the widened operands (held
  // in f32 storage) followed by the one rounding pass.
  auto bf16_onednn = [&] { return Gemm(ctx, GemmParams{}, a16.view(), b16.view(), c16.view()); };
  auto bf16_f32 = [&]() -> absl::Status {
    DIOND_RETURN_IF_ERROR(gemm(Fp32GemmEngine::kOpenBlas));
    return Bf16RoundedAxpby(ctx, 0.0f, {}, 1.0f, c.view(), c.view());
  };
  auto gemm_onednn = [&] { return gemm(Fp32GemmEngine::kOneDnn); };
  auto gemm_openblas = [&] { return gemm(Fp32GemmEngine::kOpenBlas); };
  auto sym_onednn = [&] { return symmetric(*onednn_ctx); };
  auto sym_openblas = [&] { return symmetric(*openblas_ctx); };
  // Within a round every oneDNN case comes first: OpenBLAS's idle workers keep calling
  // sched_yield after a call (up to ~0.1 s without OPENBLAS_THREAD_TIMEOUT, TOOLCHAIN.md P21) and
  // slow the oneDNN call right after them. The rounds interleave the engines, so a burst of load
  // from other processes hits both alike, and each case keeps its best round.
  struct Item {
    CalibrationCase which;
    absl::FunctionRef<absl::Status()> work;
  };
  const Item items[] = {
      {CalibrationCase::kFp32GemmOneDnn, gemm_onednn},
      {CalibrationCase::kFp32SymmetricOneDnn, sym_onednn},
      {CalibrationCase::kBf16OneDnn, bf16_onednn},
      {CalibrationCase::kFp32GemmOpenBlas, gemm_openblas},
      {CalibrationCase::kFp32SymmetricOpenBlas, sym_openblas},
      {CalibrationCase::kBf16Float32Gemm, bf16_f32},
  };
  // Round 0 is the warm-up (oneDNN's primitives, OpenBLAS's buffers): its times are dropped,
  // and a case that fails in it is unavailable.
  absl::Status first_error[kCalibrationCases];
  for (int round = 0; round <= kCalibrationRounds; ++round) {
    for (const Item& item : items) {
      const int i = static_cast<int>(item.which);
      if (!cal.unavailable[i].empty()) continue;
      absl::StatusOr<double> t = timer(item.which, item.work);
      if (!t.ok() || *t <= 0) {
        cal.unavailable[i] =
            t.ok() ? std::string("no time measured") : std::string(t.status().message());
        first_error[i] = t.ok() ? absl::InternalError(cal.unavailable[i]) : t.status();
        cal.seconds[i] = 0;
        continue;
      }
      if (round == 0) continue;
      cal.seconds[i] = round == 1 ? *t : std::min(cal.seconds[i], *t);
    }
  }
  // A pair fails only when neither of its engines ran.
  for (const auto& [x, y] :
       {std::pair{CalibrationCase::kFp32GemmOneDnn, CalibrationCase::kFp32GemmOpenBlas},
        std::pair{CalibrationCase::kFp32SymmetricOneDnn, CalibrationCase::kFp32SymmetricOpenBlas},
        std::pair{CalibrationCase::kBf16OneDnn, CalibrationCase::kBf16Float32Gemm}}) {
    const int xi = static_cast<int>(x), yi = static_cast<int>(y);
    if (!cal.unavailable[xi].empty() && !cal.unavailable[yi].empty()) return first_error[xi];
  }
  cal.engines = ChooseAutoEngines(cal.seconds, bf16_default_onednn);
  cal.cost_seconds = Seconds(std::chrono::steady_clock::now() - t0);
  return cal;
}

}  // namespace diond::kernels
