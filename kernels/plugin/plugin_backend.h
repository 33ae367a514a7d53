// The host-side adapter of a device backend behind the plugin C ABI (kernels/cuda/plugin_api.h,
// DiondOpsApiV1): an OpsBackend (kernels/backend.h) whose entries convert TensorViews into
// DiondTensor records, pass ctx.stream() and ctx.device().index, and turn the plugin's return
// codes into absl::Status, and the DeviceRuntime (kernels/device_runtime.h) whose entries are
// the table's DIOND_ENTRY rows. The ops dispatcher has validated every argument before an op
// runs, so the adapter adds no checks of its own.
//
// Two tables can be adapted at once: the CUDA plugin's (DeviceType::kCuda) and the host-memory
// TEST backend of kernels/testing/host_device_backend.h (DeviceType::kTest), which exercises this
// adapter, the C ABI and the device paths of the daemon in CI without a GPU.
//
// Thread-safety: registration is thread-safe (kernels/backend.h); the adapted entries are as
// thread-safe as the plugin's.
#ifndef DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_
#define DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// AdaptPluginOps + RegisterOpsBackend + RegisterDeviceRuntime of the table's runtime: the one
// registration path of a device backend, the CUDA plugin's and a test binary's alike.
absl::Status RegisterPluginOps(DeviceType type, const DiondOpsApiV1* ops);

// Loads the CUDA plugin (device.h LoadCudaPlugin rule for `plugin_path`) and registers its ops
// for kCuda when at least one device exists; FAILED_PRECONDITION naming the reason otherwise.
// The daemon calls it for --device=cuda:N and --device=auto (server/exe/daemon.cc).
absl::Status RegisterCudaOps(const std::string& plugin_path);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_PLUGIN_PLUGIN_BACKEND_H_
