// The CUDA plugin's entry point: device probing, NCCL communicators and the ops backend behind
// the C ABI of plugin_api.h.
// Compiled only when DIOND_WITH_CUDA is ON; loaded by kernels/device.cc with dlopen.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>

#include "kernels/cuda/nccl_comm.h"
#include "kernels/cuda/ops_internal.h"
#include "kernels/cuda/plugin_api.h"

namespace {

void CopyOut(const char* text, char* out, size_t out_len) {
  if (out == nullptr || out_len == 0) return;
  std::snprintf(out, out_len, "%s", text);
}

int DeviceCount(char* err, size_t err_len) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    char buf[256];
    std::snprintf(buf, sizeof(buf), "cudaGetDeviceCount: error %d (%s: %s)", static_cast<int>(e),
                  cudaGetErrorName(e), cudaGetErrorString(e));
    CopyOut(buf, err, err_len);
    return -1;
  }
  return n;
}

int DeviceName(int index, char* out, size_t out_len) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, index);
  if (e != cudaSuccess) {
    CopyOut(cudaGetErrorString(e), out, out_len);
    return -1;
  }
  CopyOut(prop.name, out, out_len);
  return 0;
}

void Versions(char* out, size_t out_len) {
  int rt = 0, drv = 0, nccl = 0, cublas = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  ncclGetVersion(&nccl);
  cublasGetProperty(MAJOR_VERSION, &cublas);
  int cusolver = 0;
  cusolverGetProperty(MAJOR_VERSION, &cusolver);
  char buf[160];
  std::snprintf(buf, sizeof(buf), "cudart=%d driver=%d cublas=%d cusolver=%d nccl=%d", rt, drv,
                cublas, cusolver, nccl);
  CopyOut(buf, out, out_len);
}

// Not constexpr: the NCCL table's address comes from another translation unit.
const DiondCudaPluginV1 kPlugin = {
    DIOND_CUDA_PLUGIN_ABI_MAJOR, DIOND_CUDA_PLUGIN_ABI_MINOR, &DeviceCount, &DeviceName, &Versions,
    diond::cuda::NcclApi(),      diond::cuda::OpsApi(),
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const DiondCudaPluginV1* diond_cuda_plugin_v2() {
  return &kPlugin;
}
