// TEST BACKEND: the cuSOLVER handle calls of kernels/cuda/ops_memory.cc (fake_cuda_runtime.cc).
#ifndef DIOND_KERNELS_TESTING_FAKE_CUDA_CUSOLVERDN_H_
#define DIOND_KERNELS_TESTING_FAKE_CUDA_CUSOLVERDN_H_

#include "cuda_runtime_api.h"

extern "C" {
typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;
typedef struct FakeCusolver* cusolverDnHandle_t;
cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle);
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle);
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t stream);
}  // extern "C"

#endif  // DIOND_KERNELS_TESTING_FAKE_CUDA_CUSOLVERDN_H_
