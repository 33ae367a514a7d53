// TEST BACKEND: the cuBLAS handle calls of kernels/cuda/ops_memory.cc (fake_cuda_runtime.cc).
#ifndef DIOND_KERNELS_TESTING_FAKE_CUDA_CUBLAS_V2_H_
#define DIOND_KERNELS_TESTING_FAKE_CUDA_CUBLAS_V2_H_

#include "cuda_runtime_api.h"

extern "C" {
typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3
} cublasStatus_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0 } cublasMath_t;
typedef struct FakeCublas* cublasHandle_t;
cublasStatus_t cublasCreate(cublasHandle_t* handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t bytes);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
const char* cublasGetStatusString(cublasStatus_t status);
}  // extern "C"

#endif  // DIOND_KERNELS_TESTING_FAKE_CUDA_CUBLAS_V2_H_
