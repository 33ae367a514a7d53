// The overlapped step from C++ (diond/doorbells.h, StepOptions::overlap) against the real daemon:
// a session stepped overlapped, its buckets' gradients written and rung from another thread in
// backward's order while the caller waits per bucket, ends every step with the weights and
// update norms of a synchronous session given the same gradients, bit for bit; an abandoned step
// commits nothing and runs again synchronously; bad buckets are the daemon's INVALID_ARGUMENT.
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/cpp/tests/test_daemon.h"
#include "diond/client.h"
#include "diond/doorbells.h"
#include "diond/shm_arena.h"
#include "gtest/gtest.h"

namespace diond::client {
namespace {

const char* const kNames[] = {"w0", "w1", "b"};

std::vector<ParamSpec> Params() {
  return {{"w0", {8, 16}, DType::kF32, "matrices"},
          {"w1", {16, 16}, DType::kF32, "matrices"},
          {"b", {16}, DType::kF32, "vectors"}};
}

std::vector<GroupSpec> Groups() {
  GroupSpec m{"matrices", Algorithm::kMuon, {}};
  m.hyperparams.lr = 0.02;
  GroupSpec a{"vectors", Algorithm::kAdamW, {}};
  a.hyperparams.lr = 0.01;
  return {m, a};
}

// Backward's order: the bias and the last matrix first, then the first matrix.
const std::vector<std::vector<int32_t>> kBuckets = {{1, 2}, {0}};

std::vector<float> Values(size_t n, float scale, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + phase);
  return v;
}

void WriteGrad(const ShmArena& a, size_t i, int64_t step) {
  auto g = a.Grad(kNames[i]);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<float> v = Values(g->size(), 0.1f, static_cast<float>(step * 3 + i));
  std::memcpy(g->data(), v.data(), v.size() * sizeof(float));
}

std::string ParamBytes(const ShmArena& a, size_t i) {
  auto p = a.ParamBytes(kNames[i]);
  return p.ok() ? std::string(reinterpret_cast<const char*>(p->data()), p->size()) : "";
}

class OverlapClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto d = testing::StartTestDaemon(DIOND_BINARY);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    auto c = Client::Connect(daemon_->target);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  // A session and its arena, with the same initial weights every time.
  ShmArena NewArena(const std::string& name) {
    auto layout = client_->CreateSession(Params(), Groups(), {name});
    EXPECT_TRUE(layout.ok()) << layout.status();
    auto arena = ShmArena::Create(client_.get(), *layout);
    EXPECT_TRUE(arena.ok()) << arena.status();
    for (size_t i = 0; i < 3; ++i) {
      auto p = arena->Param(kNames[i]);
      const std::vector<float> v = Values(p->size(), 0.5f, static_cast<float>(i));
      std::memcpy(p->data(), v.data(), v.size() * sizeof(float));
    }
    return *std::move(arena);
  }
  static testing::TestDaemon* daemon_;
  std::unique_ptr<Client> client_;
};
testing::TestDaemon* OverlapClientTest::daemon_ = nullptr;

TEST_F(OverlapClientTest, OverlappedStepsEqualSynchronousStepsBitForBit) {
  ShmArena ref = NewArena("sync");
  ShmArena ov = NewArena("overlap");
  auto page = DoorbellPage::Create(client_.get(), ov.session_id(), kBuckets);
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->buckets(), 2);
  for (int64_t t = 1; t <= 4; ++t) {
    for (size_t i = 0; i < 3; ++i) WriteGrad(ref, i, t);
    auto want = client_->Step(ref.session_id(), t);
    ASSERT_TRUE(want.ok()) << want.status();

    StepOptions o;
    o.asynchronous = o.overlap = true;
    auto queued = client_->Step(ov.session_id(), t, o);
    ASSERT_TRUE(queued.ok()) << queued.status();
    EXPECT_TRUE(queued->queued);
    std::thread backward([&] {
      for (int k = 0; k < 2; ++k) {
        for (int32_t i : kBuckets[static_cast<size_t>(k)]) WriteGrad(ov, static_cast<size_t>(i), t);
        page->RingGradients(k, t);
      }
    });
    // The next forward: the first layer's bucket first.
    for (int k : {1, 0}) {
      absl::Status s = page->WaitWeights(k, t, absl::Now() + absl::Seconds(10));
      EXPECT_TRUE(s.ok()) << s;
    }
    backward.join();
    auto got = client_->WaitStep(ov.session_id(), t);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->update_norms, want->update_norms) << "step " << t;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(ParamBytes(ov, i), ParamBytes(ref, i)) << kNames[i] << " step " << t;
    }
  }
}

TEST_F(OverlapClientTest, AnAbandonedStepCommitsNothingAndRunsAgainSynchronously) {
  ShmArena ref = NewArena("sync-abandon");
  ShmArena ov = NewArena("overlap-abandon");
  auto page = DoorbellPage::Create(client_.get(), ov.session_id(), kBuckets);
  ASSERT_TRUE(page.ok()) << page.status();
  const std::string before = ParamBytes(ov, 0);
  StepOptions o;
  o.asynchronous = o.overlap = true;
  ASSERT_TRUE(client_->Step(ov.session_id(), 1, o).ok());
  for (int32_t i : kBuckets[0]) WriteGrad(ov, static_cast<size_t>(i), 1);
  page->RingGradients(0, 1);
  page->Abandon(1);
  absl::Status waited = page->WaitWeights(0, 1, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  auto failed = client_->WaitStep(ov.session_id(), 1);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kAborted) << failed.status();
  EXPECT_EQ(ParamBytes(ov, 0), before);
  // Step 1 again, synchronously, from every gradient: the synchronous session's numbers.
  for (size_t i = 0; i < 3; ++i) {
    WriteGrad(ov, i, 1);
    WriteGrad(ref, i, 1);
  }
  ASSERT_TRUE(client_->Step(ov.session_id(), 1).ok());
  ASSERT_TRUE(client_->Step(ref.session_id(), 1).ok());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(ParamBytes(ov, i), ParamBytes(ref, i)) << kNames[i];
}

TEST_F(OverlapClientTest, BadBucketsAreTheDaemonsInvalidArgument) {
  ShmArena ov = NewArena("overlap-bad");
  auto twice = DoorbellPage::Create(client_.get(), ov.session_id(), {{0, 1}, {1, 2}});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument) << twice.status();
  auto missing = DoorbellPage::Create(client_.get(), ov.session_id(), {{0}, {1}});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument) << missing.status();
  auto none = DoorbellPage::Create(client_.get(), ov.session_id(), {});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  // Nothing was bound: a good page registers now.
  auto good = DoorbellPage::Create(client_.get(), ov.session_id(), kBuckets);
  EXPECT_TRUE(good.ok()) << good.status();
}

}  // namespace
}  // namespace diond::client
