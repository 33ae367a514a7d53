// The C ABI between the daemon and the CUDA plugin (libdiond_cuda.so).
//
// This header has no CUDA includes: the daemon compiles against it on machines without the CUDA
// toolkit and reaches the plugin only through dlopen + dlsym("diond_cuda_plugin_v1"). The ABI is
// versioned (STYLE.md O3): a major bump breaks callers, a minor bump only appends members.
#ifndef DIOND_KERNELS_CUDA_PLUGIN_API_H_
#define DIOND_KERNELS_CUDA_PLUGIN_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DIOND_CUDA_PLUGIN_ABI_MAJOR 1
#define DIOND_CUDA_PLUGIN_ABI_MINOR 0
#define DIOND_CUDA_PLUGIN_ENTRY "diond_cuda_plugin_v1"

typedef struct DiondCudaPluginV1 {
  uint32_t abi_major;
  uint32_t abi_minor;
  // Returns the number of usable GPUs (>= 0), or -1 with a message in `err` (e.g. no driver).
  int (*device_count)(char* err, size_t err_len);
  // Writes the device's name; returns 0 on success, -1 with the message in `out` on failure.
  int (*device_name)(int index, char* out, size_t out_len);
  // Writes "cudart=X driver=Y cublas=Z nccl=W"; never fails.
  void (*versions)(char* out, size_t out_len);
} DiondCudaPluginV1;

typedef const DiondCudaPluginV1* (*DiondCudaPluginEntryFn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DIOND_KERNELS_CUDA_PLUGIN_API_H_
