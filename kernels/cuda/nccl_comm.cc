// NCCL communicators for the daemon world (ARCHITECTURE.md §6). Each communicator owns a
// non-blocking NCCL comm and a stream. The synchronous calls enqueue on that stream and poll for
// completion and for NCCL's asynchronous errors, so a lost peer turns into an error after
// timeout_ms (with the comm aborted) instead of a hang. The stream-ordered calls (`*On`) enqueue
// on the caller's stream and return; the caller polls AsyncError and aborts (CommDestroy).
#include "kernels/cuda/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

namespace diond::cuda {
namespace {

struct Comm {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  int nranks = 0;
};

int Fail(char* err, size_t len, const char* what, const char* detail) {
  if (err != nullptr && len > 0) std::snprintf(err, len, "%s: %s", what, detail);
  return -1;
}

// Reads (and so clears) the thread's pending runtime error, so that it cannot fail the next
// kernel launch of the ops on this thread (docs/GPU.md "Errors").
int CudaFail(char* err, size_t len, const char* what, cudaError_t e) {
  cudaGetLastError();
  return Fail(err, len, what, cudaGetErrorString(e));
}
// A comm that failed before it was handed out: aborted (never destroyed: a peer may never come),
// its stream destroyed, freed.
void AbortAndFree(Comm* c) {
  if (c->comm != nullptr) ncclCommAbort(c->comm);
  if (c->stream != nullptr && cudaStreamDestroy(c->stream) != cudaSuccess) cudaGetLastError();
  delete c;
}

int NcclFail(char* err, size_t len, const char* what, ncclResult_t r) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s (%s)", ncclGetErrorString(r), ncclGetLastError(nullptr));
  return Fail(err, len, what, buf);
}

ncclDataType_t DType(int dtype) { return dtype == DIOND_NCCL_U8 ? ncclUint8 : ncclFloat32; }
ncclRedOp_t Op(int op) { return op == DIOND_NCCL_AVG ? ncclAvg : ncclSum; }

using Clock = std::chrono::steady_clock;

// Waits until the comm has no operation in progress (non-blocking comms return ncclInProgress).
int WaitComm(Comm* c, Clock::time_point deadline, const char* what, char* err, size_t len) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->comm, &state);
    if (r != ncclSuccess) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      return NcclFail(err, len, what, r);
    }
    if (state == ncclSuccess) return 0;
    if (state != ncclInProgress) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      return NcclFail(err, len, what, state);
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      return Fail(err, len, what, "timed out (communicator aborted)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Runs `enqueue` on the comm's stream and waits for the stream, watching for async errors.
template <typename F>
int Run(void* handle, int64_t timeout_ms, const char* what, char* err, size_t len, F enqueue) {
  auto* c = static_cast<Comm*>(handle);
  if (c == nullptr || c->comm == nullptr) return Fail(err, len, what, "communicator is aborted");
  cudaError_t e = cudaSetDevice(c->device);
  if (e != cudaSuccess) return CudaFail(err, len, what, e);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  ncclResult_t r = enqueue(c);
  if (r != ncclSuccess && r != ncclInProgress) return NcclFail(err, len, what, r);
  if (WaitComm(c, deadline, what, err, len) != 0) return -1;
  while (true) {
    e = cudaStreamQuery(c->stream);
    if (e == cudaSuccess) return 0;
    if (e != cudaErrorNotReady) return CudaFail(err, len, what, e);
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(c->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      return NcclFail(err, len, what, state);
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      return Fail(err, len, what, "timed out waiting for peers (communicator aborted)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Queues `enqueue` on the caller's stream (stream-ordered form): returns once NCCL took the
// collective (a non-blocking comm may answer ncclInProgress until then, e.g. while it connects
// to its peers on the first call), without waiting for the stream. That wait is bounded by
// timeout_ms (the comm is aborted past it); the collective itself is not.
template <typename F>
int Queue(void* handle, int64_t timeout_ms, const char* what, char* err, size_t len, F enqueue) {
  auto* c = static_cast<Comm*>(handle);
  if (c == nullptr || c->comm == nullptr) return Fail(err, len, what, "communicator is aborted");
  cudaError_t e = cudaSetDevice(c->device);
  if (e != cudaSuccess) return CudaFail(err, len, what, e);
  ncclResult_t r = enqueue(c);
  if (r != ncclSuccess && r != ncclInProgress) return NcclFail(err, len, what, r);
  return WaitComm(c, Clock::now() + std::chrono::milliseconds(timeout_ms), what, err, len);
}

int GetUniqueId(uint8_t* id, char* err, size_t len) {
  static_assert(sizeof(ncclUniqueId) == DIOND_NCCL_UNIQUE_ID_BYTES, "NCCL unique id size");
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return NcclFail(err, len, "ncclGetUniqueId", r);
  std::memcpy(id, &u, sizeof(u));
  return 0;
}

int CommCreate(const uint8_t* id, int nranks, int rank, int device, int64_t timeout_ms, void** out,
               char* err, size_t len) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return CudaFail(err, len, "cudaSetDevice", e);
  auto* c = new Comm;
  c->device = device;
  c->nranks = nranks;
  e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    AbortAndFree(c);
    return CudaFail(err, len, "cudaStreamCreate", e);
  }
  ncclUniqueId u;
  std::memcpy(&u, id, sizeof(u));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, u, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const int rc = NcclFail(err, len, "ncclCommInitRankConfig", r);
    AbortAndFree(c);  // a non-blocking init may have made the comm: abort it, never leak it
    return rc;
  }
  if (WaitComm(c, Clock::now() + std::chrono::milliseconds(timeout_ms), "ncclCommInitRank", err,
               len) != 0) {
    AbortAndFree(c);  // WaitComm aborted the comm when it failed it
    return -1;
  }
  *out = c;
  return 0;
}

void CommDestroy(void* handle) {
  auto* c = static_cast<Comm*>(handle);
  if (c == nullptr) return;
  cudaSetDevice(c->device);
  if (c->comm != nullptr) ncclCommAbort(c->comm);
  if (c->stream != nullptr) cudaStreamDestroy(c->stream);
  delete c;
}

int AllReduce(void* comm, const void* send, void* recv, size_t count, int dtype, int op,
              int64_t timeout_ms, char* err, size_t len) {
  return Run(comm, timeout_ms, "ncclAllReduce", err, len, [&](Comm* c) {
    return ncclAllReduce(send, recv, count, DType(dtype), Op(op), c->comm, c->stream);
  });
}

int ReduceScatter(void* comm, const void* send, void* recv, size_t recv_count, int dtype, int op,
                  int64_t timeout_ms, char* err, size_t len) {
  return Run(comm, timeout_ms, "ncclReduceScatter", err, len, [&](Comm* c) {
    return ncclReduceScatter(send, recv, recv_count, DType(dtype), Op(op), c->comm, c->stream);
  });
}

int AllGather(void* comm, const void* send, void* recv, size_t send_count, int dtype,
              int64_t timeout_ms, char* err, size_t len) {
  return Run(comm, timeout_ms, "ncclAllGather", err, len, [&](Comm* c) {
    return ncclAllGather(send, recv, send_count, DType(dtype), c->comm, c->stream);
  });
}

int AllToAll(void* comm, const void* send, void* recv, size_t block_count, int dtype,
             int64_t timeout_ms, char* err, size_t len) {
  return Run(comm, timeout_ms, "ncclAlltoAll", err, len, [&](Comm* c) {
    return ncclAlltoAll(send, recv, block_count, DType(dtype), c->comm, c->stream);
  });
}

int Broadcast(void* comm, const void* send, void* recv, size_t count, int dtype, int root,
              int64_t timeout_ms, char* err, size_t len) {
  return Run(comm, timeout_ms, "ncclBroadcast", err, len, [&](Comm* c) {
    return ncclBroadcast(send, recv, count, DType(dtype), root, c->comm, c->stream);
  });
}

int DeviceMalloc(int device, size_t bytes, void** ptr, char* err, size_t len) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMalloc(ptr, bytes);
  return e == cudaSuccess ? 0 : CudaFail(err, len, "cudaMalloc", e);
}

void DeviceFree(int device, void* ptr) {
  if (cudaSetDevice(device) == cudaSuccess) cudaFree(ptr);
}

int CopyToDevice(int device, void* dst, const void* src, size_t bytes, char* err, size_t len) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  return e == cudaSuccess ? 0 : CudaFail(err, len, "cudaMemcpy H2D", e);
}

