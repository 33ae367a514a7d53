// Collectives across W real processes (comm_worker), W = 2, 3 and 4 on loopback. Each worker
// checks every collective against a local expectation and its byte counter against the ring
// formulas; here we check that all W exit 0 within an outer bound (Gloo can hang, P11).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"

namespace diond {
namespace {

using ::diond::testing::MakeTempDir;
using ::diond::testing::Subprocess;

class WorldCollectives : public ::testing::TestWithParam<int> {};

TEST_P(WorldCollectives, EveryCollectiveMatchesAndCountsRingBytes) {
  const int w = GetParam();
  const std::string dir = MakeTempDir("diond_world");
  std::vector<std::unique_ptr<Subprocess>> procs;
  for (int r = 0; r < w; ++r) {
    procs.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{COMM_WORKER, std::to_string(r), std::to_string(w), dir},
        absl::StrCat(dir, "/rank", r, ".log")));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int r = 0; r < w; ++r) {
    auto rc = procs[r]->Wait(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    ASSERT_TRUE(rc.has_value()) << "rank " << r << " hung; log:\n" << procs[r]->Log();
    EXPECT_EQ(*rc, 0) << "rank " << r << " log:\n" << procs[r]->Log();
    if (r == 0) std::printf("%s", procs[r]->Log().c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(W, WorldCollectives, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return absl::StrCat("W", info.param); });

}  // namespace
}  // namespace diond
