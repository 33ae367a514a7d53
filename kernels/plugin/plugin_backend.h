// The host-side adapter of a device backend behind the plugin C ABI (kernels/cuda/plugin_api.h,
// DiondOpsApiV1): an OpsBackend (kernels/backend.h) whose entries convert TensorViews into
// DiondTensor records, pass ctx.stream() and ctx.device().index, and turn the plugin's return
// codes into absl::Status. The ops dispatcher has validated every argument before an entry runs,
// so the adapter adds no checks of its own.
//
// Two tables can be adapted at once: the CUDA plugin's (DeviceType::kCuda) and the host-memory
// TEST backend of kernels/testing/host_device_backend.h (DeviceType::kTest), which exercises this
// adapter, the C ABI and the device paths of the daemon in CI without a GPU.
//
// Thread-safety: registration is thread-safe (kernels/backend.h); the adapted entries are as
// thread-safe as the plugin's.
#ifndef DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_
#define DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/cuda/plugin_api.h"

namespace diond::kernels {

// The OpsBackend adapting `ops` for `type` (kCuda or kTest; INVALID_ARGUMENT otherwise, or for a
// null table, a table of another DIOND_OPS_API_VERSION, or one with a null entry). The table
// must outlive the process (static storage or a never-unloaded plugin). Calling it again for the
// same type with another table replaces the adapted table only if nothing is registered for the
// type yet.
absl::StatusOr<const OpsBackend*> AdaptPluginOps(DeviceType type, const DiondOpsApiV1* ops);

// AdaptPluginOps + RegisterOpsBackend.
absl::Status RegisterPluginOps(DeviceType type, const DiondOpsApiV1* ops);

// Loads the CUDA plugin (device.h LoadCudaPlugin rule for `plugin_path`) and registers its ops
// for kCuda when at least one device exists; FAILED_PRECONDITION naming the reason otherwise.
// The daemon calls it for --device=cuda:N and --device=auto (server/exe/daemon.cc).
absl::Status RegisterCudaOps(const std::string& plugin_path);

// Per-session device objects through the same table (kCuda or kTest): a stream, and the pool's
// accounting. FAILED_PRECONDITION when nothing is adapted for the device's type.
absl::StatusOr<StreamHandle> CreateDeviceStream(Device device);
void DestroyDeviceStream(Device device, StreamHandle stream);
absl::Status SynchronizeDeviceStream(Device device, StreamHandle stream);
struct DeviceMemoryStats {
  uint64_t in_use = 0;
  uint64_t peak = 0;
};
absl::StatusOr<DeviceMemoryStats> GetDeviceMemoryStats(Device device);
// OK while `device`'s context is usable; FAILED_PRECONDITION with the backend's reason once a
// sticky error (CUDA: an illegal address, a kernel fault) has lost it, for good: every device
// entry then fails. Never blocks (the table's device_health). FAILED_PRECONDITION too when
// nothing is adapted for the device's type.
absl::Status DeviceHealth(Device device);

// devsession: pins host memory (a trainer's shm / memfd mapping) for DMA through the table's
// host_register (CUDA: cudaHostRegister) and undoes it (host_unregister, exactly once per
// register). FAILED_PRECONDITION when nothing is adapted for the device's type; the plugin's
// error otherwise (e.g. a range registered twice).
absl::Status HostRegister(Device device, void* ptr, size_t bytes);
absl::Status HostUnregister(Device device, void* ptr);
// devsession: stream capture (CUDA graphs) on `stream`: begin, end (an executable graph), replay,
// destroy. FAILED_PRECONDITION naming "unsupported" where the backend cannot capture (the TEST
// backend).
absl::Status BeginStreamCapture(Device device, StreamHandle stream);
absl::StatusOr<void*> EndStreamCapture(Device device, StreamHandle stream);
absl::Status LaunchGraph(Device device, StreamHandle stream, void* graph);
void DestroyGraph(Device device, void* graph);

// The plugin's message for the last failed device allocation on this thread (the pool's numbers:
// budget, in use, requested), or "" — Context::Allocate's RESOURCE_EXHAUSTED names only the
// request, so code that reports an over-budget session appends this.
std::string LastDeviceAllocationError();

// ---- handoff (docs/DATA_PLANE.md): the GPU half's device objects through the same
// table (kCuda or kTest). FAILED_PRECONDITION when nothing is adapted for the device's type;
// the plugin's refusals keep its code (FAILED_PRECONDITION for a handle it cannot open). ----
using GpuUuid = std::array<uint8_t, DIOND_GPU_UUID_BYTES>;
// Every device's UUID, in device-index order (what MapGpuUuid maps a trainer's UUID against).
absl::StatusOr<std::vector<GpuUuid>> ListDeviceUuids(DeviceType type);
// A legacy CUDA IPC memory handle (DIOND_CUDA_IPC_HANDLE_BYTES; INVALID_ARGUMENT otherwise)
// opened on `device`: the exporter's allocation, base and size.
struct IpcMapping {
  void* ptr = nullptr;
  uint64_t bytes = 0;
};
absl::StatusOr<IpcMapping> OpenIpcMemHandle(Device device, absl::Span<const uint8_t> handle);
absl::Status CloseIpcMemHandle(Device device, void* ptr);
// A VMM fd (cuMemExportToShareableHandle) mapped on `device`, `bytes` a non-zero multiple of
// `granularity` (INVALID_ARGUMENT otherwise). The fd stays the caller's.
struct VmmMapping {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  void* handle = nullptr;  // the plugin's allocation handle
};
absl::StatusOr<VmmMapping> ImportVmmFd(Device device, int fd, uint64_t bytes, uint64_t granularity);
absl::Status UnmapVmm(Device device, const VmmMapping& mapping);
// An interprocess event (DIOND_CUDA_IPC_HANDLE_BYTES) opened on `device`; `stream` waits for
// its last record, or records it, with no host wait.
absl::StatusOr<void*> OpenIpcEvent(Device device, absl::Span<const uint8_t> handle);
absl::Status DestroyEvent(Device device, void* event);
absl::Status StreamWaitEvent(Device device, StreamHandle stream, void* event);
absl::Status RecordEvent(Device device, StreamHandle stream, void* event);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_
