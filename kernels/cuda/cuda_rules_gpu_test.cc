// GPU only (label `gpu`): the CUDA runtime rules that the TEST backend's host runtime
// (kernels/testing/fake_cuda) enforces in CI, shown on the real runtime, each as the smallest
// program. Needs a device: without one every case fails at its first call.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace {

TEST(CudaRules, AnErrorStaysPendingUntilGetLastErrorReadsIt) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, size_t{1} << 62), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorMemoryAllocation);  // still pending
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);     // read and cleared
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaRules, TheLegacyStreamDuringABlockingStreamsCaptureFailsAndInvalidatesIt) {
  for (unsigned flags : {cudaStreamDefault, cudaStreamNonBlocking}) {
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, flags), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    void* p = nullptr;
    const cudaError_t alloc = cudaMallocAsync(&p, 1 << 20, nullptr);
    cudaGraph_t g = nullptr;
    const cudaError_t end = cudaStreamEndCapture(s, &g);
    if (flags == cudaStreamDefault) {
      EXPECT_EQ(alloc, cudaErrorStreamCaptureImplicit);
      EXPECT_EQ(end, cudaErrorStreamCaptureInvalidated);
    } else {
      EXPECT_EQ(alloc, cudaSuccess);
      EXPECT_EQ(end, cudaSuccess);
      cudaFreeAsync(p, nullptr);
    }
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    cudaStreamDestroy(s);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

// A relaxed-mode allocation and wait on another stream, from the thread that is capturing.
TEST(CudaRules, ARelaxedAllocationDuringThisThreadsCaptureLeavesItValid) {
  cudaStream_t s = nullptr, alloc = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&alloc, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMallocAsync(&p, 1 << 20, alloc), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(alloc), cudaSuccess);
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  cudaGraph_t g = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  if (g != nullptr) cudaGraphDestroy(g);
  cudaFreeAsync(p, alloc);
  cudaStreamDestroy(alloc);
  cudaStreamDestroy(s);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(CudaRules, ScratchCapturedIntoAGraphIsGraphMemory) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 8 << 20, s), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(p, 0, 8 << 20, s), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(p, s), cudaSuccess);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  uint64_t reserved = 0;
  ASSERT_EQ(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrReservedMemCurrent, &reserved),
            cudaSuccess);
  EXPECT_GE(reserved, uint64_t{8} << 20);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  ASSERT_EQ(cudaDeviceGraphMemTrim(0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrReservedMemCurrent, &reserved),
            cudaSuccess);
  EXPECT_EQ(reserved, 0u);
  cudaStreamDestroy(s);
}

TEST(CudaRules, ThePoolGivesBackWhatIsAboveItsReleaseThreshold) {
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t threshold = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 256 << 20, s), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(p, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  uint64_t reserved = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved),
            cudaSuccess);
  EXPECT_LT(reserved, uint64_t{256} << 20);
  cudaStreamDestroy(s);
}

// cuBLAS documents that streams sharing one handle's workspace may give results that are not
// reproducible; with a handle and a workspace per stream, as the plugin keeps one pair per
// session stream, the same product run on several streams at once has a lone run's bits.
TEST(CudaRules, AHandleAndWorkspacePerStreamGiveEveryStreamALoneRunsBits) {
  constexpr int kN = 1024, kStreams = 4;
  constexpr size_t kBytes = size_t{kN} * kN * sizeof(float), kWorkspace = size_t{32} << 20;
  std::vector<float> a(size_t{kN} * kN), b(size_t{kN} * kN);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
    b[i] = static_cast<float>((i * 53) % 97) / 97.0f - 0.5f;
  }
  void *va = nullptr, *vb = nullptr;
  ASSERT_EQ(cudaMalloc(&va, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&vb, kBytes), cudaSuccess);
  float* da = static_cast<float*>(va);
  float* db = static_cast<float*>(vb);
  ASSERT_EQ(cudaMemcpy(da, a.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db, b.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t s[kStreams] = {};
  cublasHandle_t h[kStreams] = {};
  void* ws[kStreams] = {};
  float* dc[kStreams] = {};
  for (int k = 0; k < kStreams; ++k) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cublasCreate(&h[k]), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(h[k], s[k]), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaMalloc(&ws[k], kWorkspace), cudaSuccess);
    ASSERT_EQ(cublasSetWorkspace(h[k], ws[k], kWorkspace), CUBLAS_STATUS_SUCCESS);
    void* vc = nullptr;
    ASSERT_EQ(cudaMalloc(&vc, kBytes), cudaSuccess);
    dc[k] = static_cast<float*>(vc);
  }
  const float one = 1.0f, zero = 0.0f;
  auto gemm = [&](int k) {
    return cublasSgemm(h[k], CUBLAS_OP_N, CUBLAS_OP_N, kN, kN, kN, &one, da, kN, db, kN, &zero,
                       dc[k], kN);
  };
  ASSERT_EQ(gemm(0), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(s[0]), cudaSuccess);
  std::vector<float> lone(a.size()), got(a.size());
  ASSERT_EQ(cudaMemcpy(lone.data(), dc[0], kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int round = 0; round < 5; ++round) {
    for (int k = 0; k < kStreams; ++k) ASSERT_EQ(gemm(k), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int k = 0; k < kStreams; ++k) {
      ASSERT_EQ(cudaMemcpy(got.data(), dc[k], kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(got, lone) << "stream " << k << ", round " << round;
    }
  }
  for (int k = 0; k < kStreams; ++k) {
    cublasDestroy(h[k]);
    cudaFree(ws[k]);
    cudaFree(dc[k]);
    cudaStreamDestroy(s[k]);
  }
  cudaFree(da);
  cudaFree(db);
}

}  // namespace
