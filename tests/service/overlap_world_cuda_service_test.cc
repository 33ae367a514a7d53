// The overlapped step of world device sessions over CUDA regions (docs/DISTRIBUTED.md "On device
// daemons"), on the strict TEST backend: no GPU runs any of this. Two daemons in this test's
// process form a world of two on TEST device 0 (CudaWorld: the IPC handles and events are
// emulated within one process); the test is both trainers. On each rank a world session over
// CUDA regions (rank 0 a legacy IPC handle, rank 1 VMM fds) steps overlapped, with a doorbell
// page whose buckets carry an event pair each, while a thread per rank writes each bucket's
// gradients and rings it in an order of its own; its twin world session (another world_key, the
// same weights and gradients, also over CUDA regions) steps synchronously.
//
// Checked after every step, on both ranks: the overlapped CUDA arena equals the synchronous one
// bit for bit, with the same update norms; each bucket's ready event was waited on once and its
// done event recorded once per step; every weights word says the step. Muon and Dion2 under
// AVERAGE (different gradients per rank), AdamW under REPLICATED.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/service/cuda_harness.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

constexpr int kBucketCount = 3;

class CudaWorldOverlap : public ::testing::Test, protected CudaWorld {
 protected:
  static void SetUpTestSuite() { RegisterStrictTestDevice(); }
  void SetUp() override { StartWorld("/tmp/diond-cuda-world-ov-"); }
  void TearDown() override { StopWorld(); }
};

// One rank's sessions and doorbell page.
struct Rank {
  std::unique_ptr<CudaSession> sync, ov;
  std::unique_ptr<ShmSegment> page;
  Bells bells;
  std::vector<std::string> ready, done;
};

TEST_F(CudaWorldOverlap, EqualsASynchronousCudaWorldBitForBitWithTheBucketsEvents) {
  for (const auto& [a, sync] : {std::pair{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
                                std::pair{AlgorithmKind::kDion2, v1::GRADIENT_SYNC_AVERAGE},
                                std::pair{AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED}}) {
    SCOPED_TRACE(optim::AlgorithmName(a));
    const SessionDesc d = Desc(a);
    const std::string label = absl::StrCat(optim::AlgorithmName(a), "-", sync);
    Rank ranks[kWorld];
    for (const char* kind : {"sync", "ov"}) {
      v1::CreateSessionRequest req = d.Request();
      req.set_gradient_sync(sync);
      req.set_world_key(absl::StrCat(kind, "-", label));
      OnAllRanks([&](int r) {
        (std::string(kind) == "sync" ? ranks[r].sync : ranks[r].ov) = CreateCudaSession(
            stub(r), daemons_[static_cast<size_t>(r)]->fd_channel_path(), *trainer_, req,
            /*vmm=*/r == 1);
      });
    }
    for (int r = 0; r < kWorld; ++r) {
      Rank& k = ranks[r];
      ASSERT_NE(k.sync, nullptr) << r;
      ASSERT_NE(k.ov, nullptr) << r;
      for (const CudaSession* s : {k.sync.get(), k.ov.get()}) {
        ASSERT_TRUE(SetState(stub(r), s->id, SyntheticWeights(d, 1)).ok());
      }
      k.page = ShmSegment::Create(4096);
      ASSERT_NE(k.page, nullptr);
      WriteDoorbellHeader(k.page->data(), kBucketCount);
      k.bells.base = k.page->data();
      for (int b = 0; b < kBucketCount; ++b) {
        k.ready.push_back(NewEvent());
        k.done.push_back(NewEvent());
      }
      grpc::Status st = RegisterShmDoorbells(stub(r), k.ov->id, k.page->name(), 0, 4096, kBuckets,
                                             nullptr, k.ready, k.done);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
    // (A plain copy: a C++17 lambda cannot capture a structured binding.)
    const bool replicated = sync == v1::GRADIENT_SYNC_REPLICATED;
    for (int64_t t = 1; t <= 3; ++t) {
      SCOPED_TRACE(absl::StrCat("step ", t));
      v1::StepResponse want[kWorld], got[kWorld];
      grpc::Status st[kWorld];
      OnAllRanks([&](int r) {
        Rank& k = ranks[r];
        const uint64_t seed = replicated ? 7 : 7 + static_cast<uint64_t>(r);
        std::vector<std::vector<float>> g;
        for (size_t i = 0; i < d.params.size(); ++i) {
          g.push_back(SyntheticValues(seed, t, i, d.Numel(i)));
          k.sync->WriteGrad(i, g.back());
        }
        grpc::Status s = DoStep(stub(r), k.sync->id, t, &want[r]);
        EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.error_message();
        v1::StepResponse queued;
        s = OverlapStep(stub(r), k.ov->id, t, &queued);
        ASSERT_TRUE(s.ok()) << s.error_message();
        for (int b : RingOrder(t + r)) {
          for (int32_t i : kBuckets[static_cast<size_t>(b)]) {
            k.ov->WriteGrad(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
          }
          absl::SleepFor(absl::Milliseconds(2));
          k.bells.RingGradients(b, t);
        }
        st[r] = WaitStep(stub(r), k.ov->id, &got[r]);
      });
      for (int r = 0; r < kWorld; ++r) {
        Rank& k = ranks[r];
        ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
        ExpectSameResult(got[r], want[r]);
        EXPECT_FALSE(got[r].skipped());
        EXPECT_TRUE(k.ov->Params() == k.sync->Params()) << "rank " << r << ": the weights differ";
        for (int b = 0; b < kBucketCount; ++b) {
          EXPECT_EQ(k.bells.weights(b), t) << "rank " << r << ", bucket " << b;
          EXPECT_EQ(Waits(k.ready[static_cast<size_t>(b)]), t) << "rank " << r << ", bucket " << b;
          EXPECT_EQ(Records(k.done[static_cast<size_t>(b)]), t) << "rank " << r << ", bucket " << b;
        }
      }
      EXPECT_TRUE(ranks[0].ov->Params() == ranks[1].ov->Params()) << "the ranks differ";
    }
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(CloseSession(stub(r), ranks[r].sync->id).ok());
      EXPECT_TRUE(CloseSession(stub(r), ranks[r].ov->id).ok());
    }
  }
}

}  // namespace
}  // namespace diond::service_testing
