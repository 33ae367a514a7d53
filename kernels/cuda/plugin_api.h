// The C ABI between the daemon and the CUDA plugin (libdiond_cuda.so).
//
// This header has no CUDA includes: the daemon compiles against it on machines without the CUDA
// toolkit and reaches the plugin only through dlopen + dlsym("diond_cuda_plugin_v2"). The ABI is
// versioned (STYLE.md O3): a major bump breaks callers, a minor bump only appends members.
// Major 2 (the ops table lost the TopK, Lerp and CautiousWeightDecay entries, so its members
// moved): every member below exists in 2.0, except DiondNcclApiV1's version-2 members (2.1: the
// daemon uses them only when nccl->version >= 2); the entry symbol carries the major. The
// record type names keep their V1 suffix (their layout is versioned by abi_major,
// DiondOpsApiV1::version and DiondNcclApiV1::version).
#ifndef DIOND_KERNELS_CUDA_PLUGIN_API_H_
#define DIOND_KERNELS_CUDA_PLUGIN_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DIOND_CUDA_PLUGIN_ABI_MAJOR 2
#define DIOND_CUDA_PLUGIN_ABI_MINOR 1  // 1: stream-ordered NCCL collectives (DiondNcclApiV1 v2)
#define DIOND_CUDA_PLUGIN_ENTRY "diond_cuda_plugin_v2"

// ---- NCCL communicators ----------------------------------------------------------------------
// Every function returns 0 on success, or -1 with a message in `err` (which may be NULL).
// Buffers are device pointers of the communicator's device. Two forms of collectives:
// - version 1, synchronous: they run on the communicator's own stream and return when it is
//   done, or abort the communicator and fail after `timeout_ms` (a lost peer must never hang
//   the daemon);
// - version 2 (ABI 2.1), stream-ordered (`*_on`): queued on the caller's stream behind what is
//   queued there, returning once NCCL took them (no wait for the stream). `timeout_ms` bounds
//   only NCCL's enqueue (a non-blocking comm may set up its connections to the peers there, on
//   the first call): past it the communicator is aborted and the call fails. A peer that never
//   comes leaves the collective itself waiting on the device; the caller polls `async_error`
//   (the daemon does at every heartbeat) and aborts the communicator (`comm_destroy`), which
//   ends the waiting kernels. Calls on one communicator must not overlap (the daemon
//   serializes).
#define DIOND_NCCL_UNIQUE_ID_BYTES 128
enum { DIOND_NCCL_F32 = 0, DIOND_NCCL_U8 = 1 };
enum { DIOND_NCCL_SUM = 0, DIOND_NCCL_AVG = 1 };

typedef struct DiondNcclApiV1 {
  uint32_t version;  // 2 (ABI 2.1); 1 has none of the stream-ordered members
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
  // ---- version 2: stream-ordered collectives (see above); `stream` is a cudaStream_t of the
  // communicator's device ----
  int (*all_reduce_on)(void* comm, const void* send, void* recv, size_t count, int dtype, int op,
                       int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*reduce_scatter_on)(void* comm, const void* send, void* recv, size_t recv_count, int dtype,
                           int op, int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*all_gather_on)(void* comm, const void* send, void* recv, size_t send_count, int dtype,
                       int64_t timeout_ms, void* stream, char* err, size_t err_len);
  // All-gather of unequal blocks: `counts` (host memory, nranks entries) are the blocks'
  // elements; `send` holds counts[rank], `recv` their sum, rank j's block at the sum of
  // counts[0..j). One NCCL group of a broadcast per rank: no padding, no host copy.
  int (*all_gather_v_on)(void* comm, const void* send, void* recv, const int64_t* counts, int dtype,
                         int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*all_to_all_on)(void* comm, const void* send, void* recv, size_t block_count, int dtype,
                       int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*broadcast_on)(void* comm, const void* send, void* recv, size_t count, int dtype, int root,
                      int64_t timeout_ms, void* stream, char* err, size_t err_len);
  // 0 while the communicator is healthy (collectives in flight included); -1 with NCCL's
  // asynchronous error (ncclCommGetAsyncError) or "aborted". Never blocks.
  int (*async_error)(void* comm, char* err, size_t err_len);
} DiondNcclApiV1;

