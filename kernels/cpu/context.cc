// Implementation of kernels/context.h.
#include "kernels/context.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/threading.h"

namespace diond::kernels {

namespace {
int ResolveThreads(int n) { return n > 0 ? n : cpu::OnlineCores(); }
}  // namespace

Context::Context(const ContextOptions& options)
    : options_(options),
      num_threads_(ResolveThreads(options.num_threads)),
      scratch_(std::make_unique<ScratchArena>(options.scratch_block_bytes)) {}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(const ContextOptions& options) {
  if (options.device.type != DeviceType::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Context: device cuda:", options.device.index, " has no ops backend yet; use the CPU"));
  }
  if (options.stream != nullptr) {
    return absl::InvalidArgumentError("Context: a stream handle must be null on the CPU");
  }
  if (options.num_threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("Context: num_threads ", options.num_threads, " > 1024"));
  }
  return std::unique_ptr<Context>(new Context(options));
}

std::unique_ptr<Context> Context::CpuDefault(int num_threads) {
  ContextOptions o;
  o.num_threads = num_threads > 1024 ? 1024 : num_threads;
  return std::unique_ptr<Context>(new Context(o));
}

void Context::SetNumThreads(int num_threads) {
  num_threads_ = ResolveThreads(num_threads > 1024 ? 1024 : num_threads);
}

}  // namespace diond::kernels
