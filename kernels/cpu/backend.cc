// The CPU backend's table (kernels/backend.h), its host allocator, its registration for
// DeviceType::kCpu and Context::CpuDefault.
#include "kernels/cpu/backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/context.h"

namespace diond::kernels::cpu {

void* HostAllocate(Device, size_t bytes) {
  const size_t rounded = ((bytes ? bytes : 1) + 63) & ~size_t{63};
  return std::aligned_alloc(64, rounded);
}

void HostDeallocate(Device, void* p, size_t) { std::free(p); }

namespace {

absl::Status CopyFromHost(const Context&, const void* host, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host, bytes);
  return absl::OkStatus();
}

absl::Status CopyToHost(const Context&, const void* src, void* host, size_t bytes) {
  if (bytes > 0) std::memcpy(host, src, bytes);
  return absl::OkStatus();
}

// asynccopy: host memory is the CPU's device memory, so the queued copies are plain copies and
// there is no stream to wait for; the flag forms run the host-bool scans.
absl::Status CopyFromHostAsync(const Context& ctx, const void* host, void* dst, size_t bytes) {
  return CopyFromHost(ctx, host, dst, bytes);
}
absl::Status CopyToHostAsync(const Context& ctx, const void* src, void* host, size_t bytes) {
  return CopyToHost(ctx, src, host, bytes);
}
absl::Status Synchronize(const Context&) { return absl::OkStatus(); }

absl::Status AllFiniteFlag(const Context& ctx, ConstTensorView x, TensorView nonfinite) {
  bool finite = true;
  if (absl::Status s = cpu::AllFinite(ctx, x, &finite); !s.ok()) return s;
  if (!finite) *static_cast<float*>(nonfinite.data()) = 1.0f;
  return absl::OkStatus();
}

absl::Status WidenScaleCheckFiniteFlag(const Context& ctx, ConstTensorView x, float scale,
                                       TensorView out, TensorView nonfinite) {
  bool finite = true;
  if (absl::Status s = cpu::WidenScaleCheckFinite(ctx, x, scale, out, &finite); !s.ok()) {
    return s;
  }
  if (!finite) *static_cast<float*>(nonfinite.data()) = 1.0f;
  return absl::OkStatus();
}

OpsBackend MakeTable() {
  OpsBackend t;
  t.name = "cpu";
  t.allocate = &HostAllocate;
  t.deallocate = &HostDeallocate;
// NOLINTBEGIN(bugprone-macro-parentheses): X-macro arguments are names, types and
// parameter lists, which parentheses would break.
#define DIOND_OP(name, Name, kind, cpp_params, c_params) t.name = &Name;
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) t.name = &Name;
#include "kernels/ops.def"
  // NOLINTEND(bugprone-macro-parentheses)
  return t;
}

bool RegisterCpu() {
  const absl::Status s = RegisterOpsBackend(DeviceType::kCpu, &CpuBackend());
  if (!s.ok()) {  // a programming error (an incomplete table), found by every test
    std::fprintf(stderr, "diond: cannot register the CPU ops backend: %s\n", s.ToString().c_str());
    std::abort();
  }
  return true;
}

// Registers the table before main(). The diond::ops target links this object file into every
// program that uses the ops API (kernels/cpu/CMakeLists.txt: -u diond_cpu_ops_backend_anchor).
const bool registered = RegisterCpu();

}  // namespace

const OpsBackend& CpuBackend() {
  static const OpsBackend table = MakeTable();
  return table;
}

}  // namespace diond::kernels::cpu

// The symbol the linker is told to resolve, which pulls this file (and its registration) out of
// the static library even though nothing calls into it by name.
extern "C" {
int diond_cpu_ops_backend_anchor = 1;
}

namespace diond::kernels {

std::unique_ptr<Context> Context::CpuDefault(int num_threads) {
  (void)cpu::registered;
  ContextOptions o;
  o.num_threads = num_threads > 1024 ? 1024 : num_threads;
  auto ctx = Create(o);
  if (!ctx.ok()) {  // the CPU backend is registered above, so this cannot happen
    std::fprintf(stderr, "diond: %s\n", ctx.status().ToString().c_str());
    std::abort();
  }
  return *std::move(ctx);
}

}  // namespace diond::kernels
