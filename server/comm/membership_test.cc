#include "server/comm/membership.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

CoordinatorOptions Opts(int w) {
  CoordinatorOptions o;
  o.world_size = w;
  o.heartbeat_interval = absl::Milliseconds(100);
  o.peer_timeout = absl::Milliseconds(500);
  return o;
}

// Each rank's process proves itself with its own proof.
std::string P(int rank) { return std::string(16, static_cast<char>('a' + rank)); }
JoinArgs J(int rank, int world_size, const std::string& address, uint64_t incarnation) {
  JoinArgs a;
  a.rank = rank;
  a.world_size = world_size;
  a.address = address;
  a.incarnation = incarnation;
  a.proof = P(rank);
  return a;
}

TEST(Coordinator, JoinValidatesWorldSizeRankAndDuplicates) {
  Coordinator c(Opts(3));
  auto bad = c.Join(J(0, 2, "h0", 11));
  EXPECT_THAT(bad.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(bad.status().message().find("--world_size=2"), std::string::npos) << bad.status();
  EXPECT_THAT(c.Join(J(3, 3, "h", 12)).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(c.Join(J(1, 3, "h1", 21)).status(), IsOk());
  auto dup = c.Join(J(1, 3, "h1b", 22));
  EXPECT_THAT(dup.status(), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_NE(dup.status().message().find("rank 1"), std::string::npos);
  // Same incarnation again: idempotent, no new generation.
  const uint64_t g = c.GetMembership()->generation;
  EXPECT_EQ(c.Join(J(1, 3, "h1", 21))->generation, g);
}

TEST(Coordinator, CompletesThenLosesASilentRankAndTakesARestart) {
  Coordinator c(Opts(2));
  ASSERT_THAT(c.Join(J(0, 2, "h0", 1)).status(), IsOk());
  auto v = c.Join(J(1, 2, "h1", 2));
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_TRUE(v->complete);
  const uint64_t g = v->generation;
  // Rank 0 keeps beating, rank 1 is silent: lost after peer_timeout - heartbeat_interval (400 ms).
  absl::SleepFor(absl::Milliseconds(250));
  ASSERT_THAT(c.Heartbeat(0, 1, P(0)).status(), IsOk());
  c.CheckLiveness(absl::Now());
  EXPECT_TRUE(c.GetMembership()->complete);
  absl::SleepFor(absl::Milliseconds(250));
  c.CheckLiveness(absl::Now());
  auto after = c.GetMembership();
  EXPECT_FALSE(after->complete);
  EXPECT_GT(after->generation, g);
  EXPECT_NE(after->broken_reason.find("rank 1"), std::string::npos) << after->broken_reason;
  EXPECT_THAT(c.Heartbeat(1, 2, P(1)).status(), StatusIs(absl::StatusCode::kNotFound));
  // A restarted daemon (new incarnation) takes the rank: a newer generation, complete again.
  ASSERT_THAT(c.Heartbeat(0, 1, P(0)).status(), IsOk());
  auto back = c.Join(J(1, 2, "h1", 3));
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_TRUE(back->complete);
  EXPECT_GT(back->generation, after->generation);
}

TEST(Coordinator, RebuildStartsANewGeneration) {
  Coordinator c(Opts(1));
  auto v = c.Join(J(0, 1, "h", 5));
  ASSERT_THAT(v.status(), IsOk());
  JoinArgs again = J(0, 1, "h", 5);
  again.rebuild = true;
  EXPECT_EQ(c.Join(again)->generation, v->generation + 1);
}

// The membership is not a secret: a stranger who read it (rank, address, incarnation) can neither
// take a live rank over with a forged address nor keep a dead one alive with forged heartbeats.
TEST(Coordinator, ForgedJoinsAndHeartbeatsWithoutTheProofAreRefused) {
  Coordinator c(Opts(2));
  ASSERT_THAT(c.Join(J(0, 2, "h0", 1)).status(), IsOk());
  ASSERT_THAT(c.Join(J(1, 2, "h1", 2)).status(), IsOk());
  const MembershipView before = *c.GetMembership();
  JoinArgs forged = J(1, 2, "evil.example", 2);  // the incarnation is public
  forged.proof = std::string(16, 'z');
  EXPECT_THAT(c.Join(forged).status(), StatusIs(absl::StatusCode::kPermissionDenied));
  forged.proof.clear();
  EXPECT_THAT(c.Join(forged).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.Heartbeat(1, 2, std::string(16, 'z')).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(c.Heartbeat(1, 2, "").status(), StatusIs(absl::StatusCode::kPermissionDenied));
  const MembershipView after = *c.GetMembership();
  EXPECT_EQ(after.generation, before.generation);
  ASSERT_EQ(after.members.size(), 2u);
  EXPECT_EQ(after.members[1].address, "h1");  // the forged address was never listed
  // Rank 1 falls silent: forged heartbeats do not keep it alive, so it is declared lost.
  for (int i = 0; i < 6; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    c.Heartbeat(0, 1, P(0)).IgnoreError();
    c.Heartbeat(1, 2, std::string(16, 'z')).IgnoreError();
  }
  c.CheckLiveness(absl::Now());
  EXPECT_FALSE(c.GetMembership()->complete);
  // The genuine process re-joins with its proof.
  EXPECT_THAT(c.Join(J(1, 2, "h1", 2)).status(), IsOk());
}

// Found by peer_fuzz: the refusal of a second daemon echoed the holder's address raw.
TEST(Coordinator, TheHoldersAddressIsEchoedOnOneLine) {
  Coordinator c(Opts(2));
  ASSERT_THAT(c.Join(J(1, 2, "10.0.0.1\nX-Injected: 1", 7)), IsOk());
  auto second = c.Join(J(1, 2, "10.0.0.2", 8));
  EXPECT_THAT(second.status(), StatusIs(absl::StatusCode::kAlreadyExists,
                                        ::testing::HasSubstr("10.0.0.1?X-Injected")));
  EXPECT_EQ(std::string(second.status().message()).find('\n'), std::string::npos);
}

TEST(Coordinator, AddressesAreLengthBounded) {
  Coordinator c(Opts(1));
  auto big = c.Join(J(0, 1, std::string(3 << 20, 'a'), 7));  // Found 2: a 3 MiB address
  EXPECT_THAT(big.status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_LT(big.status().message().size(), 200u);
  EXPECT_TRUE(c.GetMembership()->members.empty());
  EXPECT_THAT(c.Join(J(0, 1, std::string(kMaxMemberAddressBytes, 'a'), 7)).status(), IsOk());
}

TEST(GenerationPrefix, DiffersPerGenerationAndCoordinator) {
  EXPECT_NE(GenerationPrefix(1, 2), GenerationPrefix(1, 3));
  EXPECT_NE(GenerationPrefix(1, 2), GenerationPrefix(2, 2));
}

}  // namespace
}  // namespace diond::comm
