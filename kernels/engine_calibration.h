// The start-up calibration of the `auto` engines (kernels/engine_choice.h): times each engine
// `auto` may pick on one product of the rules' size (512³; 0.27 GFLOP) and chooses the faster.
// The candidates are fixed (fp32: oneDNN or OpenBLAS; bf16_reference: oneDNN bf16 or the widened
// fp32 GEMM), so the calibration only picks among engines that pass conformance; a candidate
// must be more than 5 % faster to displace the default (oneDNN for fp32, the ISA rule for bf16),
// so two runs on a quiet machine agree. A candidate whose op fails (oneDNN 2.6 has no bf16 matmul
// on a CPU without AVX-512) is unavailable and never chosen; when both of a pair fail, the
// calibration fails.
#ifndef DIOND_KERNELS_ENGINE_CALIBRATION_H_
#define DIOND_KERNELS_ENGINE_CALIBRATION_H_

#include <functional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/engine_choice.h"

namespace diond::kernels {

enum class CalibrationCase : int {
  kFp32GemmOneDnn,
  kFp32GemmOpenBlas,
  kFp32SymmetricOneDnn,    // SymmetricProduct, oneDNN's lower column panels
  kFp32SymmetricOpenBlas,  // SymmetricProduct, ssyrk
  kBf16OneDnn,             // bf16 × bf16 → bf16 oneDNN GEMM
  kBf16Float32Gemm,        // the widened operands' OpenBLAS sgemm, rounded once to bf16
};
constexpr int kCalibrationCases = 6;
const char* CalibrationCaseName(CalibrationCase c);  // "fp32_gemm_onednn", ...

// Times one case once per round: runs `work` (which returns its status) as often as it likes
// and returns seconds per run. The default times `runs` runs on steady_clock and returns the
// best. The calibration calls it for every case in a warm-up round (time dropped; a case that
// fails there cannot run here), then in kCalibrationRounds rounds, each case keeping its best.
using CalibrationTimer =
    std::function<absl::StatusOr<double>(CalibrationCase, absl::FunctionRef<absl::Status()>)>;
CalibrationTimer BestOfTimer(int runs = 1);
constexpr int kCalibrationRounds = 5;

struct Calibration {
  AutoEngines engines;
  double seconds[kCalibrationCases] = {};  // per case, as the timer returned them; 0: unavailable
  std::string unavailable[kCalibrationCases];  // why a case could not run ("" = it ran)
  double cost_seconds = 0;                     // wall time of the whole calibration
  bool bf16_default_onednn = false;            // the ISA rule's choice (the bf16 default)
  // "fp32 GEMM onednn (512³: onednn 4.1 ms, openblas 6.0 ms), ... ; calibration 61 ms"
  std::string Describe() const;
};

// Measures on ctx's device and thread count (a CPU context). bf16_default_onednn: the engine
// bf16_matmul=auto takes without a measurement (optim::ResolveBf16Matmul's ISA rule). Does not
// call SetAutoEngines. The error of the pair's ops when both engines of a pair fail.
absl::StatusOr<Calibration> CalibrateAutoEngines(const Context& ctx, bool bf16_default_onednn,
                                                 const CalibrationTimer& timer = BestOfTimer());

// The choice rule on given timings (what CalibrateAutoEngines applies; a time <= 0 is an
// unavailable engine): exposed for tests.
AutoEngines ChooseAutoEngines(const double (&seconds)[kCalibrationCases], bool bf16_default_onednn);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_ENGINE_CALIBRATION_H_
