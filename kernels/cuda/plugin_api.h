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
#define DIOND_CUDA_PLUGIN_ABI_MINOR 1
#define DIOND_CUDA_PLUGIN_ENTRY "diond_cuda_plugin_v1"

// ---- NCCL communicators (ABI minor >= 1) ------------------------------------------------------
// Every function returns 0 on success, or -1 with a message in `err` (which may be NULL).
// Collectives are synchronous: they run on the communicator's own stream and return when it is
// done, or abort the communicator and fail after `timeout_ms` (a lost peer must never hang the
// daemon). Buffers are device pointers of the communicator's device.
#define DIOND_NCCL_UNIQUE_ID_BYTES 128
enum { DIOND_NCCL_F32 = 0, DIOND_NCCL_U8 = 1 };
enum { DIOND_NCCL_SUM = 0, DIOND_NCCL_AVG = 1 };

typedef struct DiondNcclApiV1 {
  uint32_t version;  // 1
  // Writes DIOND_NCCL_UNIQUE_ID_BYTES bytes; rank 0 makes it and shares it through the store.
  int (*get_unique_id)(uint8_t* id, char* err, size_t err_len);
  // Creates a communicator on `device`; blocks until all `nranks` ranks arrive or timeout_ms.
  int (*comm_create)(const uint8_t* id, int nranks, int rank, int device, int64_t timeout_ms,
                     void** comm, char* err, size_t err_len);
  // Aborts (does not wait for peers) and frees; safe after a failure.
  void (*comm_destroy)(void* comm);
  int (*all_reduce)(void* comm, const void* send, void* recv, size_t count, int dtype, int op,
                    int64_t timeout_ms, char* err, size_t err_len);
  // send holds nranks * recv_count elements.
  int (*reduce_scatter)(void* comm, const void* send, void* recv, size_t recv_count, int dtype,
                        int op, int64_t timeout_ms, char* err, size_t err_len);
  // recv holds nranks * send_count elements.
  int (*all_gather)(void* comm, const void* send, void* recv, size_t send_count, int dtype,
                    int64_t timeout_ms, char* err, size_t err_len);
  // send and recv hold nranks blocks of block_count elements (grouped send/recv).
  int (*all_to_all)(void* comm, const void* send, void* recv, size_t block_count, int dtype,
                    int64_t timeout_ms, char* err, size_t err_len);
  int (*broadcast)(void* comm, const void* send, void* recv, size_t count, int dtype, int root,
                   int64_t timeout_ms, char* err, size_t err_len);
  // Device memory helpers (staging and tests).
  int (*device_malloc)(int device, size_t bytes, void** ptr, char* err, size_t err_len);
  void (*device_free)(int device, void* ptr);
  int (*copy_to_device)(int device, void* dst, const void* src, size_t bytes, char* err,
                        size_t err_len);
  int (*copy_to_host)(int device, void* dst, const void* src, size_t bytes, char* err,
                      size_t err_len);
} DiondNcclApiV1;

typedef struct DiondCudaPluginV1 {
  uint32_t abi_major;
  uint32_t abi_minor;
  // Returns the number of usable GPUs (>= 0), or -1 with a message in `err` (e.g. no driver).
  int (*device_count)(char* err, size_t err_len);
  // Writes the device's name; returns 0 on success, -1 with the message in `out` on failure.
  int (*device_name)(int index, char* out, size_t out_len);
  // Writes "cudart=X driver=Y cublas=Z nccl=W"; never fails.
  void (*versions)(char* out, size_t out_len);
  // ABI minor >= 1: NCCL communicators. Check abi_minor before reading.
  const DiondNcclApiV1* nccl;
} DiondCudaPluginV1;

typedef const DiondCudaPluginV1* (*DiondCudaPluginEntryFn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DIOND_KERNELS_CUDA_PLUGIN_API_H_
