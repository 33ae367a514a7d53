// TEST BACKEND: the host CUDA runtime of cuda_runtime_api.h (rules: fake_cuda_control.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "cublas_v2.h"
#include "cuda_runtime_api.h"
#include "cusolverDn.h"
#include "fake_cuda_control.h"

using Clock = std::map<const void*, uint64_t>;  // stream -> work items ordered before

struct FakeCudaStream {
  bool blocking = true;
  bool capturing = false;
  std::string invalid;  // why the capture is invalid ("" while valid)
  size_t graph_bytes = 0;
  std::set<void*> graph_ptrs;
  Clock clock;
  uint64_t Seq() const {
    auto it = clock.find(this);
    return it == clock.end() ? 0 : it->second;
  }
};
struct FakeCudaEvent {
  Clock clock;
  FakeCudaStream* captured_by = nullptr;
};
struct FakeCudaGraph {
  size_t bytes = 0;
};
struct FakeCudaGraphExec {
  size_t bytes = 0;
  bool launched = false;
};
struct FakeCudaMemPool {};
struct FakeCublas {
  const void* workspace = nullptr;
  cudaStream_t stream = nullptr;
};
struct FakeCusolver {};

namespace {

struct Allocation {
  size_t bytes = 0;
  std::map<FakeCudaStream*, uint64_t> uses;  // stream -> its work count at the last use
};

struct State {
  std::recursive_mutex mu;
  FakeCudaStream legacy;
  std::set<FakeCudaStream*> streams;
  std::map<void*, Allocation> allocations;
  std::map<const void*, std::set<cudaStream_t>> workspace_streams;
  std::map<std::string, cudaError_t> fail_next;
  std::set<void*> registered;
  FakeCudaMemPool pool;
  bool lost = false;
  uint64_t budget = 0, threshold = 0;
  diond::kernels::testing::fake_cuda::Stats stats;
};
State& St() {
  static auto* s = new State;
  return *s;
}
thread_local cudaError_t t_pending = cudaSuccess;

cudaError_t Ret(cudaError_t e) {
  if (e != cudaSuccess && t_pending == cudaSuccess) t_pending = e;
  return e;
}
// Every call starts here: a lost context fails it; so does a FailNext of its name.
bool Refused(const char* name, cudaError_t* e) {
  State& st = St();
  if (st.lost) {
    *e = Ret(cudaErrorIllegalAddress);
    return true;
  }
  auto it = st.fail_next.find(name);
  if (it == st.fail_next.end()) return false;
  *e = Ret(it->second);
  st.fail_next.erase(it);
  return true;
}
#define FAKE_ENTRY(name)                                \
  std::lock_guard<std::recursive_mutex> lock_(St().mu); \
  if (cudaError_t e_; Refused(name, &e_)) return e_

FakeCudaStream* S(cudaStream_t s) { return s == nullptr ? &St().legacy : s; }
void Merge(Clock& into, const Clock& from) {
  for (const auto& [k, v] : from) {
    if (into[k] < v) into[k] = v;
  }
}
void Invalidate(FakeCudaStream* s, const char* why) {
  if (s->invalid.empty()) {
    s->invalid = why;
    ++St().stats.captures_invalidated;
  }
}
// One work item queued on `s`: the legacy stream's implicit synchronization, capture.
cudaError_t Enqueue(FakeCudaStream* s) {
  State& st = St();
  if (s == &st.legacy) {
    bool conflict = false;
    for (FakeCudaStream* b : st.streams) {
      if (b->blocking && b->capturing) {
        Invalidate(b, "the legacy stream was used while a blocking stream was capturing");
        conflict = true;
      }
    }
    if (conflict) return cudaErrorStreamCaptureImplicit;
    for (FakeCudaStream* b : st.streams) {
      if (!b->blocking) continue;
      ++st.stats.legacy_barriers;
      Merge(s->clock, b->clock);
    }
  } else if (s->blocking && !s->capturing) {
    Merge(s->clock, st.legacy.clock);
  }
  if (!s->capturing) ++s->clock[s];
  if (s == &st.legacy) {
    for (FakeCudaStream* b : st.streams) {
      if (b->blocking && !b->capturing) Merge(b->clock, s->clock);
    }
  }
  return cudaSuccess;
}
void Release() {
  State& st = St();
  if (st.stats.pool_reserved > st.threshold) {
    st.stats.pool_reserved = std::max(st.stats.pool_used, st.threshold);
  }
}

}  // namespace

