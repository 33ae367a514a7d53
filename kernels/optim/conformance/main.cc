// diond-conformance: replays microsoft/dion conformance vectors through GroupOptimizer.
//
//   diond-conformance [--mode fp32|bf16_reference|both] [--threads N] FILE_OR_FOLDER...
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
#include "kernels/optim/conformance/runner.h"

ABSL_FLAG(std::string, mode, "both", "precision mode: fp32, bf16_reference or both");
ABSL_FLAG(int, threads, 0, "CPU threads (0: all cores)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "diond-conformance [--mode fp32|bf16_reference|both] FILE_OR_FOLDER...");
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
  auto ctx = diond::kernels::Context::CpuDefault(absl::GetFlag(FLAGS_threads));
  const int failed = diond::optim::conformance::RunAll(*ctx, paths, *mode, std::cout);
  return failed == 0 ? 0 : 1;
}
