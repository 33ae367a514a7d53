// TEST BACKEND — NOT A PRODUCT FEATURE. Control and observation of the host CUDA runtime of
// cuda_runtime_api.h, against which CI runs the CUDA plugin's host-side runtime code
// (kernels/cuda/ops_memory.cc). It is strict: it enforces the rules of CUDA's documentation
// that host memory would otherwise let slip, and counts what would go wrong on a GPU:
// - errors: a failed call's error stays pending on the thread until cudaGetLastError reads it
//   (cudaPeekAtLastError leaves it); after LoseContext() every call fails with
//   cudaErrorIllegalAddress, which no read clears (a sticky error);
// - the legacy stream (nullptr): work on it while any blocking stream (cudaStreamDefault) is
//   capturing fails with cudaErrorStreamCaptureImplicit and invalidates those captures; outside
//   capture it waits on every blocking stream and they on it (legacy_barriers counts the
//   streams it was made to wait on); non-blocking streams are not synchronized with it;
// - ordering: streams carry vector clocks (events and the legacy barrier merge them); a
//   cudaFreeAsync of memory that a cudaMemcpyAsync used on another stream, not ordered after
//   that use, is a use-after-free on a GPU (unordered_frees);
// - capture: a synchronize of a capturing stream fails and invalidates the capture, as does a
//   stream outside the capture waiting on an event recorded inside it; cudaMallocAsync on a
//   capturing stream is graph memory, counted (graph_used) from the graph's first launch until
//   its executable is destroyed, and reserved until cudaDeviceGraphMemTrim;
// - the pool: freed blocks stay reserved up to the release threshold (0 by default, as CUDA's),
//   released at a stream synchronize or cudaMemPoolTrimTo; a budget makes allocations fail with
//   cudaErrorMemoryAllocation;
// - cuBLAS: a workspace (a handle's default one, which cublasSetStream restores, or one of
//   cublasSetWorkspace) used from two streams is not reproducible (blas_shared_workspace).
#ifndef DIOND_KERNELS_TESTING_FAKE_CUDA_FAKE_CUDA_CONTROL_H_
#define DIOND_KERNELS_TESTING_FAKE_CUDA_FAKE_CUDA_CONTROL_H_

#include <cstdint>

#include "cuda_runtime_api.h"

namespace diond::kernels::testing::fake_cuda {

struct Stats {
  int64_t legacy_barriers = 0;
  int64_t captures_invalidated = 0;
  int64_t unordered_frees = 0;
  int64_t failed_frees = 0;  // cudaFreeAsync calls that failed (the memory stays allocated)
  int64_t blas_shared_workspace = 0;
  int64_t streams_live = 0, blas_handles_live = 0, events_live = 0, graphs_live = 0;
  uint64_t pool_used = 0, pool_reserved = 0, graph_used = 0, graph_reserved = 0;
};
Stats GetStats();
// Forgets everything but the pool's release threshold (a device setting the code under test
// makes once); the tests destroy what they made first. budget 0: unlimited.
void Reset(uint64_t budget_bytes);
// The next call of the runtime function `name` (e.g. "cudaHostRegister") fails with `e`.
void FailNext(const char* name, cudaError_t e);
// A sticky error from now on (until Reset), as after a kernel's illegal address.
void LoseContext();

}  // namespace diond::kernels::testing::fake_cuda

#endif  // DIOND_KERNELS_TESTING_FAKE_CUDA_FAKE_CUDA_CONTROL_H_
