// In-process checks of the Gloo backend with two ranks on threads (the W = 2, 3, 4 checks across
// real processes are in tests/world). Outer bound: every wait is bounded by a 5 s Gloo timeout.
#include "server/comm/gloo_communicator.h"

#include <thread>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/comm/memory_store.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

GlooOptions Opts(int rank, int size, const std::string& prefix) {
  GlooOptions o;
  o.rank = rank;
  o.size = size;
  o.prefix = prefix;
  o.timeout = absl::Seconds(5);
  return o;
}

TEST(GlooCommunicator, TwoThreadsAllReduceAndCountBytes) {
  MemoryKeyValueStore kv;
  std::unique_ptr<GlooCommunicator> c[2];
  std::thread t([&] { c[1] = *GlooCommunicator::Create(&kv, Opts(1, 2, "t1/")); });
  auto c0 = GlooCommunicator::Create(&kv, Opts(0, 2, "t1/"));
  t.join();
  ASSERT_THAT(c0.status(), IsOk());
  c[0] = std::move(*c0);
  ASSERT_NE(c[1], nullptr);
  const int n = 1 << 16;
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  absl::Status s1;
  std::thread t1([&] { s1 = c[1]->AllReduceSum(absl::MakeSpan(b)); });
  ASSERT_THAT(c[0]->AllReduceSum(absl::MakeSpan(a)), IsOk());
  t1.join();
  ASSERT_THAT(s1, IsOk());
  EXPECT_EQ(a[0], 3.0f);
  EXPECT_EQ(b[n - 1], 3.0f);
  // Ring all-reduce sends 2(W-1)/W of the buffer: exactly the buffer for W = 2.
  EXPECT_EQ(c[0]->bytes_sent(), int64_t{n} * 4);
  EXPECT_EQ(c[0]->TakeBytesSent(), int64_t{n} * 4);
  EXPECT_EQ(c[0]->bytes_sent(), 0);
}

TEST(GlooCommunicator, LostPeerFailsWithUnavailableNamingItsRank) {
  MemoryKeyValueStore kv;
  std::unique_ptr<GlooCommunicator> peer;
  std::thread t([&] { peer = *GlooCommunicator::Create(&kv, Opts(1, 2, "t2/")); });
  auto c = GlooCommunicator::Create(&kv, Opts(0, 2, "t2/"));
  t.join();
  ASSERT_THAT(c.status(), IsOk());
  peer.reset();  // closes rank 1's sockets
  std::vector<float> a(1024, 1.0f);
  const absl::Time t0 = absl::Now();
  absl::Status s = (*c)->AllReduceSum(absl::MakeSpan(a));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(7));
  // Aborted from now on, at once.
  EXPECT_THAT((*c)->Barrier(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT((*c)->status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(GlooCommunicator, RendezvousTimesOutWhenAPeerNeverComes) {
  MemoryKeyValueStore kv;
  GlooOptions o = Opts(0, 2, "t3/");
  o.timeout = absl::Milliseconds(300);
  auto c = GlooCommunicator::Create(&kv, o);
  EXPECT_THAT(c.status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(GlooCommunicator, SizeMismatchesAreInvalidArgument) {
  MemoryKeyValueStore kv;
  auto c = GlooCommunicator::Create(&kv, Opts(0, 1, "t4/"));
  ASSERT_THAT(c.status(), IsOk());
  std::vector<float> in(3), out(2);
  EXPECT_THAT((*c)->ReduceScatterSum(in, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*c)->AllToAll(in, absl::MakeSpan(out)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*c)->Broadcast(absl::MakeSpan(out), 1), StatusIs(absl::StatusCode::kInvalidArgument));
  // W = 1: everything is a copy and sends nothing.
  std::vector<float> one{1, 2, 3}, got(3);
  ASSERT_THAT((*c)->AllGather(one, absl::MakeSpan(got)), IsOk());
  EXPECT_EQ(got, one);
  EXPECT_EQ((*c)->bytes_sent(), 0);
}

}  // namespace
}  // namespace diond::comm
