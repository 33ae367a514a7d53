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
  int (*all_gather_v_on)(void* comm, const void* send, void* recv, const int64_t* counts,
                         int dtype, int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*all_to_all_on)(void* comm, const void* send, void* recv, size_t block_count, int dtype,
                       int64_t timeout_ms, void* stream, char* err, size_t err_len);
  int (*broadcast_on)(void* comm, const void* send, void* recv, size_t count, int dtype,
                      int root, int64_t timeout_ms, void* stream, char* err, size_t err_len);
  // 0 while the communicator is healthy (collectives in flight included); -1 with NCCL's
  // asynchronous error (ncclCommGetAsyncError) or "aborted". Never blocks.
  int (*async_error)(void* comm, char* err, size_t err_len);
} DiondNcclApiV1;

// ---- the ops backend ---------------------------------------------------------------------------
// One entry per entry of the C++ OpsBackend table (kernels/backend.h), in the same order, with
// plain C arguments. kernels/plugin_backend.h adapts this table to an OpsBackend. The host side
// has validated every argument (kernels/ops.h) before an entry runs: an entry reports only its
// own failures, as one of the codes below with a message in call->err.
//
// Adding an op (docs/GPU.md): append its entry at the END of DiondOpsApiV1 (never reorder),
// bump DIOND_OPS_API_VERSION, and append the adapter's forwarding function.
#define DIOND_OPS_API_VERSION 9  // 2: ortho ops; 3: kops ops, TopK/Lerp/CautiousWeightDecay gone;
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
  const char* name;  // "cuda", "host-test (TEST BACKEND)"
  // ---- memory: a stream-ordered pool per device ----
  int (*allocate)(const DiondOpsCall* call, size_t bytes, void** ptr);
  void (*deallocate)(int device, void* stream, void* ptr, size_t bytes);
  // Host <-> device copies, synchronous for the caller (queued on the stream, then waited for).
  int (*copy_from_host)(const DiondOpsCall* call, const void* host, void* dst, size_t bytes);
  int (*copy_to_host)(const DiondOpsCall* call, const void* src, void* host, size_t bytes);
  // Streams (one per session), and waiting for one.
  int (*stream_create)(const DiondOpsCall* call, void** stream);
  void (*stream_destroy)(int device, void* stream);
  int (*stream_synchronize)(const DiondOpsCall* call);
  // Pool accounting of `device`: bytes handed out and not freed, and the high-water mark.
  int (*memory_stats)(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak);
  // ---- ops (kernels/ops.h; axis: 0 rows, 1 cols; norm: 0 L1, 1 L2, 2 sum of squares) ----
  int (*gemm)(const DiondOpsCall*, const DiondGemmArgs*, DiondIn a, DiondIn b, DiondOut c);
  int (*symmetric_product)(const DiondOpsCall*, int32_t aat, float alpha, DiondIn a, float beta,
                           DiondOut c);
  int (*symmetric_product_bf16)(const DiondOpsCall*, DiondIn a, int64_t block, DiondOut c);
  int (*thin_qr)(const DiondOpsCall*, DiondIn a, DiondOut q, DiondOut r);
  int (*cholesky_qr)(const DiondOpsCall*, DiondIn a, DiondOut q, DiondOut r);
  int (*randomized_cholesky_qr)(const DiondOpsCall*, DiondIn a, DiondIn sketch, DiondOut q);
  int (*frobenius_norm)(const DiondOpsCall*, DiondIn a, DiondOut out);
  int (*axis_norms)(const DiondOpsCall*, DiondIn a, int32_t axis, int32_t norm, DiondOut out);
  // Indices are host memory (k of them): a sync point.
  int (*top_k_by_l1_norm)(const DiondOpsCall*, DiondIn a, int32_t axis, int64_t k,
                          int64_t* indices, DiondOut scores_out);
  int (*is_all_zero)(const DiondOpsCall*, DiondIn a, int32_t* all_zero);  // a sync point
  // Indices are host memory (count of them).
  int (*gather)(const DiondOpsCall*, DiondIn a, int32_t axis, const int64_t* indices,
                int64_t count, DiondOut out);
  int (*scatter)(const DiondOpsCall*, DiondIn src, int32_t axis, const int64_t* indices,
                 int64_t count, float alpha, float beta, DiondOut dst);
  int (*copy)(const DiondOpsCall*, DiondIn src, DiondOut dst);
  int (*fill)(const DiondOpsCall*, float value, DiondOut dst);
  int (*axpby)(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondIn y, DiondOut out);
  int (*add_scalar)(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondOut out);
  int (*unary)(const DiondOpsCall*, int32_t op, DiondIn x, DiondOut out);   // math::kUnary*
  int (*binary)(const DiondOpsCall*, int32_t op, DiondIn x, DiondIn y, DiondOut out);
  int (*adamw_step)(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad, DiondOut x,
                    DiondOut m, DiondOut v);
  int (*lion_step)(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                   DiondOut m);
  // ---- ops API version 2: the orthogonalizers' ops (ops.h, ortho block) ----
  int (*add_to_diagonal)(const DiondOpsCall*, float value, DiondOut a);
  int (*bf16_rounded_axpby)(const DiondOpsCall*, float alpha, DiondIn x, float beta, DiondIn y,
                            DiondOut out);
  // ---- ops API version 3: kops's fused optimizer phases (ops.h, kops block) ----
  // update_sq: one f32 element on the device, Σ(x_after − x_before)² summed in double.
  int (*adamw_step_tracked)(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad,
                            DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq);
  int (*lion_step_tracked)(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                           DiondOut m, DiondOut update_sq);
  // m_in may be m itself (in place).
  int (*momentum_update)(const DiondOpsCall*, float mu, int32_t nesterov, DiondIn grad,
                         DiondIn m_in, DiondOut m, DiondOut u);
  // x_in may be x itself (in place).
  int (*apply_update)(const DiondOpsCall*, const DiondApplyUpdateScalars*, DiondIn update,
                      DiondIn x_in, DiondOut x);
  // o: rank 2 or 3 f32 contiguous, v: one f32 per row of every unit; both in place.
  int (*normalize_neurons)(const DiondOpsCall*, float w, DiondOut o, DiondOut v);
  int (*copy_with_change)(const DiondOpsCall*, DiondIn src, DiondOut dst, DiondOut update_sq);
  // ---- ops API version 4: the session's passes (ops.h "steps" block); each a sync point ----
  int (*all_finite)(const DiondOpsCall*, DiondIn x, int32_t* all_finite);
  int (*widen_scale_check_finite)(const DiondOpsCall*, DiondIn x, float scale, DiondOut out,
                                  int32_t* all_finite);
  int (*fnv1a_checksum)(const DiondOpsCall*, DiondIn x, uint64_t* checksum);
  // ---- handoff (issue 12; docs/DATA_PLANE.md): device identity, trainer memory imported
  // from another process, interprocess events (DIOND_OPS_API_VERSION 5). call->device is the daemon's
  // device index the entry acts on; call->stream the stream of the stream entries. ----
  // The UUIDs of every device the plugin can see, DIOND_GPU_UUID_BYTES each, in device-index
  // order (cudaGetDeviceProperties().uuid): writes min(capacity, devices) of them and sets
  // *count to the number of devices. The daemon maps a trainer's UUID to its own index with it.
  int (*device_uuids)(const DiondOpsCall*, uint8_t* uuids, int32_t capacity, int32_t* count);
  // A legacy CUDA IPC memory handle (cudaIpcMemHandle_t, DIOND_CUDA_IPC_HANDLE_BYTES) opened on
  // call->device (cudaIpcOpenMemHandle, lazy peer access): *ptr is the base of the exporter's
  // allocation, *bytes its size (cuMemGetAddressRange), against which the caller checks the
  // region's offset and size. FAILED_PRECONDITION for a handle that cannot be opened.
  int (*ipc_open_mem_handle)(const DiondOpsCall*, const uint8_t* handle, void** ptr,
                             uint64_t* bytes);
  int (*ipc_close_mem_handle)(const DiondOpsCall*, void* ptr);
  // A VMM allocation exported as a POSIX fd (cuMemExportToShareableHandle) mapped into this
  // process on call->device: cuMemImportFromShareableHandle, cuMemAddressReserve(bytes),
  // cuMemMap, cuMemSetAccess(read/write for call->device). `bytes` must be a non-zero multiple
  // of `granularity`, and `granularity` a multiple of the allocation's minimum granularity
  // (FAILED_PRECONDITION naming both otherwise). The fd stays the caller's (not closed).
  // *ptr: the mapping's base; *handle: what vmm_unmap releases.
  int (*vmm_import_fd)(const DiondOpsCall*, int32_t fd, uint64_t bytes, uint64_t granularity,
                       void** ptr, void** handle);
  // cuMemUnmap, cuMemAddressFree and cuMemRelease of what vmm_import_fd mapped.
  int (*vmm_unmap)(const DiondOpsCall*, void* ptr, uint64_t bytes, void* handle);
  // An interprocess event (cudaIpcEventHandle_t, DIOND_CUDA_IPC_HANDLE_BYTES) opened on
  // call->device; event_destroy frees it.
  int (*ipc_open_event)(const DiondOpsCall*, const uint8_t* handle, void** event);
  int (*event_destroy)(const DiondOpsCall*, void* event);
  // call->stream waits for the event's last record (cudaStreamWaitEvent; no host wait).
  int (*stream_wait_event)(const DiondOpsCall*, void* event);
  // Records the event on call->stream (cudaEventRecord).
  int (*event_record)(const DiondOpsCall*, void* event);
  // ---- devsession: host registration of trainer memory (shm / memfd mappings) for DMA ----
  // Pins [ptr, ptr + bytes) of host memory for asynchronous copies (CUDA: cudaHostRegister,
  // portable + mapped flags off); host_unregister undoes exactly one host_register of `ptr`.
  // Registration is process-wide (not per device): call->device only names the device whose
  // context makes the call. Never a sync point.
  int (*host_register)(const DiondOpsCall* call, void* ptr, size_t bytes);
  int (*host_unregister)(const DiondOpsCall* call, void* ptr);
  // Stream capture (CUDA graphs) of call->stream: begin, end (the instantiated executable graph
  // in *graph), replay on call->stream, destroy. A backend that cannot capture returns
  // DIOND_OPS_FAILED_PRECONDITION with a message containing "unsupported".
  int (*graph_begin_capture)(const DiondOpsCall* call);
  int (*graph_end_capture)(const DiondOpsCall* call, void** graph);
  int (*graph_launch)(const DiondOpsCall* call, void* graph);
  void (*graph_destroy)(int device, void* graph);
  // ---- end devsession ----
  // ---- asynccopy (ops.h "asynccopy" block): stream-ordered host <-> device copies and the
  // finiteness scans with a device-side flag. Not sync points: the copies are queued on
  // call->stream (cudaMemcpyAsync) after the work queued before them, and complete at the next
  // stream_synchronize (which kernels::Synchronize calls) or synchronous entry; until then the
  // host memory stays valid and the host neither writes `host` (H2D) nor reads it (D2H).
  // (DIOND_OPS_API_VERSION 6.) ----
  int (*copy_from_host_async)(const DiondOpsCall* call, const void* host, void* dst, size_t bytes);
  int (*copy_to_host_async)(const DiondOpsCall* call, const void* src, void* host, size_t bytes);
  // nonfinite: one f32 element on the device, set to 1 when an element of x (of out) is NaN or
  // ±Inf and left as it was otherwise.
  int (*all_finite_flag)(const DiondOpsCall*, DiondIn x, DiondOut nonfinite);
  int (*widen_scale_check_finite_flag)(const DiondOpsCall*, DiondIn x, float scale, DiondOut out,
                                       DiondOut nonfinite);
  // ---- end asynccopy ----
  // ---- ops API version 7: Dion2's deferred parameter write (ops.h DecayScatterWithChange):
  // x (rank 2 or 3, f32, in place), count = batch·k host indices, k per matrix; update_sq: one
  // f32 element on the device. ----
  int (*decay_scatter_with_change)(const DiondOpsCall*, float decay, DiondIn src, int32_t axis,
                                   const int64_t* indices, int64_t count, float alpha, DiondOut x,
                                   DiondOut update_sq);
  // ---- ops API version 8: device-side scalars (kernels/graph.h, a captured step replayed with
  // new hyperparameters). The same ops as adamw_step, lion_step, adamw_step_tracked,
  // lion_step_tracked and apply_update, but the scalars pointer is DEVICE memory, read by the
  // kernels when they run (not when the call is made): a graph captured with it picks up the
  // record the host uploaded before each launch. ----
  int (*adamw_step_dev)(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad, DiondOut x,
                        DiondOut m, DiondOut v);
  int (*lion_step_dev)(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad, DiondOut x,
                       DiondOut m);
  int (*adamw_step_tracked_dev)(const DiondOpsCall*, const DiondAdamWScalars*, DiondIn grad,
                                DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq);
  int (*lion_step_tracked_dev)(const DiondOpsCall*, const DiondLionScalars*, DiondIn grad,
                               DiondOut x, DiondOut m, DiondOut update_sq);
  int (*apply_update_dev)(const DiondOpsCall*, const DiondApplyUpdateScalars*, DiondIn update,
                          DiondIn x_in, DiondOut x);
  // ---- ops API version 9: the device's health. DIOND_OPS_OK while call->device's context is
  // usable; DIOND_OPS_FAILED_PRECONDITION with the reason once a sticky error (an illegal
  // address or another kernel fault, an uncorrectable ECC error) has lost it, after which every
  // entry fails the same way until the process ends. Never blocks and is not a sync point: the
  // daemon asks after every step and before every device step (docs/GPU.md "Errors"). ----
  int (*device_health)(const DiondOpsCall* call);
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
