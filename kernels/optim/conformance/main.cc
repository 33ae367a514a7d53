// diond-conformance: replays microsoft/dion conformance vectors through GroupOptimizer.
//
//   diond-conformance [--mode fp32|bf16_reference|both] [--threads N]
//                     [--device cpu|cuda:N|test] [--bf16_matmul auto|float32_gemm|onednn]
//                     [--fp32_gemm auto|onednn|openblas] [--cuda_plugin PATH] FILE_OR_FOLDER...
//
// Like the daemon, it re-executes itself with OPENBLAS_CORETYPE when OpenBLAS fell back to its
// generic kernels on an AVX2/AVX-512 CPU (kernels/host_blas.h) and says which core ran.
//
// --device test (FOR CI ONLY): the host-memory TEST backend (kernels/testing) in strict mode,
// where host access of its "device" memory faults; every case is also run on the CPU and the
// check device_vs_cpu_bit_mismatches must be 0 (the TEST backend runs the CPU's arithmetic).
//
// Prints one line per case (measured error / tolerance for every check) and finally the line
// "N passed, M failed". Exit status 0 iff every case passed. See runner.h for what "pass" means.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "kernels/context.h"
#include "kernels/device.h"
#include "kernels/device_runtime.h"
#include "kernels/engine_choice.h"
#include "kernels/host_blas.h"
#include "kernels/optim/conformance/runner.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"

ABSL_FLAG(std::string, mode, "both", "precision mode: fp32, bf16_reference or both");
ABSL_FLAG(int, threads, 0, "CPU threads (0: all cores)");
ABSL_FLAG(std::string, bf16_matmul, "auto",
          "bf16_reference's matmul engine (GroupConfig::bf16_matmul): auto (oneDNN where PyTorch "
          "uses it, i.e. AVX-512 CPUs; else float32_gemm), float32_gemm (also enforces bit-exact "
          "Muon/Dion2 trajectories) or onednn");
ABSL_FLAG(std::string, device, "cpu",
          "where the rules run: cpu, or cuda:N through the CUDA plugin's ops backend (exit 2 "
          "with the reason when there is no plugin or GPU; docs/GPU.md), or test: FOR CI ONLY, "
          "the host-memory TEST backend in strict mode (host access of its device memory "
          "faults), every case also run on the CPU and required to match it bit for bit");
ABSL_FLAG(std::string, fp32_gemm, "auto",
          "the engine Fp32GemmEngine::kAuto gives large f32 GEMMs and symmetric products: auto "
          "(oneDNN, the daemon's default), onednn or openblas (the two a daemon's start-up "
          "calibration may pick)");
