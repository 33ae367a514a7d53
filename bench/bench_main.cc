// diond_bench's main: like the daemon, it re-executes itself with OPENBLAS_CORETYPE when
// OpenBLAS fell back to its generic kernels on an AVX2/AVX-512 CPU (kernels/host_blas.h), and
// runs the daemon's start-up calibration of the `auto` engines (kernels/engine_calibration.h)
// unless DIOND_BENCH_CALIBRATE=0, so kAuto rows measure what a daemon here would run. Both are
// in the report's context (openblas_core, auto_engines).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/engine_calibration.h"
#include "kernels/engine_choice.h"
#include "kernels/host_blas.h"
#include "kernels/optim/optimizer_types.h"

int main(int argc, char** argv) {
  const diond::kernels::OpenBlasCoreReport core = diond::kernels::ReexecWithOpenBlasCore(argv);
  std::fprintf(stderr, "diond_bench: %s\n", core.line.c_str());
  benchmark::AddCustomContext("openblas_core", core.core);
  benchmark::AddCustomContext("openblas_core_source", core.source);
  const char* calibrate = std::getenv("DIOND_BENCH_CALIBRATE");
  if (calibrate == nullptr || std::strcmp(calibrate, "0") != 0) {
    auto ctx = diond::kernels::Context::CpuDefault();
    auto cal = diond::kernels::CalibrateAutoEngines(
        *ctx, diond::optim::IsaBf16Matmul() == diond::optim::Bf16MatmulEngine::kOneDnn);
    if (cal.ok()) {
      diond::kernels::SetAutoEngines(cal->engines);
      std::fprintf(stderr, "diond_bench: %s\n", cal->Describe().c_str());
      benchmark::AddCustomContext("auto_engines", cal->Describe());
    } else {
      std::fprintf(stderr, "diond_bench: calibration failed: %s\n",
                   std::string(cal.status().message()).c_str());
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
