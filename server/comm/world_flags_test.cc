#include "server/comm/world_flags.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::comm {
namespace {

using ::diond::testing::StatusIs;

TEST(DeriveRank, FlagThenJobIndexThenOrdinal) {
  EXPECT_EQ(*DeriveRank(2, 4, "diond-3", "1"), 2);
  EXPECT_EQ(*DeriveRank(-1, 4, "diond-3", "1"), 1);
  EXPECT_EQ(*DeriveRank(-1, 4, "diond-3", nullptr), 3);
  EXPECT_EQ(*DeriveRank(-1, 4, "diond-3.diond-peers.ns.svc", ""), 3);
  EXPECT_EQ(*DeriveRank(-1, 1, "laptop", nullptr), 0);
  EXPECT_THAT(DeriveRank(-1, 2, "laptop", nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DeriveRank(-1, 2, "diond-5", nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DeriveRank(-1, 2, "x", "abc").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CoordinatorFromService, StatefulSetPodZero) {
  EXPECT_EQ(*CoordinatorFromService("trainer-diond-7", "diond-peers", 50551),
            "trainer-diond-0.diond-peers:50551");
  EXPECT_THAT(CoordinatorFromService("laptop", "svc", 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace diond::comm