int CopyToHost(int device, void* dst, const void* src, size_t bytes, char* err, size_t len) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? 0 : CudaFail(err, len, "cudaMemcpy D2H", e);
}

// ---- version 2: stream-ordered ----

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

int AllReduceOn(void* comm, const void* send, void* recv, size_t count, int dtype, int op,
                int64_t timeout_ms, void* stream, char* err, size_t len) {
  return Queue(comm, timeout_ms, "ncclAllReduce", err, len, [&](Comm* c) {
    return ncclAllReduce(send, recv, count, DType(dtype), Op(op), c->comm, S(stream));
  });
}

int ReduceScatterOn(void* comm, const void* send, void* recv, size_t recv_count, int dtype, int op,
                    int64_t timeout_ms, void* stream, char* err, size_t len) {
  return Queue(comm, timeout_ms, "ncclReduceScatter", err, len, [&](Comm* c) {
    return ncclReduceScatter(send, recv, recv_count, DType(dtype), Op(op), c->comm, S(stream));
  });
}

int AllGatherOn(void* comm, const void* send, void* recv, size_t send_count, int dtype,
                int64_t timeout_ms, void* stream, char* err, size_t len) {
  return Queue(comm, timeout_ms, "ncclAllGather", err, len, [&](Comm* c) {
    return ncclAllGather(send, recv, send_count, DType(dtype), c->comm, S(stream));
  });
}

