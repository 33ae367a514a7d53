// Replays optimizer conformance vectors (tests/conformance/README.md) through the same
// GroupOptimizer path the daemon uses, and compares with the stored reference trajectories.
//
// A case file holds param.init, grad.1..T, param.1..T, state.<name>.init/.final and optionally
// param_f64.T, plus metadata (algorithm, hyperparameters, param_group_options, T, shape,
// state_names, tolerance_*). Any shape and any T are accepted. A case of several parameters in
// one group (metadata num_params = N > 1) holds the same tensors for parameter i > 0 under the
// prefix "p<i>." (p1.param.init, p1.grad.1, ...); all N are stepped together (megabatched by
// shape) and every error is the worst over the matrices.
//
// What passes (per precision mode; with Mode::kBoth a case passes only if both modes pass):
//   fp32 mode: param_f64_final_relfro, delta_f64_final_relfro and every state tolerance
//     (Dion's Q up to per-column sign, step_dev as a relative difference); algorithms without a
//     bf16 path (dion, dion_reference, adamw, lion) also param_relfro and delta_relfro.
//   bf16_reference mode: bf16 algorithms (muon, normuon, dion2, nordion2): param_relfro, the
//     state tolerances and bf16_reference_delta_relfro (the update p_t - p_0 against the stored
//     reference's, max over steps, bounded by the reference's own rounding spread); the others:
//     the same checks as fp32 mode.
// Tolerances come from the file's `tolerance_*` metadata, completed by a manifest.json found in
// the file's folder or its parent (entry matched by file name). A check whose tolerance or
// reference tensor is missing is reported as skipped; a case with no enforced check fails.
//
// Thread-safety: not thread-safe (one Context).
#ifndef DIOND_KERNELS_OPTIM_CONFORMANCE_RUNNER_H_
#define DIOND_KERNELS_OPTIM_CONFORMANCE_RUNNER_H_

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim::conformance {

enum class Mode { kFp32, kBf16Reference, kBoth };
absl::StatusOr<Mode> ParseMode(absl::string_view s);

struct Check {
  std::string name;  // "param_relfro", "state.momentum", ...
  double measured = 0;
  std::optional<double> tolerance;
  bool enforced = false;  // part of the pass criterion of this mode
  bool skipped = false;   // enforced but not evaluable (missing tolerance / tensor)
  bool ok() const { return !enforced || skipped || (tolerance && measured <= *tolerance); }
};

struct ModeResult {
  Precision precision = Precision::kFp32;
  // bf16_reference: the engine its matmuls ran on (resolved, never kAuto).
  Bf16MatmulEngine bf16_matmul = Bf16MatmulEngine::kFloat32Gemm;
  std::vector<Check> checks;
  bool passed = false;
};

struct CaseResult {
  std::string file;
  std::string algorithm;
  std::vector<ModeResult> modes;
  std::string error;  // non-empty: the case could not be run (counts as failed)
  bool passed = false;
};

// Expands files and folders (folders: every *.safetensors inside, recursively, sorted).
absl::StatusOr<std::vector<std::string>> CollectVectorFiles(const std::vector<std::string>& args);

// Runs one case file on ctx (parameters, gradients and state uploaded to ctx's device, results
// read back through explicit copies). Errors in the file itself are reported in
// CaseResult::error. With `cpu_twin` (a CPU context), every mode is run on it too and the check
// "device_vs_cpu_bit_mismatches" (enforced, tolerance 0) counts the elements of the parameters
// after every step and of the final states whose bits differ between ctx and the CPU.
// bf16_matmul: GroupConfig::bf16_matmul of the bf16_reference runs. With kFloat32Gemm (as
// resolved), Muon and Dion2 cases also enforce bf16_reference_bitwise: the update equals the
// stored trajectory's bit for bit (relF = 0).
CaseResult RunCase(const kernels::Context& ctx, const std::string& path, Mode mode,
                   const kernels::Context* cpu_twin = nullptr,
                   Bf16MatmulEngine bf16_matmul = Bf16MatmulEngine::kAuto);

// One line describing the result ("PASS <file> ..." / "FAIL <file> ...").
std::string FormatResult(const CaseResult& r);

// Runs all `paths`, prints one line per case and the final "N passed, M failed" line to `out`.
// Returns the number of failed cases (collection errors count as one failure).
int RunAll(const kernels::Context& ctx, const std::vector<std::string>& paths, Mode mode,
           std::ostream& out, const kernels::Context* cpu_twin = nullptr,
           Bf16MatmulEngine bf16_matmul = Bf16MatmulEngine::kAuto);

}  // namespace diond::optim::conformance

#endif  // DIOND_KERNELS_OPTIM_CONFORMANCE_RUNNER_H_
