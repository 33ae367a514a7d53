// The device runtime: what a device backend offers besides its ops (kernels/backend.h): streams,
// stream capture and graph launch, host registration, imports of another process's memory and
// events, the pool's statistics, the context's health, and capability flags. One table of
// entries per device type (ggml's ggml_backend_device_i), registered next to the type's ops
// table and found by type; it does not grow per op.
//
// Who fills it: the plugin adapter (kernels/plugin/plugin_backend.h RegisterPluginOps) for every
// table behind the plugin C ABI: the CUDA plugin's and the host-memory TEST backend's
// (kernels/testing). The CPU has no runtime: FindDeviceRuntime(kCpu) is null.
//
// Contract:
//   * Every entry acts on the device it is given (its type is the runtime's) and, for the stream
//     entries, on the stream it is given. Failures keep the backend's code: FAILED_PRECONDITION
//     for a lost context (health) or a handle that cannot be opened, RESOURCE_EXHAUSTED for
//     memory, INTERNAL otherwise; the message names the entry and the backend.
//   * A registered runtime has every entry. A copy of one may null the capture entries (a
//     caller that wants no graphs); null capture entries mean "do not capture".
//   * destroy_stream / destroy_graph with a null handle do nothing; every other release is
//     called exactly once per acquisition.
//   * rules_on_device: the update rules (kernels/optim) may be handed this device's memory,
//     because they reach it only through the ops and explicit copies. False: they read their
//     state from the host, so a caller keeps that state in host memory (valid only for a
//     device whose memory is host-addressable).
//   * health never blocks; once it fails the context is lost for good.
//
// Thread-safety: registration and lookup are thread-safe; the entries are as thread-safe as the
// backend (the CUDA plugin's and the TEST backend's are).
#ifndef DIOND_KERNELS_DEVICE_RUNTIME_H_
#define DIOND_KERNELS_DEVICE_RUNTIME_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/cuda/plugin_api.h"

namespace diond::kernels {

struct DeviceMemoryStats {
  uint64_t in_use = 0;
  uint64_t peak = 0;
};
using GpuUuid = std::array<uint8_t, DIOND_GPU_UUID_BYTES>;
// Another process's allocation opened here (legacy CUDA IPC): its base and size.
struct IpcMapping {
  void* ptr = nullptr;
  uint64_t bytes = 0;
};
// A VMM fd mapped here; `handle` is the backend's, for unmap_vmm.
struct VmmMapping {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  void* handle = nullptr;
};

struct DeviceRuntime {
  const char* name = nullptr;  // "cuda (plugin)", "host-test device (TEST BACKEND)"
  // ---- capability flags ----
  bool rules_on_device = false;

  // ---- streams: one per session; synchronize_stream waits for all work queued on it ----
  absl::StatusOr<StreamHandle> (*create_stream)(Device) = nullptr;
  void (*destroy_stream)(Device, StreamHandle) = nullptr;
  absl::Status (*synchronize_stream)(Device, StreamHandle) = nullptr;

  // ---- capture and launch (CUDA graphs): begin on a stream, end (an executable graph), replay,
  // destroy. FAILED_PRECONDITION naming "unsupported" where the backend cannot capture. ----
  absl::Status (*begin_capture)(Device, StreamHandle) = nullptr;
  absl::StatusOr<void*> (*end_capture)(Device, StreamHandle) = nullptr;
  absl::Status (*launch_graph)(Device, StreamHandle, void* graph) = nullptr;
  void (*destroy_graph)(Device, void* graph) = nullptr;

  // ---- host registration: pins host memory (a trainer's mapping) for DMA; unregister undoes
  // exactly one register of the same pointer. Process-wide, not per device. ----
  absl::Status (*host_register)(Device, void* ptr, size_t bytes) = nullptr;
  absl::Status (*host_unregister)(Device, void* ptr) = nullptr;

  // ---- imports (docs/DATA_PLANE.md): device identity, another process's memory and events ----
  // Every device's UUID in device-index order.
  absl::StatusOr<std::vector<GpuUuid>> (*device_uuids)() = nullptr;
  // A legacy IPC memory handle (DIOND_CUDA_IPC_HANDLE_BYTES; INVALID_ARGUMENT otherwise).
  absl::StatusOr<IpcMapping> (*open_ipc_mem_handle)(Device, absl::Span<const uint8_t>) = nullptr;
  absl::Status (*close_ipc_mem_handle)(Device, void* ptr) = nullptr;
  // A VMM fd mapped, `bytes` a non-zero multiple of `granularity` (INVALID_ARGUMENT otherwise);
  // the fd stays the caller's.
  absl::StatusOr<VmmMapping> (*import_vmm_fd)(Device, int fd, uint64_t bytes,
                                              uint64_t granularity) = nullptr;
  absl::Status (*unmap_vmm)(Device, const VmmMapping&) = nullptr;
  // An interprocess event (DIOND_CUDA_IPC_HANDLE_BYTES); a stream waits for its last record, or
  // records it, with no host wait.
  absl::StatusOr<void*> (*open_ipc_event)(Device, absl::Span<const uint8_t>) = nullptr;
  absl::Status (*destroy_event)(Device, void* event) = nullptr;
  absl::Status (*stream_wait_event)(Device, StreamHandle, void* event) = nullptr;
  absl::Status (*record_event)(Device, StreamHandle, void* event) = nullptr;

  // ---- memory and health ----
  absl::StatusOr<DeviceMemoryStats> (*memory_stats)(Device) = nullptr;
  // OK while the context is usable; FAILED_PRECONDITION with the backend's reason once a sticky
  // error (an illegal address, a kernel fault) has lost it.
  absl::Status (*health)(Device) = nullptr;
  // The pool's message for the last failed allocation on this thread (budget, in use,
  // requested), or "": Context::Allocate's RESOURCE_EXHAUSTED names only the request.
  std::string (*last_allocation_error)() = nullptr;
};

// Registers `runtime` (static storage duration) for `type`. INVALID_ARGUMENT for kCpu, a null
// runtime or one with a null entry; ALREADY_EXISTS if another runtime is registered for `type`
// (the same one again is a no-op). UnregisterOpsBackendForTest (backend.h) removes it too.
absl::Status RegisterDeviceRuntime(DeviceType type, const DeviceRuntime* runtime);

// The runtime registered for `type`, or nullptr (always for kCpu).
const DeviceRuntime* FindDeviceRuntime(DeviceType type);

// The runtime registered for `type`, else one whose every entry fails with FAILED_PRECONDITION
// ("no device runtime for <type>"; the releases do nothing): for callers that hold a device and
// want its error, not a null check.
const DeviceRuntime& DeviceRuntimeFor(DeviceType type);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_DEVICE_RUNTIME_H_
