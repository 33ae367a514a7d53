// The CUDA backend's device memory, streams, handles and error reporting (runtime.h). Host code
// only: CI compiles this same file against the TEST backend's strict host CUDA runtime
// (kernels/testing/fake_cuda) and runs it there (cuda_runtime_rules_test). docs/GPU.md "Streams,
// errors and memory" is the model:
// - session streams are non-blocking (cudaStreamNonBlocking): nothing here uses the legacy
//   default stream, which would wait on every blocking stream and is illegal while one captures;
// - unstreamed allocations (allocate with a null call->stream: Context::Allocate, Buffer) come
//   from the device's pool on a private non-blocking allocation stream, waited for at once (it
//   holds nothing else), so the memory is ready for any stream; their frees go on a private
//   free stream made to wait first (events) on every session stream and the legacy stream,
//   never stalling them; scratch is allocated and freed on the op's own stream;
// - the pool caches freed blocks up to an eighth of the device (the release threshold, given
//   back at the next synchronize above it), is trimmed when a session stream is destroyed (a
//   session closed), and graph memory (scratch captured into a graph) is counted in the stats.
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>

#include "kernels/cuda/ops_internal.h"
#include "kernels/cuda/runtime.h"

namespace diond::cuda {
namespace {

constexpr int kMaxDevices = 64;
// cuBLAS's recommended workspace for Hopper (the largest of its recommendations).
constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

std::atomic<uint64_t> g_in_use[kMaxDevices];
std::atomic<uint64_t> g_peak[kMaxDevices];
std::atomic<int> g_lost[kMaxDevices];  // the sticky cudaError_t that lost the context, or 0

int Slot(int device) { return device >= 0 && device < kMaxDevices ? device : 0; }

struct Handles {
  int device = -1;
  cublasHandle_t blas = nullptr;
  cusolverDnHandle_t solver = nullptr;
};
thread_local Handles t_handles[8];  // the null stream's, per thread

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

// One session stream: its handles and workspace, and the event the free stream waits on.
struct SessionStream {
  Handles handles;
  void* workspace = nullptr;
  cudaEvent_t last = nullptr;  // recorded before a capture begins, or at a free
  bool capturing = false;
};

// Per device: the pool, the two private streams, the session streams. `mu` orders a free's
// event records against a capture's begin and end on another thread.
struct DeviceState {
  std::once_flag once;
  int ready = 0;  // cudaSuccess once prepared
  cudaMemPool_t pool = nullptr;
  cudaStream_t alloc_stream = nullptr, free_stream = nullptr;
  cudaEvent_t legacy_done = nullptr;
  std::mutex mu;
  std::map<cudaStream_t, SessionStream> streams;
};
DeviceState g_devices[kMaxDevices];

bool Sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}
bool CaptureError(cudaError_t e) {
  switch (e) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureWrongThread:
      return true;
    default:
      return false;
  }
}
// Reads and clears the thread's pending error (e's, or a later one); records a sticky one.
void Consume(int device, cudaError_t e) {
  const cudaError_t pending = cudaGetLastError();
  for (cudaError_t x : {e, pending}) {
    if (Sticky(x)) {
      int none = 0;
      g_lost[Slot(device)].compare_exchange_strong(none, static_cast<int>(x));
    }
  }
}
int CurrentDevice(const DiondOpsCall* call) { return call != nullptr ? call->device : 0; }

int LostFail(const DiondOpsCall* call, int device) {
  return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
              "cuda:%d: the CUDA context is lost (%s, an unrecoverable error); no device work "
              "can run until the daemon restarts",
              device, cudaGetErrorString(static_cast<cudaError_t>(g_lost[Slot(device)].load())));
}

