// The host side of the CUDA backend's runtime use (kernels/cuda/ops_memory.cc): error reporting
// in the C ABI's style, the library handles, stream-ordered scratch and the launch check. No
// device code, so that it also compiles against the TEST backend's host CUDA runtime
// (kernels/testing/fake_cuda), which enforces the runtime's rules in CI. Internal to the plugin.
#ifndef DIOND_KERNELS_CUDA_RUNTIME_H_
#define DIOND_KERNELS_CUDA_RUNTIME_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/plugin_api.h"

namespace diond::cuda {

// Writes a printf-style message into call->err and returns `code`.
int Fail(const DiondOpsCall* call, int code, const char* fmt, ...);
// The failure of `what` (a runtime call of `op`) with error `e`: see DIOND_CU.
int Failed(const DiondOpsCall* call, const char* op, const char* what, cudaError_t e);
// A runtime call whose failure has no caller to go to (a free, a destroy): its error is read and
// cleared so that it cannot fail a later call; a lost context is still recorded.
void Drop(int device, cudaError_t e);
// Whether a sticky error (an illegal address, a kernel fault...) has made `device`'s context
// unusable; every entry then fails with FAILED_PRECONDITION "the CUDA context is lost".
bool DeviceLost(int device);

inline cudaStream_t StreamOf(const DiondOpsCall* call) {
  return static_cast<cudaStream_t>(call->stream);
}

// A failed runtime call: its error is read (and so cleared) here, where it happened, never by a
// later launch check; the code is RESOURCE_EXHAUSTED for out of memory, FAILED_PRECONDITION for
// a capture conflict or a lost context (DeviceLost), INTERNAL otherwise.
#define DIOND_CU(op, expr)                                                    \
  do {                                                                        \
    const cudaError_t e_ = (expr);                                            \
    if (e_ != cudaSuccess) return ::diond::cuda::Failed(call, op, #expr, e_); \
  } while (0)
#define DIOND_CUBLAS(op, expr)                                                             \
  do {                                                                                     \
    const cublasStatus_t s_ = (expr);                                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      return ::diond::cuda::Fail(call, DIOND_OPS_INTERNAL, "%s: %s failed: %s", op, #expr, \
                                 cublasGetStatusString(s_));                               \
    }                                                                                      \
  } while (0)
#define DIOND_CUSOLVER(op, expr)                                                                  \
  do {                                                                                            \
    const cusolverStatus_t s_ = (expr);                                                           \
    if (s_ != CUSOLVER_STATUS_SUCCESS) {                                                          \
      return ::diond::cuda::Fail(call, DIOND_OPS_INTERNAL, "%s: %s failed: status %d", op, #expr, \
                                 static_cast<int>(s_));                                           \
    }                                                                                             \
  } while (0)
#define DIOND_RC(expr)                   \
  do {                                   \
    const int rc_ = (expr);              \
    if (rc_ != DIOND_OPS_OK) return rc_; \
  } while (0)

// Sets the call's device current (every entry starts with it); refuses a lost context.
int UseDevice(const DiondOpsCall* call, const char* op);

// The cuBLAS / cuSOLVER handles of call->stream: each stream made by stream_create has its own
// pair and its own cuBLAS workspace, set once when the stream is made (so that no two streams
// share a workspace, which cuBLAS documents as not reproducible, and no handle allocates while
// its stream captures); the null stream uses the calling thread's pair. cuBLAS runs in
// CUBLAS_DEFAULT_MATH (no TF32: fp32 GEMMs compute in true fp32).
int Blas(const DiondOpsCall* call, const char* op, cublasHandle_t* h);
int Solver(const DiondOpsCall* call, const char* op, cusolverDnHandle_t* h);

// Stream-ordered scratch from the device's pool, freed (stream-ordered) when it goes out of
// scope. Counted in the pool accounting like any allocation.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();
  int Allocate(const DiondOpsCall* call, const char* op, size_t bytes);
  template <typename T>
  T* As() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Pool accounting (ops_memory.cc).
void CountAllocation(int device, size_t bytes);
void CountFree(int device, size_t bytes);

// After a kernel launch on call->stream: the launch's own error, if any (every earlier failure
// was read where it happened).
int CheckLaunch(const DiondOpsCall* call, const char* op);

// Sync point: waits for call->stream.
inline int Sync(const DiondOpsCall* call, const char* op) {
  DIOND_CU(op, cudaStreamSynchronize(StreamOf(call)));
  return DIOND_OPS_OK;
}

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_RUNTIME_H_
