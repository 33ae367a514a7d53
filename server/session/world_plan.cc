#include "server/session/world_plan.h"

#include <cctype>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "server/comm/agreement.h"
#include "server/comm/world.h"

namespace diond::session {

absl::Status ValidateWorldKey(const std::string& key) {
  if (key.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_key of ", key.size(), " bytes: at most 128"));
  }
  for (char c : key) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world_key '", Bounded(key), "' may only contain letters, digits, '-', '_' and '.'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> WaitForWorld(WorldLink& world, absl::Duration timeout,
                                      const std::string& where) {
  absl::Status ready = absl::UnavailableError("the daemon is shutting down");
  uint64_t epoch = 0;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (!world.With([&](comm::World& w) {
          ready = w.status();
          epoch = w.epoch();
        })) {
      ready = absl::UnavailableError("the daemon is shutting down");
      break;
    }
    if (ready.ok() || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (!ready.ok()) {
    return absl::UnavailableError(
        absl::StrCat(where, "the daemon world is not up: ", ready.message()));
  }
  return epoch;
}

absl::Status AgreeOnShardPlan(const ShardPlan& plan, const WorldLink& world,
                              comm::KeyValueStore& kv, uint64_t epoch, const std::string& key,
                              int64_t use, absl::Duration timeout, const std::string& where) {
  const std::string mine = ShardPlanHashHex(plan.hash);
  const std::string prefix =
      absl::StrCat("diond/world_session/", epoch, "/", key, "/", use, "/plan/");
  std::optional<std::vector<int>> missing;
  absl::StatusOr<std::vector<std::string>> hashes =
      comm::ExchangeValues(kv, prefix, world.rank(), world.size(), mine, timeout, &missing);
  if (!hashes.ok() && missing.has_value()) {
    return absl::UnavailableError(
        absl::StrCat(where, "the trainers of rank(s) ", absl::StrJoin(*missing, ", "),
                     " did not create it within ", absl::FormatDuration(timeout), ": ",
                     hashes.status().message()));
  }
  DIOND_RETURN_IF_ERROR(hashes.status());
  std::vector<std::string> listed;
  std::vector<int> differ;
  for (int r = 0; r < world.size(); ++r) {
    listed.push_back(absl::StrCat("rank ", r, ": ", (*hashes)[r]));
    if ((*hashes)[r] != mine) differ.push_back(r);
  }
  if (!differ.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "the ranks disagree on the shard plan; rank(s) ", absl::StrJoin(differ, ", "),
        " declared different parameters, shapes, dtypes, groups, options or gradient_sync than "
        "rank ",
        world.rank(), " (plan hashes ", absl::StrJoin(listed, ", "), ")"));
  }
  return absl::OkStatus();
}

}  // namespace diond::session