int AllGatherVOn(void* comm, const void* send, void* recv, const int64_t* counts, int dtype,
                 int64_t timeout_ms, void* stream, char* err, size_t len) {
  const size_t elem = dtype == DIOND_NCCL_U8 ? 1 : 4;
  const char* what = "ncclBroadcast (all-gather-v)";
  return Queue(comm, timeout_ms, what, err, len, [&](Comm* c) -> ncclResult_t {
    int rank = 0;
    ncclResult_t r = ncclCommUserRank(c->comm, &rank);
    if (r != ncclSuccess) return r;
    r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    size_t at = 0;
    for (int j = 0; j < c->nranks; ++j) {
      const size_t n = static_cast<size_t>(counts[j]);
      char* dst = static_cast<char*>(recv) + at * elem;
      if (n > 0) {
        r = ncclBroadcast(j == rank ? send : dst, dst, n, DType(dtype), j, c->comm, S(stream));
        if (r != ncclSuccess && r != ncclInProgress) {
          ncclGroupEnd();
          return r;
        }
      }
      at += n;
    }
    return ncclGroupEnd();
  });
}

int AllToAllOn(void* comm, const void* send, void* recv, size_t block_count, int dtype,
               int64_t timeout_ms, void* stream, char* err, size_t len) {
  return Queue(comm, timeout_ms, "ncclAlltoAll", err, len, [&](Comm* c) {
    return ncclAlltoAll(send, recv, block_count, DType(dtype), c->comm, S(stream));
  });
}

int BroadcastOn(void* comm, const void* send, void* recv, size_t count, int dtype, int root,
                int64_t timeout_ms, void* stream, char* err, size_t len) {
  return Queue(comm, timeout_ms, "ncclBroadcast", err, len, [&](Comm* c) {
    return ncclBroadcast(send, recv, count, DType(dtype), root, c->comm, S(stream));
  });
}

int AsyncError(void* comm, char* err, size_t len) {
  auto* c = static_cast<Comm*>(comm);
  if (c == nullptr || c->comm == nullptr) return Fail(err, len, "nccl", "communicator is aborted");
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->comm, &state);
  if (r != ncclSuccess) return NcclFail(err, len, "ncclCommGetAsyncError", r);
  if (state == ncclSuccess || state == ncclInProgress) return 0;
  return NcclFail(err, len, "nccl asynchronous error", state);
}

const DiondNcclApiV1 kNccl = {
    2,
    &GetUniqueId,
    &CommCreate,
    &CommDestroy,
    &AllReduce,
    &ReduceScatter,
    &AllGather,
    &AllToAll,
    &Broadcast,
    &DeviceMalloc,
    &DeviceFree,
    &CopyToDevice,
    &CopyToHost,
    // version 2
    &AllReduceOn,
    &ReduceScatterOn,
    &AllGatherOn,
    &AllGatherVOn,
    &AllToAllOn,
    &BroadcastOn,
    &AsyncError,
};

}  // namespace

const DiondNcclApiV1* NcclApi() { return &kNccl; }

}  // namespace diond::cuda