ABSL_FLAG(std::string, cuda_plugin, "",
          "path of libdiond_cuda.so (default: next to this executable, then the loader's path)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "diond-conformance [--mode fp32|bf16_reference|both] [--device cpu|cuda:N|test] "
      "[--bf16_matmul auto|float32_gemm|onednn] FILE_OR_FOLDER...");
  const diond::kernels::OpenBlasCoreReport core = diond::kernels::ReexecWithOpenBlasCore(argv);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::cerr << "diond-conformance: " << core.line << "\n";
  {
    const std::string fp32 = absl::GetFlag(FLAGS_fp32_gemm);
    if (fp32 != "auto" && fp32 != "onednn" && fp32 != "openblas") {
      std::cerr << "diond-conformance: --fp32_gemm '" << fp32
                << "' is unknown (want auto, onednn or openblas)\n";
      return 2;
    }
    diond::kernels::AutoEngines engines = diond::kernels::CurrentAutoEngines();
    engines.fp32_gemm = engines.fp32_symmetric = fp32 == "openblas"
                                                     ? diond::kernels::Fp32GemmEngine::kOpenBlas
                                                     : diond::kernels::Fp32GemmEngine::kOneDnn;
    diond::kernels::SetAutoEngines(engines);
  }
  std::vector<std::string> paths(positional.begin() + 1, positional.end());
  if (paths.empty()) {
    std::cerr << "usage: diond-conformance [--mode fp32|bf16_reference|both] FILE_OR_FOLDER...\n";
    return 2;
  }
  auto mode = diond::optim::conformance::ParseMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) {
    std::cerr << mode.status().message() << "\n";
    return 2;
  }
  auto bf16_matmul = diond::optim::ParseBf16MatmulEngine(absl::GetFlag(FLAGS_bf16_matmul));
  if (!bf16_matmul.ok()) {
    std::cerr << "diond-conformance: --" << bf16_matmul.status().message() << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_device) == "test") {
    // CI only: the TEST backend, strict, for DeviceType::kTest; the CPU context is the twin.
    namespace k = diond::kernels;
    const absl::Status registered =
        k::RegisterPluginOps(k::DeviceType::kTest, k::testing::HostTestDeviceOps());
    if (!registered.ok()) {
      std::cerr << "diond-conformance: --device test: " << registered.message() << "\n";
      return 2;
    }
    k::testing::SetHostTestDeviceStrict(true);
    const k::Device dev{k::DeviceType::kTest, 0};
    auto stream = k::DeviceRuntimeFor(dev.type).create_stream(dev);
    if (!stream.ok()) {
      std::cerr << "diond-conformance: " << stream.status().message() << "\n";
      return 2;
    }
    k::ContextOptions o;
    o.device = dev;
    o.stream = *stream;
    o.num_threads = 1;  // the TEST backend's ops run on one CPU thread
    auto ctx = k::Context::Create(o);
    if (!ctx.ok()) {
      std::cerr << "diond-conformance: " << ctx.status().message() << "\n";
      return 2;
    }
    std::cout << "device: host-memory TEST backend (strict mode; CI only), checked against the "
                 "CPU bit for bit\n";
    auto cpu = k::Context::CpuDefault(1);
    const int failed =
        diond::optim::conformance::RunAll(**ctx, paths, *mode, std::cout, cpu.get(), *bf16_matmul);
    ctx->reset();
    k::DeviceRuntimeFor(dev.type).destroy_stream(dev, *stream);
    return failed == 0 ? 0 : 1;
  }
  auto device = diond::kernels::ParseDeviceRequest(absl::GetFlag(FLAGS_device));
  if (!device.ok() || device->mode == diond::kernels::DeviceRequest::Mode::kAuto) {
    std::cerr << "diond-conformance: --device must be cpu, cuda:N or test\n";
    return 2;
  }
  if (device->mode == diond::kernels::DeviceRequest::Mode::kCpu) {
    auto ctx = diond::kernels::Context::CpuDefault(absl::GetFlag(FLAGS_threads));
    return diond::optim::conformance::RunAll(*ctx, paths, *mode, std::cout, nullptr,
                                             *bf16_matmul) == 0
               ? 0
               : 1;
  }
  const absl::Status registered = diond::kernels::RegisterCudaOps(absl::GetFlag(FLAGS_cuda_plugin));
  if (!registered.ok()) {
    std::cerr << "diond-conformance: --device " << absl::GetFlag(FLAGS_device) << ": "
              << registered.message() << "\n";
    return 2;
  }
  const diond::kernels::Device dev{diond::kernels::DeviceType::kCuda, device->cuda_index};
  auto stream = diond::kernels::DeviceRuntimeFor(dev.type).create_stream(dev);
  if (!stream.ok()) {
    std::cerr << "diond-conformance: " << stream.status().message() << "\n";
    return 2;
  }
  diond::kernels::ContextOptions o;
  o.device = dev;
  o.stream = *stream;
  auto ctx = diond::kernels::Context::Create(o);
  if (!ctx.ok()) {
    std::cerr << "diond-conformance: " << ctx.status().message() << "\n";
    return 2;
  }
  const int failed =
      diond::optim::conformance::RunAll(**ctx, paths, *mode, std::cout, nullptr, *bf16_matmul);
  ctx->reset();
  diond::kernels::DeviceRuntimeFor(dev.type).destroy_stream(dev, *stream);
  return failed == 0 ? 0 : 1;
}
