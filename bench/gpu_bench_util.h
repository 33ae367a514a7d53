// Shared by the GPU benchmarks (diond-gpu-bench, diond-ipc-bench): one CUDA Context through the
// plugin's ops backend, synchronized timing, and the in-process step of a GroupOptimizer that
// both report against.
#ifndef DIOND_BENCH_GPU_BENCH_UTIL_H_
#define DIOND_BENCH_GPU_BENCH_UTIL_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/optim/group_optimizer.h"
#include "nlohmann/json.hpp"

namespace diond::bench {

struct GpuBench {
  kernels::Device dev;
  kernels::StreamHandle stream = nullptr;
  std::unique_ptr<kernels::Context> ctx;
  int reps = 10;

  // Registers the plugin's CUDA ops and makes a Context with its own stream on cuda:0. Returns
  // 0, 77 (no GPU to measure: one line on stderr, as the benchmarks exit) or 1 (a failure).
  int Open(const char* program, const std::string& plugin, int reps);
  ~GpuBench();

  // Mean seconds per call of `f` over `reps` calls after one warm-up, synchronized.
  absl::StatusOr<double> Time(const std::function<absl::Status()>& f) const;
  // A tensor of `shape` on the device, every element `value`.
  absl::StatusOr<kernels::Buffer> Filled(kernels::DType t, const std::vector<int64_t>& shape,
                                         float value) const;
  // One GroupOptimizer step on device-resident parameters (0.01) and gradients (0.001), timed.
  // With `graph`, the step's update (Stage) runs through a kernels::StepGraph as a device
  // session runs it (docs/GPU.md "CUDA graphs"): captured at the warm-up, replayed in the timed
  // steps, with a new learning rate each step; an error names the fallback reason if it cannot.
  absl::StatusOr<double> StepTime(optim::AlgorithmKind kind,
                                  const std::vector<optim::ParamShape>& shapes,
                                  double rank_fraction, optim::Precision precision,
                                  bool graph = false) const;
};

// {"error": "<status>"}: a measurement that could not run, written with its reason.
nlohmann::json Err(const absl::Status& s);

// The GPT-2-small hidden matrices of `layers` layers: per layer 4 × 768², 768×3072, 3072×768.
std::vector<optim::ParamShape> Gpt2SmallMatrices(int layers);

// Writes `out` to `path` (stdout when empty).
void WriteJson(const nlohmann::json& out, const std::string& path);

}  // namespace diond::bench

#endif  // DIOND_BENCH_GPU_BENCH_UTIL_H_
