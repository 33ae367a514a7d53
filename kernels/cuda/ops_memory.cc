// The CUDA backend's device memory, streams, handles and error reporting (ops_common.cuh).
//
// Memory: the device's default stream-ordered pool (cudaMallocAsync), with the release
// threshold raised so that freed blocks stay cached for the next step. Allocations and frees of
// Context::Allocate / Buffer come without a stream (kernels/backend.h), so they are ordered on
// the legacy default stream; session streams are created blocking (cudaStreamDefault), which
// orders them against it. Scratch inside an op is allocated and freed on the op's stream.
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdint>

#include "kernels/cuda/ops_internal.h"
#include "kernels/cuda/runtime.h"

namespace diond::cuda {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<uint64_t> g_in_use[kMaxDevices];
std::atomic<uint64_t> g_peak[kMaxDevices];
std::atomic<bool> g_pool_ready[kMaxDevices];

int Slot(int device) { return device >= 0 && device < kMaxDevices ? device : 0; }

struct Handles {
  int device = -1;
  cublasHandle_t blas = nullptr;
  cusolverDnHandle_t solver = nullptr;
};
thread_local Handles t_handles[8];

Handles* HandlesFor(int device) {
  for (Handles& h : t_handles) {
    if (h.device == device) return &h;
  }
  for (Handles& h : t_handles) {
    if (h.device < 0) {
      h.device = device;
      return &h;
    }
  }
  return nullptr;
}

void PreparePool(int device) {
  if (g_pool_ready[Slot(device)].exchange(true)) return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t threshold = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  }
}

}  // namespace

int Fail(const DiondOpsCall* call, int code, const char* fmt, ...) {
  if (call != nullptr && call->err != nullptr && call->err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(call->err, call->err_len, fmt, ap);
    va_end(ap);
  }
  return code;
}

int UseDevice(const DiondOpsCall* call, const char* op) {
  DIOND_CU(op, cudaSetDevice(call->device));
  return DIOND_OPS_OK;
}

int Blas(const DiondOpsCall* call, const char* op, cublasHandle_t* out) {
  Handles* h = HandlesFor(call->device);
  if (h == nullptr) return Fail(call, DIOND_OPS_INTERNAL, "%s: too many devices", op);
  if (h->blas == nullptr) {
    DIOND_CUBLAS(op, cublasCreate(&h->blas));
    DIOND_CUBLAS(op, cublasSetMathMode(h->blas, CUBLAS_DEFAULT_MATH));
  }
  DIOND_CUBLAS(op, cublasSetStream(h->blas, StreamOf(call)));
  *out = h->blas;
  return DIOND_OPS_OK;
}

int Solver(const DiondOpsCall* call, const char* op, cusolverDnHandle_t* out) {
  Handles* h = HandlesFor(call->device);
  if (h == nullptr) return Fail(call, DIOND_OPS_INTERNAL, "%s: too many devices", op);
  if (h->solver == nullptr) DIOND_CUSOLVER(op, cusolverDnCreate(&h->solver));
  DIOND_CUSOLVER(op, cusolverDnSetStream(h->solver, StreamOf(call)));
  *out = h->solver;
  return DIOND_OPS_OK;
}

void CountAllocation(int device, size_t bytes) {
  const uint64_t now = g_in_use[Slot(device)].fetch_add(bytes) + bytes;
  uint64_t peak = g_peak[Slot(device)].load();
  while (now > peak && !g_peak[Slot(device)].compare_exchange_weak(peak, now)) {
  }
}
void CountFree(int device, size_t bytes) { g_in_use[Slot(device)].fetch_sub(bytes); }

int CheckLaunch(const DiondOpsCall* call, const char* op) {
  DIOND_CU(op, cudaGetLastError());
  return DIOND_OPS_OK;
}

int Scratch::Allocate(const DiondOpsCall* call, const char* op, size_t bytes) {
  if (bytes == 0) bytes = 1;
  PreparePool(call->device);
  const cudaError_t e = cudaMallocAsync(&p_, bytes, StreamOf(call));
  if (e != cudaSuccess) {
    p_ = nullptr;
    return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED, "%s: %zu bytes of scratch: %s", op, bytes,
                cudaGetErrorString(e));
  }
  bytes_ = bytes;
  device_ = call->device;
  stream_ = StreamOf(call);
  CountAllocation(device_, bytes_);
  return DIOND_OPS_OK;
}
Scratch::~Scratch() {
  if (p_ != nullptr) {
    cudaFreeAsync(p_, stream_);
    CountFree(device_, bytes_);
  }
}

