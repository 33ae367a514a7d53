// The backend table of the ops API (ARCHITECTURE.md §3, docs/KERNELS.md): one function
// pointer per op of kernels/ops.h plus the device-memory entries, filled by each backend and
// selected by the Context's device.
//
// How a call runs: the public free function in ops.h validates its arguments once (ranks,
// shapes, dtypes, strides, scalars, and that every view is on ctx.device(): checks that do not
// depend on the device) and then calls ctx.backend().<op> with the same arguments. A backend
// entry may assume valid arguments; it reports only failures of its own (INTERNAL for a library
// error, FAILED_PRECONDITION for a rank-deficient factorization, RESOURCE_EXHAUSTED for memory).
//
// Backends: kernels/cpu (registered for DeviceType::kCpu by the diond::ops target) and, for
// tests only, kernels/testing (DeviceType::kTest). The CUDA backend lives in libdiond_cuda.so
// behind the plugin's versioned C ABI (kernels/cuda/plugin_api.h, DiondOpsApiV1); the adapter in
// kernels/plugin fills this table from that C table (docs/KERNELS.md §7, docs/GPU.md).
//
// Code above the kernels (kernels/optim, server/) includes ops.h and context.h, never this file's
// implementations: tests/layering_test.sh enforces that no backend header is included there.
#ifndef DIOND_KERNELS_BACKEND_H_
#define DIOND_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/ops.h"

namespace diond::kernels {

// Bumped when an entry is added, removed or changes signature; RegisterOpsBackend refuses a
// table of another version.
inline constexpr uint32_t kOpsBackendVersion = 7;  // 2: ortho; 3: kops; 4: steps; 5: async copies;
                                                   // 6: decay_scatter_with_change; 7: the fused
                                                   // steps' scalars_on_device (kernels/graph.h)

struct OpsBackend {
  uint32_t version = kOpsBackendVersion;
  const char* name = nullptr;  // "cpu", "test-recording", ...

  // ---- device memory (Context::Allocate and the Context's scratch arena) ----
  // `bytes` (> 0) aligned to 64 bytes at least, on `device`; nullptr when out of memory.
  void* (*allocate)(Device device, size_t bytes) = nullptr;
  void (*deallocate)(Device device, void* p, size_t bytes) = nullptr;
  // ---- ops (kernels/ops.h, same arguments; called only after validation), expanded from
  // kernels/ops.def. copy_from_host / copy_to_host: synchronous for the caller (a stream backend
  // queues on ctx.stream() and waits: each call is a sync point, docs/KERNELS.md);
  // copy_*_async: queued on ctx.stream(), the host memory untouched by the host until
  // `synchronize`, the wait for the context's stream. adamw_step, lion_step, their tracked forms
  // and apply_update: when the params' non-null scalars_on_device is set (kernels/graph.h does,
  // after validation), the op reads its scalars from that device record when it runs, not from
  // the params' fields; a backend without graphs (the CPU) never gets it. ----
// NOLINTBEGIN(bugprone-macro-parentheses): X-macro arguments are names, types and
// parameter lists, which parentheses would break.
#define DIOND_OP(name, Name, kind, cpp_params, c_params) absl::Status(*name) cpp_params = nullptr;
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) \
  absl::Status(*name) cpp_params = nullptr;
#include "kernels/ops.def"
  // NOLINTEND(bugprone-macro-parentheses)
};

// Registers `backend` (static storage duration) for every device of `type`. INVALID_ARGUMENT for
// a null table, a table of another version or one with a null entry; ALREADY_EXISTS if a
// different table is registered for `type` (registering the same table again is a no-op).
// Thread-safe.
absl::Status RegisterOpsBackend(DeviceType type, const OpsBackend* backend);

// The table registered for `type`, or nullptr. Thread-safe.
const OpsBackend* FindOpsBackend(DeviceType type);

// The device whose backend runs the ops for the device the daemon selected: the selected device
// itself when this build has an ops backend registered for it, else the CPU. The CUDA backend
// is registered by RegisterCudaOps (kernels/plugin/plugin_backend.h), which the daemon calls for
// --device=cuda:N / auto; it then also requires the update rules to run on a device context
// before it computes there (server/exe/daemon.cc, docs/GPU.md "Device sessions").
Device ComputeDevice(const SelectedDevice& selected);

// Test-only: removes the registration for `type` (so a test can register its own table).
void UnregisterOpsBackendForTest(DeviceType type);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_BACKEND_H_
