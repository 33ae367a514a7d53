// Device selection: which compute device a worker uses, and the factory that loads the CUDA
// plugin (libdiond_cuda.so) with dlopen when a GPU is asked for (ARCHITECTURE.md §3).
//
// The daemon binary links no CUDA library; everything CUDA sits behind the plugin's C ABI in
// kernels/cuda/plugin_api.h. Thread-safety: SelectDevice may be called from any thread; the
// loaded plugin stays loaded for the life of the process.
#ifndef DIOND_KERNELS_DEVICE_H_
#define DIOND_KERNELS_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/plugin_api.h"

namespace diond::kernels {

// kTest is a fake device for tests only (kernels/testing): SelectDevice never returns it, no
// production code registers a backend for it or names it; a test binary registers one the way
// a plugin is registered (kernels/plugin/plugin_backend.h).
enum class DeviceType { kCpu, kCuda, kTest };

// How logs and metrics name a device: "cpu" (no index), "cuda:N", "test-device:N".
std::string DeviceLabel(DeviceType type, int index);

// What the operator asked for with --device.
struct DeviceRequest {
  enum class Mode { kAuto, kCpu, kCuda };
  Mode mode = Mode::kAuto;
  int cuda_index = 0;  // meaningful for kCuda
};

// Parses "auto", "cpu", "cuda" (= cuda:0) or "cuda:N". INVALID_ARGUMENT names the bad text.
absl::StatusOr<DeviceRequest> ParseDeviceRequest(absl::string_view text);

// The device a worker ended up on, with a human-readable description for logs and metrics.
struct SelectedDevice {
  DeviceType type = DeviceType::kCpu;
  int index = 0;
  std::string name;             // e.g. "cpu (2 threads)" or "NVIDIA H200"
  std::string fallback_reason;  // why auto mode fell back to the CPU; empty otherwise
  bool cuda_plugin_loaded = false;
};

// Picks the device. `plugin_path` is the CUDA plugin to dlopen; empty means "libdiond_cuda.so"
// next to the executable, then the loader's search path.
// - kCpu: never touches the plugin.
// - kAuto: loads the plugin if it can and uses GPU 0 when one is present; otherwise the CPU,
//   with fallback_reason saying why (no plugin, no driver, no device).
// - kCuda: the plugin and the device must exist; else FAILED_PRECONDITION with the reason.
absl::StatusOr<SelectedDevice> SelectDevice(const DeviceRequest& request,
                                            const std::string& plugin_path);

// The CUDA plugin's C ABI table (loaded once per process, never unloaded), for code that needs
// more than device selection: the NCCL communicators of server/comm. FAILED_PRECONDITION with
// the loader's reason when the plugin cannot be loaded. Same `plugin_path` rule as SelectDevice.
absl::StatusOr<const DiondCudaPluginV1*> LoadCudaPlugin(const std::string& plugin_path);

// Number of CPU threads the compute pool uses (the threading policy: one pool, no
// oversubscription between BLAS, oneDNN and our own threads).
int DefaultCpuThreads();

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_DEVICE_H_