// ---- the ops backend ---------------------------------------------------------------------------
// The C form of the ops backend. Its members are expanded from kernels/ops.def, the one list of
// ops: the entries of the C++ OpsBackend table (kernels/backend.h) with plain C arguments, in
// the same order, and the device entries of a session; kernels/plugin/plugin_backend.h adapts
// this table to an OpsBackend. The host side has validated every argument (kernels/ops.h)
// before an entry runs: an entry reports only its own failures, as one of the codes below with
// a message in call->err.
//
// Adding an op (docs/GPU.md): append its row at the END of kernels/ops.def (never reorder) and
// bump DIOND_OPS_API_VERSION.
#define DIOND_OPS_API_VERSION \
  9  // 2: ortho ops; 3: kops ops, TopK/Lerp/CautiousWeightDecay gone;
     // 4: the session's ops (steps); 5: device UUIDs, IPC/VMM
     // imports and events (handoff), host registration and stream
     // capture (devsession); 6: stream-ordered copies and the
     // device-side finiteness flags (asynccopy); 7: Dion2's
     // deferred parameter write (decay_scatter_with_change);
     // 8: the fused steps with device-side scalars (*_dev);
     // 9: device_health
enum {
  DIOND_OPS_OK = 0,
  DIOND_OPS_INTERNAL = -1,             // a library/kernel failure (absl INTERNAL)
  DIOND_OPS_FAILED_PRECONDITION = -2,  // e.g. a rank-deficient factorization
  DIOND_OPS_RESOURCE_EXHAUSTED = -3,   // out of device memory
};
// Dtype codes: the values of kernels::DType (static_assert'ed by the adapter).
enum { DIOND_DT_F32 = 0, DIOND_DT_BF16 = 1, DIOND_DT_F16 = 2 };

// A tensor view: element strides, rank 0..3, device memory of call->device.
typedef struct DiondTensor {
  void* data;  // NULL with rank 0: "no tensor" (an optional output not requested)
  int32_t dtype;
  int32_t rank;
  int64_t dims[3];
  int64_t strides[3];
} DiondTensor;

// Per call: the device, the stream the work is queued on (NULL: the device's default stream),
// and where a failure's message goes.
typedef struct DiondOpsCall {
  int device;
  void* stream;
  char* err;
  size_t err_len;
} DiondOpsCall;

typedef struct DiondGemmArgs {
  int32_t trans_a;  // 0 or 1
  int32_t trans_b;
  float alpha;
  float beta;
} DiondGemmArgs;

// AdamW / Lion per-call scalars: the fields of kernels::math::AdamWScalars / LionScalars, formed
// on the host by math::MakeAdamWScalars / MakeLionScalars (kernels/elementwise_math.h).
typedef struct DiondAdamWScalars {
  float decay, lr_wd, one_minus_b1, one_minus_b2, beta2, step_size, sqrt_bc2, eps;
  int32_t cautious;
} DiondAdamWScalars;
typedef struct DiondLionScalars {
  float w1, w2, lr_wd, decay, lr;
  int32_t cautious;
} DiondLionScalars;

// ApplyUpdate's per-call scalars: the fields of kernels::math::ApplyUpdateScalars, formed on the
// host by math::MakeApplyUpdateScalars.
typedef struct DiondApplyUpdateScalars {
  float alpha, decay, lr_wd;
  int32_t cautious, round_bf16;
} DiondApplyUpdateScalars;

typedef const DiondTensor* DiondIn;
typedef const DiondTensor* DiondOut;  // the tensor's memory is written; the record is not

typedef struct DiondOpsApiV1 {
  uint32_t version;  // DIOND_OPS_API_VERSION of the plugin
  const char* name;  // "cuda", "host-test device (TEST BACKEND)"
// NOLINTBEGIN(bugprone-macro-parentheses): X-macro arguments are names, types and
// parameter lists, which parentheses would break.
#define DIOND_ENTRY(name, Name, ret, c_params) ret(*name) c_params;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) int(*name) c_params;
#define DIOND_OP_DEV(name, Name, host_op, c_params) int(*name) c_params;
#include "kernels/ops.def"
  // NOLINTEND(bugprone-macro-parentheses)
} DiondOpsApiV1;

// handoff: sizes of the records above.
#define DIOND_GPU_UUID_BYTES 16
#define DIOND_CUDA_IPC_HANDLE_BYTES 64

typedef struct DiondCudaPluginV1 {
  uint32_t abi_major;
  uint32_t abi_minor;
  // Returns the number of usable GPUs (>= 0), or -1 with a message in `err` (e.g. no driver).
  int (*device_count)(char* err, size_t err_len);
  // Writes the device's name; returns 0 on success, -1 with the message in `out` on failure.
  int (*device_name)(int index, char* out, size_t out_len);
  // Writes "cudart=X driver=Y cublas=Z nccl=W"; never fails.
  void (*versions)(char* out, size_t out_len);
  // NCCL communicators (never NULL in ABI major 2).
  const DiondNcclApiV1* nccl;
  // The ops backend (kernels/cuda/ops_*.cu; never NULL in ABI major 2).
  const DiondOpsApiV1* ops;
} DiondCudaPluginV1;

typedef const DiondCudaPluginV1* (*DiondCudaPluginEntryFn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DIOND_KERNELS_CUDA_PLUGIN_API_H_
