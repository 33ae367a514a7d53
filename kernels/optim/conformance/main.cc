// diond-conformance: replays microsoft/dion conformance vectors through GroupOptimizer.
//
//   diond-conformance [--mode fp32|bf16_reference|both] [--threads N] [--device cpu|cuda:N]
//                     [--bf16_matmul auto|float32_gemm|onednn] [--cuda_plugin PATH]
//                     FILE_OR_FOLDER...
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
#include "kernels/plugin/plugin_backend.h"
#include "kernels/optim/conformance/runner.h"

ABSL_FLAG(std::string, mode, "both", "precision mode: fp32, bf16_reference or both");
ABSL_FLAG(int, threads, 0, "CPU threads (0: all cores)");
ABSL_FLAG(std::string, bf16_matmul, "auto",
          "bf16_reference's matmul engine (GroupConfig::bf16_matmul): auto (oneDNN where PyTorch "
          "uses it, i.e. AVX-512 CPUs; else float32_gemm), float32_gemm (also enforces bit-exact "
          "Muon/Dion2 trajectories) or onednn");
ABSL_FLAG(std::string, device, "cpu",
          "where the rules run: cpu, or cuda:N through the CUDA plugin's ops backend (exit 2 "
          "with the reason when there is no plugin or GPU; docs/GPU.md)");
ABSL_FLAG(std::string, cuda_plugin, "",
          "path of libdiond_cuda.so (default: next to this executable, then the loader's path)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "diond-conformance [--mode fp32|bf16_reference|both] [--device cpu|cuda:N] "
      "[--bf16_matmul auto|float32_gemm|onednn] FILE_OR_FOLDER...");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
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
  auto device = diond::kernels::ParseDeviceRequest(absl::GetFlag(FLAGS_device));
  if (!device.ok() || device->mode == diond::kernels::DeviceRequest::Mode::kAuto) {
    std::cerr << "diond-conformance: --device must be cpu or cuda:N\n";
    return 2;
  }
  if (device->mode == diond::kernels::DeviceRequest::Mode::kCpu) {
    auto ctx = diond::kernels::Context::CpuDefault(absl::GetFlag(FLAGS_threads));
    return diond::optim::conformance::RunAll(*ctx, paths, *mode, std::cout, *bf16_matmul) == 0 ? 0 : 1;
  }
  const absl::Status registered =
      diond::kernels::RegisterCudaOps(absl::GetFlag(FLAGS_cuda_plugin));
  if (!registered.ok()) {
    std::cerr << "diond-conformance: --device " << absl::GetFlag(FLAGS_device) << ": "
              << registered.message() << "\n";
    return 2;
  }
  const diond::kernels::Device dev{diond::kernels::DeviceType::kCuda, device->cuda_index};
  auto stream = diond::kernels::CreateDeviceStream(dev);
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
  const int failed = diond::optim::conformance::RunAll(**ctx, paths, *mode, std::cout, *bf16_matmul);
  ctx->reset();
  diond::kernels::DestroyDeviceStream(dev, *stream);
  return failed == 0 ? 0 : 1;
}