// The pool's release threshold, the private streams (once per device). cudaSuccess or why not.
int Prepare(int device) {
  DeviceState& d = g_devices[Slot(device)];
  std::call_once(d.once, [&] {
    cudaError_t e = cudaDeviceGetDefaultMemPool(&d.pool, device);
    size_t free_b = 0, total_b = 0;
    if (e == cudaSuccess) e = cudaMemGetInfo(&free_b, &total_b);
    uint64_t threshold = total_b / 8;
    if (e == cudaSuccess) {
      e = cudaMemPoolSetAttribute(d.pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&d.alloc_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&d.free_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d.legacy_done, cudaEventDisableTiming);
    if (e != cudaSuccess) Consume(device, e);
    d.ready = static_cast<int>(e);
  });
  return d.ready;
}
int PrepareOrFail(const DiondOpsCall* call, const char* op) {
  const int e = Prepare(call->device);
  if (e == cudaSuccess) return DIOND_OPS_OK;
  return Fail(call, DIOND_OPS_INTERNAL, "%s: cuda:%d: the memory pool cannot be set up: %s", op,
              call->device, cudaGetErrorString(static_cast<cudaError_t>(e)));
}

// The free stream waits for what is queued now on every session stream and the legacy stream
// (a capturing stream: for what was queued before its capture began). Holds d.mu.
void OrderFreeStream(int device, DeviceState& d) {
  for (auto& [stream, s] : d.streams) {
    if (!s.capturing) Drop(device, cudaEventRecord(s.last, stream));
    Drop(device, cudaStreamWaitEvent(d.free_stream, s.last, 0));
  }
  // The legacy stream is used only by contexts without a stream (tests); our streams are
  // non-blocking, so recording on it never waits on them and is legal during their captures.
  Drop(device, cudaEventRecord(d.legacy_done, nullptr));
  Drop(device, cudaStreamWaitEvent(d.free_stream, d.legacy_done, 0));
}

void FreeUnstreamed(int device, void* ptr) {
  DeviceState& d = g_devices[Slot(device)];
  if (Prepare(device) != cudaSuccess) return;
  std::lock_guard<std::mutex> lock(d.mu);
  OrderFreeStream(device, d);
  Drop(device, cudaFreeAsync(ptr, d.free_stream));
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

int Failed(const DiondOpsCall* call, const char* op, const char* what, cudaError_t e) {
  const int device = CurrentDevice(call);
  Consume(device, e);
  if (DeviceLost(device)) return LostFail(call, device);
  const int code = e == cudaErrorMemoryAllocation ? DIOND_OPS_RESOURCE_EXHAUSTED
                   : CaptureError(e)              ? DIOND_OPS_FAILED_PRECONDITION
                                                  : DIOND_OPS_INTERNAL;
  return Fail(call, code, "%s: %s failed: %s%s", op, what, cudaGetErrorString(e),
              CaptureError(e) ? " (a stream capture conflict)" : "");
}

void Drop(int device, cudaError_t e) {
  if (e != cudaSuccess) Consume(device, e);
}

bool DeviceLost(int device) { return g_lost[Slot(device)].load() != 0; }

int UseDevice(const DiondOpsCall* call, const char* op) {
  // An error left pending by code outside these entries (NCCL's, a library's) is read here, so
  // that it cannot fail this entry's launch check; a sticky one is recorded.
  Consume(call->device, cudaSuccess);
  if (DeviceLost(call->device)) return LostFail(call, call->device);
  DIOND_CU(op, cudaSetDevice(call->device));
  return DIOND_OPS_OK;
}

// The handles of the session stream a call names (each stream has its own, with its own cuBLAS
// workspace): copied out under the device's lock.
int StreamHandles(const DiondOpsCall* call, const char* op, Handles* out) {
  DeviceState& d = g_devices[Slot(call->device)];
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.streams.find(StreamOf(call));
  if (it == d.streams.end()) {
    return Fail(call, DIOND_OPS_INTERNAL, "%s: a stream that stream_create did not make", op);
  }
  *out = it->second.handles;
  return DIOND_OPS_OK;
}

int Blas(const DiondOpsCall* call, const char* op, cublasHandle_t* out) {
  if (call->stream != nullptr) {
    Handles handles;
    const int rc = StreamHandles(call, op, &handles);
    if (rc == DIOND_OPS_OK) *out = handles.blas;
    return rc;
  }
  Handles* h = HandlesFor(call->device);
  if (h == nullptr) return Fail(call, DIOND_OPS_INTERNAL, "%s: too many devices", op);
  if (h->blas == nullptr) {
    DIOND_CUBLAS(op, cublasCreate(&h->blas));
    DIOND_CUBLAS(op, cublasSetMathMode(h->blas, CUBLAS_DEFAULT_MATH));
  }
  DIOND_CUBLAS(op, cublasSetStream(h->blas, nullptr));
  *out = h->blas;
  return DIOND_OPS_OK;
}

int Solver(const DiondOpsCall* call, const char* op, cusolverDnHandle_t* out) {
  if (call->stream != nullptr) {
    Handles handles;
    const int rc = StreamHandles(call, op, &handles);
    if (rc == DIOND_OPS_OK) *out = handles.solver;
    return rc;
  }
  Handles* h = HandlesFor(call->device);
  if (h == nullptr) return Fail(call, DIOND_OPS_INTERNAL, "%s: too many devices", op);
  if (h->solver == nullptr) DIOND_CUSOLVER(op, cusolverDnCreate(&h->solver));
  DIOND_CUSOLVER(op, cusolverDnSetStream(h->solver, nullptr));
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
  DIOND_RC(PrepareOrFail(call, op));
  const cudaError_t e = cudaMallocAsync(&p_, bytes, StreamOf(call));
  if (e != cudaSuccess) {
    p_ = nullptr;
    Consume(call->device, e);
    if (DeviceLost(call->device)) return LostFail(call, call->device);
    return Fail(call,
                CaptureError(e) ? DIOND_OPS_FAILED_PRECONDITION : DIOND_OPS_RESOURCE_EXHAUSTED,
                "%s: %zu bytes of scratch: %s", op, bytes, cudaGetErrorString(e));
  }
  bytes_ = bytes;
  device_ = call->device;
  stream_ = StreamOf(call);
  CountAllocation(device_, bytes_);
  return DIOND_OPS_OK;
}
Scratch::~Scratch() {
  if (p_ != nullptr) {
    Drop(device_, cudaFreeAsync(p_, stream_));
    CountFree(device_, bytes_);
  }
}

// ---- the memory entries of DiondOpsApiV1 ----

int OpAllocate(const DiondOpsCall* call, size_t bytes, void** ptr) {
  DIOND_RC(UseDevice(call, "allocate"));
  DIOND_RC(PrepareOrFail(call, "allocate"));
  DeviceState& d = g_devices[Slot(call->device)];
  cudaStream_t on = call->stream != nullptr ? StreamOf(call) : d.alloc_stream;
  // Relaxed: this thread may be capturing its own stream (an arena block inside a captured
  // phase); the allocation and the wait below are on a stream outside any capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e == cudaSuccess) {
    e = cudaMallocAsync(ptr, bytes, on);
    // The allocation stream holds nothing else: waiting for it is waiting for this allocation.
    if (e == cudaSuccess && on == d.alloc_stream) e = cudaStreamSynchronize(on);
    const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
    if (e == cudaSuccess) e = restored;
  }
  if (e != cudaSuccess) {
    Consume(call->device, e);
    if (DeviceLost(call->device)) return LostFail(call, call->device);
    if (CaptureError(e)) {
      return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                  "cuda:%d: cannot allocate %zu bytes: %s (a stream capture conflict)",
                  call->device, bytes, cudaGetErrorString(e));
    }
    size_t free_b = 0, total_b = 0;
    Drop(call->device, cudaMemGetInfo(&free_b, &total_b));
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
  Drop(device, cudaSetDevice(device));
  if (stream != nullptr) {
    Drop(device, cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)));
  } else {
    FreeUnstreamed(device, ptr);
  }
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

