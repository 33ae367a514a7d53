#include "kernels/device.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/plugin_api.h"

namespace diond::kernels {
namespace {

std::string ExecutableDir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, static_cast<size_t>(n));
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

struct LoadedPlugin {
  const DiondCudaPluginV1* api = nullptr;
  std::string error;
};

// dlopen once per process; the handle is never closed (the CUDA libraries do not support it).
const LoadedPlugin& LoadPlugin(const std::string& plugin_path) {
  static absl::Mutex mu;
  static LoadedPlugin* loaded ABSL_GUARDED_BY(mu) = nullptr;
  absl::MutexLock lock(&mu);
  if (loaded != nullptr) return *loaded;
  loaded = new LoadedPlugin;
  std::vector<std::string> candidates;
  if (!plugin_path.empty()) {
    candidates.push_back(plugin_path);
  } else {
    std::string dir = ExecutableDir();
    if (!dir.empty()) candidates.push_back(dir + "/libdiond_cuda.so");
    candidates.push_back("libdiond_cuda.so");
  }
  std::string errors;
  for (const std::string& c : candidates) {
    void* handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = dlerror();
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", e ? e : c);
      continue;
    }
    auto entry = reinterpret_cast<DiondCudaPluginEntryFn>(dlsym(handle, DIOND_CUDA_PLUGIN_ENTRY));
    if (entry == nullptr) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", c, ": no symbol ",
                      DIOND_CUDA_PLUGIN_ENTRY);
      continue;
    }
    const DiondCudaPluginV1* api = entry();
    if (api == nullptr || api->abi_major != DIOND_CUDA_PLUGIN_ABI_MAJOR) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", c, ": plugin ABI major ",
                      api ? api->abi_major : 0, " != ", DIOND_CUDA_PLUGIN_ABI_MAJOR);
      continue;
    }
    loaded->api = api;
    return *loaded;
  }
  loaded->error = absl::StrCat("cannot load the CUDA plugin: ", errors);
  return *loaded;
}

}  // namespace

absl::StatusOr<DeviceRequest> ParseDeviceRequest(absl::string_view text) {
  DeviceRequest r;
  if (text == "auto") return r;
  if (text == "cpu") {
    r.mode = DeviceRequest::Mode::kCpu;
    return r;
  }
  if (text == "cuda") {
    r.mode = DeviceRequest::Mode::kCuda;
    return r;
  }
  if (absl::StartsWith(text, "cuda:")) {
    int idx = -1;
    if (absl::SimpleAtoi(text.substr(5), &idx) && idx >= 0) {
      r.mode = DeviceRequest::Mode::kCuda;
      r.cuda_index = idx;
      return r;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", text, "' is not one of auto, cpu, cuda, cuda:N"));
}

absl::StatusOr<const DiondCudaPluginV1*> LoadCudaPlugin(const std::string& plugin_path) {
  const LoadedPlugin& plugin = LoadPlugin(plugin_path);
  if (plugin.api == nullptr) return absl::FailedPreconditionError(plugin.error);
  return plugin.api;
}

int DefaultCpuThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

std::string DeviceLabel(DeviceType type, int index) {
  switch (type) {
    case DeviceType::kCuda:
      return absl::StrCat("cuda:", index);
    case DeviceType::kTest:
      return absl::StrCat("test-device:", index);
    default:
      return "cpu";
  }
}

absl::StatusOr<SelectedDevice> SelectDevice(const DeviceRequest& request,
                                            const std::string& plugin_path) {
  SelectedDevice cpu;
  cpu.type = DeviceType::kCpu;
  cpu.name = absl::StrCat("cpu (", DefaultCpuThreads(), " threads)");
  if (request.mode == DeviceRequest::Mode::kCpu) return cpu;

  const LoadedPlugin& plugin = LoadPlugin(plugin_path);
  const bool want_cuda = request.mode == DeviceRequest::Mode::kCuda;
  if (plugin.api == nullptr) {
    if (want_cuda) return absl::FailedPreconditionError(plugin.error);
    cpu.fallback_reason = plugin.error;
    return cpu;
  }
  cpu.cuda_plugin_loaded = true;
  char err[256] = {0};
  int count = plugin.api->device_count(err, sizeof(err));
  if (count <= 0) {
    std::string why = count < 0 ? std::string(err) : "no CUDA device present";
    if (want_cuda) return absl::FailedPreconditionError(absl::StrCat("no GPU: ", why));
    cpu.fallback_reason = why;
    return cpu;
  }
  if (request.cuda_index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda:", request.cuda_index, " does not exist; ", count, " present"));
  }
  SelectedDevice gpu;
  gpu.type = DeviceType::kCuda;
  gpu.index = want_cuda ? request.cuda_index : 0;
  gpu.cuda_plugin_loaded = true;
  char name[256] = {0};
  if (plugin.api->device_name(gpu.index, name, sizeof(name)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cuda:", gpu.index, ": ", name));
  }
  gpu.name = absl::StrCat("cuda:", gpu.index, " (", name, ")");
  return gpu;
}

}  // namespace diond::kernels
