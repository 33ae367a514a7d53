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

inline cudaStream_t StreamOf(const DiondOpsCall* call) {
  return static_cast<cudaStream_t>(call->stream);
}

#define DIOND_CU(op, expr)                                                                  \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      return ::diond::cuda::Fail(call,                                                      \
                                 e_ == cudaErrorMemoryAllocation ? DIOND_OPS_RESOURCE_EXHAUSTED \
                                                                 : DIOND_OPS_INTERNAL,      \
                                 "%s: %s failed: %s", op, #expr, cudaGetErrorString(e_));   \
    }                                                                                       \
  } while (0)
#define DIOND_CUBLAS(op, expr)                                                              \
  do {                                                                                      \
    const cublasStatus_t s_ = (expr);                                                       \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      return ::diond::cuda::Fail(call, DIOND_OPS_INTERNAL, "%s: %s failed: %s", op, #expr,  \
                                 cublasGetStatusString(s_));                                \
    }                                                                                       \
  } while (0)
#define DIOND_CUSOLVER(op, expr)                                                            \
  do {                                                                                      \
    const cusolverStatus_t s_ = (expr);                                                     \
    if (s_ != CUSOLVER_STATUS_SUCCESS) {                                                    \
      return ::diond::cuda::Fail(call, DIOND_OPS_INTERNAL, "%s: %s failed: status %d", op,  \
                                 #expr, static_cast<int>(s_));                              \
    }                                                                                       \
  } while (0)
#define DIOND_RC(expr)                  \
  do {                                  \
    const int rc_ = (expr);             \
    if (rc_ != DIOND_OPS_OK) return rc_; \
  } while (0)

// Sets the call's device current (every entry starts with it).
int UseDevice(const DiondOpsCall* call, const char* op);

// The calling thread's cuBLAS / cuSOLVER handles for call->device, bound to call->stream.
// cuBLAS runs in CUBLAS_DEFAULT_MATH (no TF32: fp32 GEMMs compute in true fp32).
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

// Pool accounting (ops_memory.cu).
void CountAllocation(int device, size_t bytes);
void CountFree(int device, size_t bytes);


// After a kernel launch on call->stream: the launch's own error, if any.
int CheckLaunch(const DiondOpsCall* call, const char* op);

// Sync point: waits for call->stream.
inline int Sync(const DiondOpsCall* call, const char* op) {
  DIOND_CU(op, cudaStreamSynchronize(StreamOf(call)));
  return DIOND_OPS_OK;
}

}  // namespace diond::cuda

#endif  // DIOND_KERNELS_CUDA_RUNTIME_H_
