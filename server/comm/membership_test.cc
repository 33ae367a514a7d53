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

TEST(Coordinator, JoinValidatesWorldSizeRankAndDuplicates) {
  Coordinator c(Opts(3));
  auto bad = c.Join({0, 2, "h0", 11});
  EXPECT_THAT(bad.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(bad.status().message().find("--world_size=2"), std::string::npos) << bad.status();
  EXPECT_THAT(c.Join({3, 3, "h", 12}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(c.Join({1, 3, "h1", 21}).status(), IsOk());
  auto dup = c.Join({1, 3, "h1b", 22});
  EXPECT_THAT(dup.status(), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_NE(dup.status().message().find("rank 1"), std::string::npos);
  // Same incarnation again: idempotent, no new generation.
  const uint64_t g = c.GetMembership()->generation;
  EXPECT_EQ(c.Join({1, 3, "h1", 21})->generation, g);
}

TEST(Coordinator, CompletesThenLosesASilentRankAndTakesARestart) {
  Coordinator c(Opts(2));
  ASSERT_THAT(c.Join({0, 2, "h0", 1}).status(), IsOk());
  auto v = c.Join({1, 2, "h1", 2});
  ASSERT_THAT(v.status(), IsOk());
  EXPECT_TRUE(v->complete);
  const uint64_t g = v->generation;
  // Rank 0 keeps beating, rank 1 is silent: lost after peer_timeout - heartbeat_interval (400 ms).
  absl::SleepFor(absl::Milliseconds(250));
  ASSERT_THAT(c.Heartbeat(0, 1).status(), IsOk());
  c.CheckLiveness(absl::Now());
  EXPECT_TRUE(c.GetMembership()->complete);
  absl::SleepFor(absl::Milliseconds(250));
  c.CheckLiveness(absl::Now());
  auto after = c.GetMembership();
  EXPECT_FALSE(after->complete);
  EXPECT_GT(after->generation, g);
  EXPECT_NE(after->broken_reason.find("rank 1"), std::string::npos) << after->broken_reason;
  EXPECT_THAT(c.Heartbeat(1, 2).status(), StatusIs(absl::StatusCode::kNotFound));
  // A restarted daemon (new incarnation) takes the rank: a newer generation, complete again.
  ASSERT_THAT(c.Heartbeat(0, 1).status(), IsOk());
  auto back = c.Join({1, 2, "h1", 3});
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_TRUE(back->complete);
  EXPECT_GT(back->generation, after->generation);
}

TEST(Coordinator, RebuildStartsANewGeneration) {
  Coordinator c(Opts(1));
  auto v = c.Join({0, 1, "h", 5});
  ASSERT_THAT(v.status(), IsOk());
  JoinArgs again{0, 1, "h", 5, /*rebuild=*/true};
  EXPECT_EQ(c.Join(again)->generation, v->generation + 1);
}

TEST(GenerationPrefix, DiffersPerGenerationAndCoordinator) {
  EXPECT_NE(GenerationPrefix(1, 2), GenerationPrefix(1, 3));
  EXPECT_NE(GenerationPrefix(1, 2), GenerationPrefix(2, 2));
}

}  // namespace
}  // namespace diond::comm
