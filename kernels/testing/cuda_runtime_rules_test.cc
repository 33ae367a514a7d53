// The CUDA plugin's host-side runtime code (kernels/cuda/ops_memory.cc, compiled unchanged)
// against the TEST backend's strict host CUDA runtime (fake_cuda/fake_cuda_control.h): the rules
// of CUDA's documentation that a GPU enforces and plain host memory does not.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/ops_internal.h"
#include "kernels/cuda/runtime.h"
#include "kernels/testing/fake_cuda/fake_cuda_control.h"

namespace diond::cuda {
namespace {

namespace fake = ::diond::kernels::testing::fake_cuda;

constexpr uint64_t kBudget = uint64_t{8} << 30;

struct Call {
  explicit Call(void* stream = nullptr) : c{0, stream, err, sizeof(err)} {}
  char err[512] = {0};
  DiondOpsCall c;
};

class CudaRuntimeRulesTest : public ::testing::Test {
 protected:
  void SetUp() override { fake::Reset(kBudget); }
  void TearDown() override {
    for (void* s : streams_) OpStreamDestroy(0, s);
  }
  void* NewStream() {
    Call call;
    void* s = nullptr;
    EXPECT_EQ(OpStreamCreate(&call.c, &s), DIOND_OPS_OK) << call.err;
    streams_.push_back(s);
    return s;
  }
  void DestroyStream(void* s) {
    OpStreamDestroy(0, s);
    streams_.erase(std::find(streams_.begin(), streams_.end(), s));
  }
  // What the next kernel launch of an entry would see (kernels/cuda/ops_common.cuh Launch).
  static std::string NextLaunch(void* stream) {
    Call call(stream);
    if (UseDevice(&call.c, "next") != DIOND_OPS_OK) return call.err;
    return CheckLaunch(&call.c, "next") == DIOND_OPS_OK ? "" : call.err;
  }
  std::vector<void*> streams_;
};

// ---- errors: a failure is read (and cleared) where it happens, never by a later launch ----

TEST_F(CudaRuntimeRulesTest, ScratchOutOfMemoryDoesNotFailTheNextLaunch) {
  void* s = NewStream();
  {
    Call call(s);
    Scratch big;
    EXPECT_EQ(big.Allocate(&call.c, "op", kBudget * 2), DIOND_OPS_RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ(NextLaunch(s), "");
}

TEST_F(CudaRuntimeRulesTest, FailedCaptureDoesNotFailTheNextLaunch) {
  void* s = NewStream();
  for (const char* where : {"cudaStreamEndCapture", "cudaGraphInstantiate"}) {
    Call call(s);
    ASSERT_EQ(OpGraphBeginCapture(&call.c), DIOND_OPS_OK) << call.err;
    if (std::string(where) == "cudaStreamEndCapture") {
      Call sync(s);  // a sync point inside the capture invalidates it
      EXPECT_NE(OpStreamSynchronize(&sync.c), DIOND_OPS_OK);
    } else {
      fake::FailNext(where, cudaErrorInvalidValue);
    }
    void* graph = nullptr;
    EXPECT_NE(OpGraphEndCapture(&call.c, &graph), DIOND_OPS_OK) << where;
    EXPECT_EQ(graph, nullptr);
    EXPECT_EQ(NextLaunch(s), "") << "after a failed " << where;
  }
}

TEST_F(CudaRuntimeRulesTest, FailedHostRegisterDoesNotFailTheNextLaunch) {
  void* s = NewStream();
  std::vector<char> host(4096);
  Call call(s);
  fake::FailNext("cudaHostRegister", cudaErrorHostMemoryAlreadyRegistered);
  EXPECT_NE(OpHostRegister(&call.c, host.data(), host.size()), DIOND_OPS_OK);
  EXPECT_EQ(NextLaunch(s), "");
}

TEST_F(CudaRuntimeRulesTest, IgnoredFreeAndStreamDestroyErrorsDoNotFailTheNextLaunch) {
  void* s = NewStream();
  {
    Call call(s);
    Scratch a;
    ASSERT_EQ(a.Allocate(&call.c, "op", 256), DIOND_OPS_OK);
    fake::FailNext("cudaFreeAsync", cudaErrorInvalidValue);
  }
  EXPECT_EQ(NextLaunch(s), "") << "after a failed scratch free";
  void* other = NewStream();
  fake::FailNext("cudaStreamDestroy", cudaErrorInvalidResourceHandle);
  DestroyStream(other);
  EXPECT_EQ(NextLaunch(s), "") << "after a failed stream destroy";
}

// ---- the streams: session streams and the unstreamed allocations ----

TEST_F(CudaRuntimeRulesTest, FreeWhileAnotherStreamCapturesLeavesTheCaptureValid) {
  void* s = NewStream();
  const uint64_t used = fake::GetStats().pool_used;
  Call alloc;
  void* p = nullptr;
  ASSERT_EQ(OpAllocate(&alloc.c, 1 << 20, &p), DIOND_OPS_OK) << alloc.err;
  Call call(s);
  ASSERT_EQ(OpGraphBeginCapture(&call.c), DIOND_OPS_OK) << call.err;
  OpDeallocate(0, nullptr, p, 1 << 20);  // another session closes, on another thread
  void* graph = nullptr;
  EXPECT_EQ(OpGraphEndCapture(&call.c, &graph), DIOND_OPS_OK) << call.err;
  EXPECT_EQ(fake::GetStats().captures_invalidated, 0);
  EXPECT_EQ(fake::GetStats().failed_frees, 0) << "the free was lost";
  EXPECT_EQ(fake::GetStats().pool_used, used);
  OpGraphDestroy(0, graph);
}

TEST_F(CudaRuntimeRulesTest, AllocateWhileAnotherStreamCapturesLeavesTheCaptureValid) {
  void* s = NewStream();
  Call call(s);
  ASSERT_EQ(OpGraphBeginCapture(&call.c), DIOND_OPS_OK) << call.err;
  Call alloc;
  void* p = nullptr;
  EXPECT_EQ(OpAllocate(&alloc.c, 1 << 20, &p), DIOND_OPS_OK) << alloc.err;
  void* graph = nullptr;
  EXPECT_EQ(OpGraphEndCapture(&call.c, &graph), DIOND_OPS_OK) << call.err;
  OpGraphDestroy(0, graph);
  OpDeallocate(0, nullptr, p, 1 << 20);
}

TEST_F(CudaRuntimeRulesTest, UnstreamedAllocAndFreeAreNoBarrierAcrossSessionStreams) {
  void* a = NewStream();
  void* b = NewStream();
  std::vector<char> host(4096, 1);
  Call alloc;
  void* p = nullptr;
  ASSERT_EQ(OpAllocate(&alloc.c, host.size(), &p), DIOND_OPS_OK) << alloc.err;
  for (void* s : {a, b}) {
    Call call(s);
    ASSERT_EQ(OpCopyFromHostAsync(&call.c, host.data(), p, host.size()), DIOND_OPS_OK);
  }
  const int64_t before = fake::GetStats().legacy_barriers;
  void* q = nullptr;
  ASSERT_EQ(OpAllocate(&alloc.c, 1 << 20, &q), DIOND_OPS_OK) << alloc.err;
  OpDeallocate(0, nullptr, q, 1 << 20);
  EXPECT_EQ(fake::GetStats().legacy_barriers - before, 0)
      << "an allocation or free made every session stream wait";
  OpDeallocate(0, nullptr, p, host.size());
}

// The free of an unstreamed allocation comes after the work of every stream that used it.
TEST_F(CudaRuntimeRulesTest, UnstreamedFreeIsOrderedAfterEveryStreamsWork) {
  void* a = NewStream();
  void* b = NewStream();
  std::vector<char> host(4096, 1);
  Call alloc;
  void* p = nullptr;
  ASSERT_EQ(OpAllocate(&alloc.c, host.size(), &p), DIOND_OPS_OK) << alloc.err;
  for (void* s : {a, b}) {
    Call call(s);
    ASSERT_EQ(OpCopyFromHostAsync(&call.c, host.data(), p, host.size()), DIOND_OPS_OK);
  }
  OpDeallocate(0, nullptr, p, host.size());
  EXPECT_EQ(fake::GetStats().unordered_frees, 0);
  EXPECT_EQ(fake::GetStats().failed_frees, 0);
}

// ---- cuBLAS: one workspace per stream (reproducible results on every stream) ----

TEST_F(CudaRuntimeRulesTest, EachStreamHasItsOwnBlasWorkspace) {
  void* a = NewStream();
  void* b = NewStream();
  cublasHandle_t ha = nullptr, hb = nullptr, ha2 = nullptr;
  Call ca(a), cb(b);
  ASSERT_EQ(Blas(&ca.c, "gemm", &ha), DIOND_OPS_OK) << ca.err;
  ASSERT_EQ(Blas(&cb.c, "gemm", &hb), DIOND_OPS_OK) << cb.err;
  ASSERT_EQ(Blas(&ca.c, "gemm", &ha2), DIOND_OPS_OK) << ca.err;
  EXPECT_EQ(fake::GetStats().blas_shared_workspace, 0);
  EXPECT_EQ(ha, ha2);
}

// ---- memory given back, graph memory counted ----

TEST_F(CudaRuntimeRulesTest, FreedMemoryAboveTheCacheIsGivenBackAtASync) {
  void* s = NewStream();
  Call alloc;
  void* p = nullptr;
  const size_t big = size_t{4} << 30;
  ASSERT_EQ(OpAllocate(&alloc.c, big, &p), DIOND_OPS_OK) << alloc.err;
  OpDeallocate(0, nullptr, p, big);
  Call call(s);
  ASSERT_EQ(OpStreamSynchronize(&call.c), DIOND_OPS_OK) << call.err;
  EXPECT_LE(fake::GetStats().pool_reserved, kBudget / 8) << "the cache is unbounded";
}

TEST_F(CudaRuntimeRulesTest, ClosingASessionTrimsThePoolAndGraphMemory) {
  void* s = NewStream();
  Call alloc;
  void* p = nullptr;
  ASSERT_EQ(OpAllocate(&alloc.c, 64 << 20, &p), DIOND_OPS_OK) << alloc.err;
  OpDeallocate(0, nullptr, p, 64 << 20);
  Call call(s);
  ASSERT_EQ(OpGraphBeginCapture(&call.c), DIOND_OPS_OK) << call.err;
  {
    Scratch scratch;
    ASSERT_EQ(scratch.Allocate(&call.c, "op", 1 << 20), DIOND_OPS_OK) << call.err;
  }
  void* graph = nullptr;
  ASSERT_EQ(OpGraphEndCapture(&call.c, &graph), DIOND_OPS_OK) << call.err;
  ASSERT_EQ(OpGraphLaunch(&call.c, graph), DIOND_OPS_OK) << call.err;
  OpGraphDestroy(0, graph);
  DestroyStream(s);  // the session closes
  EXPECT_EQ(fake::GetStats().pool_reserved, fake::GetStats().pool_used);
  EXPECT_EQ(fake::GetStats().graph_reserved, 0u);
}

TEST_F(CudaRuntimeRulesTest, GraphMemoryIsCounted) {
  void* s = NewStream();
  Call call(s);
  uint64_t in_use0 = 0, peak0 = 0;
  ASSERT_EQ(OpMemoryStats(&call.c, &in_use0, &peak0), DIOND_OPS_OK);
  ASSERT_EQ(OpGraphBeginCapture(&call.c), DIOND_OPS_OK) << call.err;
  {
    Scratch scratch;  // inside the capture: graph memory
    ASSERT_EQ(scratch.Allocate(&call.c, "op", 1 << 20), DIOND_OPS_OK) << call.err;
  }
  void* graph = nullptr;
  ASSERT_EQ(OpGraphEndCapture(&call.c, &graph), DIOND_OPS_OK) << call.err;
  ASSERT_EQ(OpGraphLaunch(&call.c, graph), DIOND_OPS_OK) << call.err;
  uint64_t in_use = 0, peak = 0;
  ASSERT_EQ(OpMemoryStats(&call.c, &in_use, &peak), DIOND_OPS_OK);
  EXPECT_GE(in_use, in_use0 + (1 << 20)) << "the graph's memory is not counted";
  EXPECT_GE(peak, in_use);
  OpGraphDestroy(0, graph);
  ASSERT_EQ(OpMemoryStats(&call.c, &in_use, &peak), DIOND_OPS_OK);
  EXPECT_EQ(in_use, in_use0);
}

// ---- error codes ----

TEST_F(CudaRuntimeRulesTest, CaptureConflictIsNotOutOfMemory) {
  Call alloc;
  void* p = nullptr;
  fake::FailNext("cudaMallocAsync", cudaErrorStreamCaptureImplicit);
  EXPECT_EQ(OpAllocate(&alloc.c, 1 << 20, &p), DIOND_OPS_FAILED_PRECONDITION) << alloc.err;
  EXPECT_NE(std::string(alloc.err).find("capture"), std::string::npos) << alloc.err;
}

// (Last: a lost context stays lost for the process, as on a GPU.)
TEST_F(CudaRuntimeRulesTest, LostContextIsReportedAndRefused) {
  void* s = NewStream();
  Call healthy;
  EXPECT_EQ(OpDeviceHealth(&healthy.c), DIOND_OPS_OK) << healthy.err;
  fake::LoseContext();
  // device_health notices it by itself, before any other entry ran into it (the daemon asks
  // after every step and turns its health NOT_SERVING).
  Call health;
  EXPECT_EQ(OpDeviceHealth(&health.c), DIOND_OPS_FAILED_PRECONDITION);
  EXPECT_NE(std::string(health.err).find("the CUDA context is lost"), std::string::npos)
      << health.err;
  EXPECT_NE(std::string(health.err).find("illegal memory access"), std::string::npos) << health.err;
  Call call(s);
  EXPECT_NE(OpStreamSynchronize(&call.c), DIOND_OPS_OK);
  // Every entry after it is refused with one clear message, the memory stats included (the
  // daemon's health reads them).
  Call next(s);
  EXPECT_EQ(OpStreamSynchronize(&next.c), DIOND_OPS_FAILED_PRECONDITION);
  EXPECT_NE(std::string(next.err).find("context is lost"), std::string::npos) << next.err;
  uint64_t in_use = 0, peak = 0;
  Call stats(s);
  EXPECT_EQ(OpMemoryStats(&stats.c, &in_use, &peak), DIOND_OPS_FAILED_PRECONDITION);
  EXPECT_NE(std::string(stats.err).find("context is lost"), std::string::npos) << stats.err;
}

}  // namespace
}  // namespace diond::cuda
