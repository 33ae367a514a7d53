// In-process checks of the Gloo backend with two ranks on threads (the W = 2, 3, 4 checks across
// real processes are in tests/world). Outer bound: every wait is bounded by a 5 s Gloo timeout.
#include "server/comm/gloo_communicator.h"

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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
  EXPECT_THAT((*c)->AllToAll(in, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*c)->Broadcast(absl::MakeSpan(out), 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // W = 1: everything is a copy and sends nothing.
  std::vector<float> one{1, 2, 3}, got(3);
  ASSERT_THAT((*c)->AllGather(one, absl::MakeSpan(got)), IsOk());
  EXPECT_EQ(got, one);
  EXPECT_EQ((*c)->bytes_sent(), 0);
}

// Regression: a rank that is slow to copy a result out of the cached buffers must still get
// that call's data, although its peer has already returned and started the next call of the
// same op and size (gloo::AllgatherRing wrote that next block straight into the slow rank's
// output buffer: a world step on a busy machine applied the owner's next update). Rank 0 is
// made slow deterministically, between its first transfer and its copy-out; rank 1 sends a
// second, different block at once. Every collective on cached buffers is checked alike
// (all-reduce and reduce-scatter were never affected: their peers write into internal inboxes).
TEST(GlooCommunicator, SlowRankStillGetsEachCallsDataWhenItsPeerIsOneCallAhead) {
  using Op =
      std::function<absl::Status(GlooCommunicator&, int rank, int call, std::vector<float>* out)>;
  const int64_t n = 4096;
  // What rank `rank` contributes to call `call`; every element distinct.
  auto value = [](int rank, int call, int64_t e) {
    return static_cast<float>(rank * 1000000 + call * 100000 + e);
  };
  const std::vector<std::pair<std::string, Op>> ops = {
      {"all_gather_v",
       [&](GlooCommunicator& c, int rank, int call, std::vector<float>* out) {
         std::vector<float> in(static_cast<size_t>(rank == 0 ? n : n - 5));
         for (size_t e = 0; e < in.size(); ++e) in[e] = value(rank, call, e);
         const std::vector<int64_t> counts = {n, n - 5};
         out->assign(static_cast<size_t>(2 * n - 5), -1.0f);
         return c.AllGatherV(in, counts, absl::MakeSpan(*out));
       }},
      {"all_gather",
       [&](GlooCommunicator& c, int rank, int call, std::vector<float>* out) {
         std::vector<float> in(static_cast<size_t>(n));
         for (int64_t e = 0; e < n; ++e) in[e] = value(rank, call, e);
         out->assign(static_cast<size_t>(2 * n), -1.0f);
         return c.AllGather(in, absl::MakeSpan(*out));
       }},
      {"all_reduce",
       [&](GlooCommunicator& c, int rank, int call, std::vector<float>* out) {
         out->assign(static_cast<size_t>(2 * n), 0.0f);
         for (int64_t e = 0; e < 2 * n; ++e) (*out)[e] = rank == 0 ? 0.0f : value(1, call, e);
         return c.AllReduceSum(absl::MakeSpan(*out));
       }},
      {"reduce_scatter",
       [&](GlooCommunicator& c, int rank, int call, std::vector<float>* out) {
         std::vector<float> in(static_cast<size_t>(2 * n), 0.0f);
         for (int64_t e = 0; e < 2 * n; ++e) in[e] = rank == 0 ? 0.0f : value(1, call, e);
         out->assign(static_cast<size_t>(n), -1.0f);
         return c.ReduceScatterSum(in, absl::MakeSpan(*out));
       }},
      {"all_to_all",
       [&](GlooCommunicator& c, int rank, int call, std::vector<float>* out) {
         std::vector<float> in(static_cast<size_t>(2 * n));
         for (int64_t e = 0; e < 2 * n; ++e) in[e] = value(rank, call, e);
         out->assign(static_cast<size_t>(2 * n), -1.0f);
         return c.AllToAll(in, absl::MakeSpan(*out));
       }},
  };
  int case_number = 0;
  for (const auto& entry : ops) {
    // Not a structured binding: a lambda may not capture one in C++17 (clang refuses).
    const std::string& name = entry.first;
    const Op& op = entry.second;
    SCOPED_TRACE(name);
    MemoryKeyValueStore kv;
    const std::string prefix = absl::StrCat("t5-", case_number++, "/");
    std::atomic<bool> slow{true};
    GlooOptions o0 = Opts(0, 2, prefix);
    o0.after_transfer_for_testing = [&slow](CollectiveOp) {
      if (slow.exchange(false)) absl::SleepFor(absl::Milliseconds(300));
    };
    std::unique_ptr<GlooCommunicator> c1;
    std::thread t([&] { c1 = *GlooCommunicator::Create(&kv, Opts(1, 2, prefix)); });
    auto c0 = GlooCommunicator::Create(&kv, o0);
    t.join();
    ASSERT_THAT(c0.status(), IsOk());
    ASSERT_NE(c1, nullptr);
    std::vector<float> got0[2], got1[2];
    absl::Status s1[2];
    std::thread t1([&] {
      for (int call = 0; call < 2; ++call) s1[call] = op(*c1, 1, call, &got1[call]);
    });
    absl::Status s0[2];
    for (int call = 0; call < 2; ++call) s0[call] = op(**c0, 0, call, &got0[call]);
    t1.join();
    for (int call = 0; call < 2; ++call) {
      SCOPED_TRACE(absl::StrCat("call ", call));
      ASSERT_THAT(s0[call], IsOk());
      ASSERT_THAT(s1[call], IsOk());
      if (name == "all_reduce" || name == "reduce_scatter") {
        // Rank 0 contributes zeros: its sum (all of it, or its block) is rank 1's input.
        const int64_t len = name == "all_reduce" ? 2 * n : n;
        for (int64_t e = 0; e < len; ++e) {
          ASSERT_EQ(got0[call][static_cast<size_t>(e)], value(1, call, e)) << "element " << e;
        }
        continue;
      }
      // Rank 1's block as rank 0 received it, element by element (all-to-all: rank 1's block
      // for rank 0 is the first half of its input; the gathers: rank 1's input).
      const int64_t len = name == "all_gather_v" ? n - 5 : n;
      for (int64_t e = 0; e < len; ++e) {
        ASSERT_EQ(got0[call][static_cast<size_t>(n + e)], value(1, call, e)) << "element " << e;
      }
      // And rank 0's block as rank 1 received it.
      const int64_t from0 = name == "all_to_all" ? n : 0;
      for (int64_t e = 0; e < n; ++e) {
        ASSERT_EQ(got1[call][static_cast<size_t>(e)], value(0, call, from0 + e)) << "element " << e;
      }
    }
  }
}

}  // namespace
}  // namespace diond::comm