// A session stream: non-blocking, with its own cuBLAS / cuSOLVER handles bound to it once, its
// own cuBLAS workspace (cublasSetStream resets the workspace, so it is set after), and the event
// that orders unstreamed frees after it.
int OpStreamCreate(const DiondOpsCall* call, void** stream) {
  DIOND_RC(UseDevice(call, "stream_create"));
  DIOND_RC(PrepareOrFail(call, "stream_create"));
  DeviceState& d = g_devices[Slot(call->device)];
  cudaStream_t s = nullptr;
  DIOND_CU("stream_create", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  SessionStream ss;
  ss.handles.device = call->device;
  auto undo = [&](int rc) {
    if (ss.handles.blas != nullptr) cublasDestroy(ss.handles.blas);
    if (ss.handles.solver != nullptr) cusolverDnDestroy(ss.handles.solver);
    if (ss.workspace != nullptr) Drop(call->device, cudaFreeAsync(ss.workspace, s));
    if (ss.last != nullptr) Drop(call->device, cudaEventDestroy(ss.last));
    Drop(call->device, cudaStreamDestroy(s));
    return rc;
  };
  const char* kOp = "stream_create";
  int rc = DIOND_OPS_OK;
  auto step = [&](cudaError_t e, const char* what) {
    if (rc == DIOND_OPS_OK && e != cudaSuccess) rc = Failed(call, kOp, what, e);
  };
  auto blas = [&](cublasStatus_t st, const char* what) {
    if (rc == DIOND_OPS_OK && st != CUBLAS_STATUS_SUCCESS) {
      rc =
          Fail(call, DIOND_OPS_INTERNAL, "%s: %s failed: %s", kOp, what, cublasGetStatusString(st));
    }
  };
  step(cudaEventCreateWithFlags(&ss.last, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  if (rc == DIOND_OPS_OK)
    step(cudaMallocAsync(&ss.workspace, kBlasWorkspaceBytes, s),
         "cudaMallocAsync(cuBLAS workspace)");
  if (rc == DIOND_OPS_OK) blas(cublasCreate(&ss.handles.blas), "cublasCreate");
  if (rc == DIOND_OPS_OK)
    blas(cublasSetMathMode(ss.handles.blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  if (rc == DIOND_OPS_OK) blas(cublasSetStream(ss.handles.blas, s), "cublasSetStream");
  if (rc == DIOND_OPS_OK) {
    blas(cublasSetWorkspace(ss.handles.blas, ss.workspace, kBlasWorkspaceBytes),
         "cublasSetWorkspace");
  }
  if (rc == DIOND_OPS_OK && cusolverDnCreate(&ss.handles.solver) != CUSOLVER_STATUS_SUCCESS) {
    rc = Fail(call, DIOND_OPS_INTERNAL, "%s: cusolverDnCreate failed", kOp);
  }
  if (rc == DIOND_OPS_OK && cusolverDnSetStream(ss.handles.solver, s) != CUSOLVER_STATUS_SUCCESS) {
    rc = Fail(call, DIOND_OPS_INTERNAL, "%s: cusolverDnSetStream failed", kOp);
  }
  if (rc != DIOND_OPS_OK) return undo(rc);
  CountAllocation(call->device, kBlasWorkspaceBytes);
  {
    std::lock_guard<std::mutex> lock(d.mu);
    d.streams.emplace(s, ss);
  }
  *stream = s;
  return DIOND_OPS_OK;
}

// The session closed: its handles, workspace and event go, then the stream; then the pool gives
// back what is free (cudaMemPoolTrimTo) and so does the graph memory cache
// (cudaDeviceGraphMemTrim: the session's graphs are destroyed by now).
void OpStreamDestroy(int device, void* stream) {
  if (stream == nullptr) return;
  Drop(device, cudaSetDevice(device));
  DeviceState& d = g_devices[Slot(device)];
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  SessionStream ss;
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.streams.find(s);
    if (it != d.streams.end()) {
      ss = it->second;
      d.streams.erase(it);
      ours = true;
    }
  }
  if (ours) {
    cublasDestroy(ss.handles.blas);
    cusolverDnDestroy(ss.handles.solver);
    Drop(device, cudaFreeAsync(ss.workspace, s));
    CountFree(device, kBlasWorkspaceBytes);
    Drop(device, cudaEventDestroy(ss.last));
  }
  Drop(device, cudaStreamDestroy(s));
  if (d.pool != nullptr) Drop(device, cudaMemPoolTrimTo(d.pool, 0));
  Drop(device, cudaDeviceGraphMemTrim(device));
}

int OpStreamSynchronize(const DiondOpsCall* call) {
  DIOND_RC(UseDevice(call, "stream_synchronize"));
  return Sync(call, "stream_synchronize");
}

// In use: the pool's allocations (ours, counted as they are made) plus the memory the device's
// graphs hold (scratch captured into them: cudaGraphMemAttrUsedMemCurrent).
int OpMemoryStats(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak) {
  if (DeviceLost(call->device)) return LostFail(call, call->device);
  uint64_t graph = 0;
  DIOND_CU("memory_stats",
           cudaDeviceGetGraphMemAttribute(call->device, cudaGraphMemAttrUsedMemCurrent, &graph));
  const uint64_t now = g_in_use[Slot(call->device)].load() + graph;
  uint64_t p = g_peak[Slot(call->device)].load();
  while (now > p && !g_peak[Slot(call->device)].compare_exchange_weak(p, now)) {
  }
  *in_use = now;
  *peak = now > p ? now : p;
  return DIOND_OPS_OK;
}

// The context's health: a sticky error that any entry has seen, or that a probe sees now. The
// probe queries the device's allocation stream, which holds nothing (never a wait) and is never
// captured; like every runtime call it returns the sticky error once the context is gone, even
// on a thread that has made no other call (the daemon asks from its RPC threads).
int OpDeviceHealth(const DiondOpsCall* call) {
  Consume(call->device, cudaSuccess);
  if (!DeviceLost(call->device) && Prepare(call->device) == cudaSuccess) {
    const cudaError_t e = cudaStreamQuery(g_devices[Slot(call->device)].alloc_stream);
    if (e != cudaSuccess && e != cudaErrorNotReady) Consume(call->device, e);
  }
  if (DeviceLost(call->device)) return LostFail(call, call->device);
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
// Under the device's lock, so that a free on another thread never records into the capture: the
// stream's event is recorded just before it begins (what the free stream waits on meanwhile).
int OpGraphBeginCapture(const DiondOpsCall* call) {
  DIOND_RC(UseDevice(call, "graph_begin_capture"));
  DeviceState& d = g_devices[Slot(call->device)];
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.streams.find(StreamOf(call));
  if (it == d.streams.end()) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "graph_begin_capture: only a stream of stream_create can be captured");
  }
  DIOND_CU("graph_begin_capture", cudaEventRecord(it->second.last, StreamOf(call)));
  DIOND_CU("graph_begin_capture",
           cudaStreamBeginCapture(StreamOf(call), cudaStreamCaptureModeThreadLocal));
  it->second.capturing = true;
  return DIOND_OPS_OK;
}

int OpGraphEndCapture(const DiondOpsCall* call, void** graph) {
  DIOND_RC(UseDevice(call, "graph_end_capture"));
  DeviceState& d = g_devices[Slot(call->device)];
  cudaGraph_t g = nullptr;
  cudaError_t e;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    e = cudaStreamEndCapture(StreamOf(call), &g);
    auto it = d.streams.find(StreamOf(call));
    if (it != d.streams.end()) it->second.capturing = false;
  }
  if (e != cudaSuccess) {
    if (g != nullptr) Drop(call->device, cudaGraphDestroy(g));
    return Failed(call, "graph_end_capture", "cudaStreamEndCapture", e);
  }
  cudaGraphExec_t exec = nullptr;
  e = cudaGraphInstantiate(&exec, g, 0);
  Drop(call->device, cudaGraphDestroy(g));
  if (e != cudaSuccess) return Failed(call, "graph_end_capture", "cudaGraphInstantiate", e);
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
  Drop(device, cudaSetDevice(device));
  Drop(device, cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
}

}  // namespace diond::cuda
