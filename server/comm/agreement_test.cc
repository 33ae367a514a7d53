#include "server/comm/agreement.h"

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/memory_store.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::ElementsAre;

TEST(ExchangeValues, EveryRankReadsEveryRanksValueByRank) {
  MemoryKeyValueStore kv;
  std::vector<absl::StatusOr<std::vector<std::string>>> got(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      got[r] = ExchangeValues(kv, "p/", r, 3, r == 1 ? "b" : "a", absl::Seconds(30), nullptr);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk());
    EXPECT_THAT(*got[r], ElementsAre("a", "b", "a"));
  }
}

TEST(ExchangeValues, ARankThatNeverPublishesIsNamed) {
  MemoryKeyValueStore kv;
  ASSERT_THAT(kv.Set("p/2", "a"), IsOk());
  std::optional<std::vector<int>> missing;
  auto got = ExchangeValues(kv, "p/", 0, 3, "a", absl::Milliseconds(50), &missing);
  EXPECT_THAT(got, StatusIs(absl::StatusCode::kDeadlineExceeded));
  ASSERT_TRUE(missing.has_value());
  EXPECT_THAT(*missing, ElementsAre(1));
}

}  // namespace
}  // namespace diond::comm