// ---- the memory entries of DiondOpsApiV1 ----

int OpAllocate(const DiondOpsCall* call, size_t bytes, void** ptr) {
  DIOND_RC(UseDevice(call, "allocate"));
  PreparePool(call->device);
  const cudaError_t e = cudaMallocAsync(ptr, bytes, nullptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED,
                "cuda:%d: cannot allocate %zu bytes (%s); pool in use %llu bytes, device free "
                "%zu of %zu bytes",
                call->device, bytes, cudaGetErrorString(e),
                static_cast<unsigned long long>(g_in_use[Slot(call->device)].load()), free_b,
                total_b);
  }
  CountAllocation(call->device, bytes);
  return DIOND_OPS_OK;
}

void OpDeallocate(int device, void* stream, void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
  CountFree(device, bytes);
}

int OpCopyFromHost(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_RC(UseDevice(call, "copy_from_host"));
  DIOND_CU("copy_from_host",
           cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, StreamOf(call)));
  return Sync(call, "copy_from_host");
}

int OpCopyToHost(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_RC(UseDevice(call, "copy_to_host"));
  DIOND_CU("copy_to_host",
           cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, StreamOf(call)));
  return Sync(call, "copy_to_host");
}

// asynccopy: the same copies, only queued (no wait). From pinned (host_register'ed) memory the
// DMA overlaps the stream's kernels; from pageable memory the runtime stages it.
int OpCopyFromHostAsync(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_RC(UseDevice(call, "copy_from_host_async"));
  DIOND_CU("copy_from_host_async",
           cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, StreamOf(call)));
  return DIOND_OPS_OK;
}

int OpCopyToHostAsync(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_RC(UseDevice(call, "copy_to_host_async"));
  DIOND_CU("copy_to_host_async",
           cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, StreamOf(call)));
  return DIOND_OPS_OK;
}

int OpStreamCreate(const DiondOpsCall* call, void** stream) {
  DIOND_RC(UseDevice(call, "stream_create"));
  cudaStream_t s = nullptr;
  DIOND_CU("stream_create", cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  *stream = s;
  return DIOND_OPS_OK;
}

void OpStreamDestroy(int device, void* stream) {
  if (stream == nullptr) return;
  cudaSetDevice(device);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

int OpStreamSynchronize(const DiondOpsCall* call) {
  DIOND_RC(UseDevice(call, "stream_synchronize"));
  return Sync(call, "stream_synchronize");
}

int OpMemoryStats(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak) {
  *in_use = g_in_use[Slot(call->device)].load();
  *peak = g_peak[Slot(call->device)].load();
  return DIOND_OPS_OK;
}

// ---- devsession: host registration of the trainer's shm / memfd mappings ----
int OpHostRegister(const DiondOpsCall* call, void* ptr, size_t bytes) {
  DIOND_RC(UseDevice(call, "host_register"));
  DIOND_CU("host_register", cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
  return DIOND_OPS_OK;
}

int OpHostUnregister(const DiondOpsCall* call, void* ptr) {
  DIOND_RC(UseDevice(call, "host_unregister"));
  DIOND_CU("host_unregister", cudaHostUnregister(ptr));
  return DIOND_OPS_OK;
}

// ---- devsession: stream capture (CUDA graphs) ----
int OpGraphBeginCapture(const DiondOpsCall* call) {
  DIOND_RC(UseDevice(call, "graph_begin_capture"));
  DIOND_CU("graph_begin_capture",
           cudaStreamBeginCapture(StreamOf(call), cudaStreamCaptureModeThreadLocal));
  return DIOND_OPS_OK;
}

int OpGraphEndCapture(const DiondOpsCall* call, void** graph) {
  DIOND_RC(UseDevice(call, "graph_end_capture"));
  cudaGraph_t g = nullptr;
  DIOND_CU("graph_end_capture", cudaStreamEndCapture(StreamOf(call), &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  DIOND_CU("graph_end_capture", e);
  *graph = exec;
  return DIOND_OPS_OK;
}

int OpGraphLaunch(const DiondOpsCall* call, void* graph) {
  DIOND_RC(UseDevice(call, "graph_launch"));
  DIOND_CU("graph_launch", cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), StreamOf(call)));
  return DIOND_OPS_OK;
}

void OpGraphDestroy(int device, void* graph) {
  if (graph == nullptr) return;
  cudaSetDevice(device);
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

}  // namespace diond::cuda
