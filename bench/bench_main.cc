// diond_bench's main: like the daemon, it re-executes itself with the daemon's thread-wait
// settings (GOMP_SPINCOUNT=10000, OPENBLAS_THREAD_TIMEOUT=18, each unless the operator set it or
// its alternative; server/exe/main.cc says why) and with OPENBLAS_CORETYPE when OpenBLAS fell back
// to its generic kernels on an AVX2/AVX-512 CPU (kernels/host_blas.h), and runs the daemon's
// start-up calibration of the `auto` engines (kernels/engine_calibration.h) unless
// DIOND_BENCH_CALIBRATE=0, so kAuto rows measure what a daemon here would run. (Without the
// wait settings OpenBLAS's workers yield for ~0.1 s after each call and the calibration's oneDNN
// times come out 2-30x too slow.) All of it is in the report's context.
#include <unistd.h>

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

namespace {

// Sets the daemon's thread-wait variables the operator left unset and re-executes once.
void ApplyDaemonThreadWaits(char** argv) {
  constexpr char kMarker[] = "DIOND_BENCH_WAIT_SET";
  if (std::getenv(kMarker) != nullptr) {
    unsetenv(kMarker);
    return;
  }
  bool set = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    setenv("GOMP_SPINCOUNT", "10000", 1);
    set = true;
  }
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr &&
      std::getenv("GOTO_THREAD_TIMEOUT") == nullptr) {
    setenv("OPENBLAS_THREAD_TIMEOUT", "18", 1);
    set = true;
  }
  if (!set) return;
  setenv(kMarker, "1", 1);
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "diond_bench: could not re-execute with the thread-wait settings\n");
  unsetenv(kMarker);
}

}  // namespace

int main(int argc, char** argv) {
  ApplyDaemonThreadWaits(argv);
  const diond::kernels::OpenBlasCoreReport core = diond::kernels::ReexecWithOpenBlasCore(argv);
  std::fprintf(stderr, "diond_bench: %s\n", core.line.c_str());
  benchmark::AddCustomContext("openblas_core", core.core);
  benchmark::AddCustomContext("openblas_core_source", core.source);
  for (const char* v : {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT"}) {
    const char* value = std::getenv(v);
    benchmark::AddCustomContext(v, value != nullptr ? value : "(unset)");
  }
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