namespace diond::kernels::testing::fake_cuda {
Stats GetStats() {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  return St().stats;
}
void Reset(uint64_t budget_bytes) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  State& st = St();
  for (auto& [p, a] : st.allocations) std::free(p);
  st.allocations.clear();
  st.workspace_streams.clear();
  st.fail_next.clear();
  st.registered.clear();
  st.legacy = FakeCudaStream{};
  st.lost = false;
  st.budget = budget_bytes;
  const int64_t streams = st.stats.streams_live, handles = st.stats.blas_handles_live;
  st.stats = Stats{};
  st.stats.streams_live = streams;
  st.stats.blas_handles_live = handles;
  t_pending = cudaSuccess;
}
void FailNext(const char* name, cudaError_t e) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  St().fail_next[name] = e;
}
void LoseContext() {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  St().lost = true;
}
}  // namespace diond::kernels::testing::fake_cuda

extern "C" {

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory "
             "range is already mapped";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is "
             "capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error "
             "during capture";
    case cudaErrorStreamCaptureUnjoined:
      return "capture was not joined";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream "
             "depend on a capturing blocking stream";
    default:
      break;
  }
  return "unknown error";
}
cudaError_t cudaGetLastError(void) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  if (St().lost) return cudaErrorIllegalAddress;
  const cudaError_t e = t_pending;
  t_pending = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  return St().lost ? cudaErrorIllegalAddress : t_pending;
}
cudaError_t cudaSetDevice(int device) {
  FAKE_ENTRY("cudaSetDevice");
  return device == 0 ? cudaSuccess : Ret(cudaErrorInvalidValue);
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  FAKE_ENTRY("cudaMemGetInfo");
  const uint64_t total = St().budget ? St().budget : (uint64_t{1} << 40);
  *total_bytes = total;
  *free_bytes =
      total - std::min<uint64_t>(total, St().stats.pool_reserved + St().stats.graph_reserved);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream) {
  FAKE_ENTRY("cudaMallocAsync");
  State& st = St();
  FakeCudaStream* s = S(stream);
  if (const cudaError_t e = Enqueue(s); e != cudaSuccess) return Ret(e);
  if (st.budget != 0 && st.stats.pool_used + st.stats.graph_reserved + bytes > st.budget) {
    return Ret(cudaErrorMemoryAllocation);
  }
  *ptr = std::malloc(bytes == 0 ? 1 : bytes);
  if (s->capturing) {
    s->graph_bytes += bytes;
    s->graph_ptrs.insert(*ptr);
    return cudaSuccess;
  }
  st.allocations[*ptr].bytes = bytes;
  const uint64_t cached = st.stats.pool_reserved - st.stats.pool_used;
  if (bytes > cached) st.stats.pool_reserved += bytes - cached;
  st.stats.pool_used += bytes;
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  FAKE_ENTRY("cudaFreeAsync");
  State& st = St();
  FakeCudaStream* s = S(stream);
  if (s->capturing && s->graph_ptrs.erase(ptr) == 1) {
    std::free(ptr);  // a free node of the graph
    return cudaSuccess;
  }
  auto it = st.allocations.find(ptr);
  if (it == st.allocations.end()) {
    ++st.stats.failed_frees;
    return Ret(cudaErrorInvalidValue);
  }
  if (const cudaError_t e = Enqueue(s); e != cudaSuccess) {
    ++st.stats.failed_frees;
    return Ret(e);
  }
  for (const auto& [user, seq] : it->second.uses) {
    auto c = s->clock.find(user);
    if (c == s->clock.end() || c->second < seq) ++st.stats.unordered_frees;
  }
  st.stats.pool_used -= it->second.bytes;
  std::free(ptr);
  st.allocations.erase(it);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  FAKE_ENTRY("cudaDeviceGetDefaultMemPool");
  *pool = &St().pool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  FAKE_ENTRY("cudaMemPoolSetAttribute");
  if (attr != cudaMemPoolAttrReleaseThreshold) return Ret(cudaErrorInvalidValue);
  St().threshold = *static_cast<uint64_t*>(value);
  return cudaSuccess;
}
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  FAKE_ENTRY("cudaMemPoolGetAttribute");
  uint64_t* v = static_cast<uint64_t*>(value);
  switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
      *v = St().threshold;
      break;
    case cudaMemPoolAttrReservedMemCurrent:
      *v = St().stats.pool_reserved;
      break;
    case cudaMemPoolAttrUsedMemCurrent:
      *v = St().stats.pool_used;
      break;
    default:
      return Ret(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep) {
  FAKE_ENTRY("cudaMemPoolTrimTo");
  auto& s = St().stats;
  if (s.pool_reserved > keep) s.pool_reserved = std::max<uint64_t>(s.pool_used, keep);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetGraphMemAttribute(int device, cudaGraphMemAttributeType attr,
                                           void* value) {
  FAKE_ENTRY("cudaDeviceGetGraphMemAttribute");
  *static_cast<uint64_t*>(value) =
      attr == cudaGraphMemAttrUsedMemCurrent ? St().stats.graph_used : St().stats.graph_reserved;
  return cudaSuccess;
}
cudaError_t cudaDeviceGraphMemTrim(int device) {
  FAKE_ENTRY("cudaDeviceGraphMemTrim");
  St().stats.graph_reserved = St().stats.graph_used;
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  FAKE_ENTRY("cudaMemcpyAsync");
  FakeCudaStream* s = S(stream);
  if (const cudaError_t e = Enqueue(s); e != cudaSuccess) return Ret(e);
  std::memcpy(dst, src, bytes);
  for (const void* p : {static_cast<const void*>(dst), src}) {
    auto it = St().allocations.find(const_cast<void*>(p));
    if (it != St().allocations.end()) it->second.uses[s] = s->Seq();
  }
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int flags) {
  FAKE_ENTRY("cudaHostRegister");
  if (!St().registered.insert(ptr).second) return Ret(cudaErrorHostMemoryAlreadyRegistered);
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* ptr) {
  FAKE_ENTRY("cudaHostUnregister");
  return St().registered.erase(ptr) == 1 ? cudaSuccess : Ret(cudaErrorInvalidValue);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  FAKE_ENTRY("cudaStreamCreateWithFlags");
  FakeCudaStream* s = new FakeCudaStream;
  s->blocking = (flags & cudaStreamNonBlocking) == 0;
  St().streams.insert(s);
  ++St().stats.streams_live;
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  FAKE_ENTRY("cudaStreamDestroy");
  if (stream == nullptr || St().streams.erase(stream) == 0) {
    return Ret(cudaErrorInvalidResourceHandle);
  }
  --St().stats.streams_live;
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  FAKE_ENTRY("cudaStreamSynchronize");
  FakeCudaStream* s = S(stream);
  if (s->capturing) {
    Invalidate(s, "the capturing stream was synchronized");
    return Ret(cudaErrorStreamCaptureUnsupported);
  }
  Release();
  return cudaSuccess;
}
// Work completes as it is queued here: a stream is always idle (a capturing one cannot be asked).
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  FAKE_ENTRY("cudaStreamQuery");
  FakeCudaStream* s = S(stream);
  if (s->capturing) {
    Invalidate(s, "the capturing stream was queried");
    return Ret(cudaErrorStreamCaptureUnsupported);
  }
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  FAKE_ENTRY("cudaStreamIsCapturing");
  const FakeCudaStream* s = S(stream);
  *status = !s->capturing        ? cudaStreamCaptureStatusNone
            : s->invalid.empty() ? cudaStreamCaptureStatusActive
                                 : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  FAKE_ENTRY("cudaEventCreateWithFlags");
  *event = new FakeCudaEvent;
  ++St().stats.events_live;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  FAKE_ENTRY("cudaEventDestroy");
  if (event == nullptr) return Ret(cudaErrorInvalidResourceHandle);
  delete event;
  --St().stats.events_live;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  FAKE_ENTRY("cudaEventRecord");
  FakeCudaStream* s = S(stream);
  if (const cudaError_t e = Enqueue(s); e != cudaSuccess) return Ret(e);
  event->captured_by = s->capturing ? s : nullptr;
  event->clock = s->clock;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  FAKE_ENTRY("cudaStreamWaitEvent");
  FakeCudaStream* s = S(stream);
  if (const cudaError_t e = Enqueue(s); e != cudaSuccess) return Ret(e);
  if (event->captured_by != nullptr && event->captured_by != s && event->captured_by->capturing) {
    // s joins the capture and is never joined back: the capture cannot end.
    Invalidate(event->captured_by, "a stream outside the capture waited on a captured event");
    return cudaSuccess;
  }
  Merge(s->clock, event->clock);
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  FAKE_ENTRY("cudaThreadExchangeStreamCaptureMode");
  thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;
  const cudaStreamCaptureMode old = t_mode;
  t_mode = *mode;
  *mode = old;
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  FAKE_ENTRY("cudaStreamBeginCapture");
  FakeCudaStream* s = S(stream);
  if (s == &St().legacy || s->capturing) return Ret(cudaErrorStreamCaptureUnsupported);
  s->capturing = true;
  s->invalid.clear();
  s->graph_bytes = 0;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  FAKE_ENTRY("cudaStreamEndCapture");
  FakeCudaStream* s = S(stream);
  if (!s->capturing) return Ret(cudaErrorInvalidValue);
  s->capturing = false;
  for (void* p : s->graph_ptrs) std::free(p);  // allocated in the graph and not freed there
  s->graph_ptrs.clear();
  *graph = nullptr;
  if (!s->invalid.empty()) return Ret(cudaErrorStreamCaptureInvalidated);
  *graph = new FakeCudaGraph{s->graph_bytes};
  ++St().stats.graphs_live;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags) {
  FAKE_ENTRY("cudaGraphInstantiate");
  if (graph == nullptr) return Ret(cudaErrorInvalidValue);
  *exec = new FakeCudaGraphExec{graph->bytes, false};
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  FAKE_ENTRY("cudaGraphDestroy");
  if (graph == nullptr) return Ret(cudaErrorInvalidValue);
  delete graph;
  --St().stats.graphs_live;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  FAKE_ENTRY("cudaGraphLaunch");
  if (const cudaError_t e = Enqueue(S(stream)); e != cudaSuccess) return Ret(e);
  if (!exec->launched) {  // the graph's memory is mapped at its first launch
    exec->launched = true;
    St().stats.graph_used += exec->bytes;
    if (St().stats.graph_reserved < St().stats.graph_used) {
      St().stats.graph_reserved = St().stats.graph_used;
    }
  }
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  FAKE_ENTRY("cudaGraphExecDestroy");
  if (exec == nullptr) return Ret(cudaErrorInvalidValue);
  if (exec->launched) St().stats.graph_used -= exec->bytes;
  delete exec;
  return cudaSuccess;
}

// ---- cuBLAS / cuSOLVER handles ----
namespace {
void UseWorkspace(FakeCublas* h) {
  auto& streams = St().workspace_streams[h->workspace];
  if (streams.insert(h->stream).second && streams.size() > 1) ++St().stats.blas_shared_workspace;
}
}  // namespace
cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  if (St().lost) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new FakeCublas;
  (*handle)->workspace = *handle;
  ++St().stats.blas_handles_live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  St().workspace_streams.erase(handle);
  delete handle;
  --St().stats.blas_handles_live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  handle->stream = stream;
  handle->workspace = handle;  // documented: cublasSetStream restores the default workspace
  UseWorkspace(handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(St().mu);
  handle->workspace = workspace;
  UseWorkspace(handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
const char* cublasGetStatusString(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_FAILURE";
}
cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle) {
  *handle = new FakeCusolver;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle) {
  delete handle;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t, cudaStream_t) {
  return CUSOLVER_STATUS_SUCCESS;
}

}  // extern "C"
