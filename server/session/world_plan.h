// The world part of creating a world session (docs/DISTRIBUTED.md "Shard plan"): before it
// exists, every rank's trainer must have created the same world session, and every rank must
// have computed the same shard plan from it. The ranks agree through the world's rendezvous
// store (comm/agreement.h), once the world's communicator is up.
//
// Thread-safety: stateless functions; the link and the store are thread-safe.
#ifndef DIOND_SERVER_SESSION_WORLD_PLAN_H_
#define DIOND_SERVER_SESSION_WORLD_PLAN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/comm/key_value_store.h"
#include "server/session/shard_plan.h"
#include "server/session/world_link.h"

namespace diond::session {

// A world_key: at most 128 of [A-Za-z0-9._-] (it becomes part of store keys). INVALID_ARGUMENT
// naming it otherwise.
absl::Status ValidateWorldKey(const std::string& key);

// Waits up to `timeout` for the world's communicator (polled: the link is never held for long)
// and returns its generation. UNAVAILABLE "<where>the daemon world is not up: ..." otherwise,
// or when the link is cleared (shutdown).
absl::StatusOr<uint64_t> WaitForWorld(WorldLink& world, absl::Duration timeout,
                                      const std::string& where);

// Publishes `plan`'s hash as this rank's for the `use`-th creation of world session `key` in
// generation `epoch` and compares every rank's. UNAVAILABLE naming the ranks whose trainers did
// not create the session within `timeout`; FAILED_PRECONDITION naming the ranks whose plan
// differs, with every rank's hash. `where` starts every message.
absl::Status AgreeOnShardPlan(const ShardPlan& plan, const WorldLink& world,
                              comm::KeyValueStore& kv, uint64_t epoch, const std::string& key,
                              int64_t use, absl::Duration timeout, const std::string& where);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_WORLD_PLAN_H_
