// Agreement among the ranks of a world through the rendezvous store (ARCHITECTURE.md §6): each
// rank publishes one value under a shared key prefix and reads every rank's, so that all of them
// can check that they hold the same thing (a world session's shard plan, docs/DISTRIBUTED.md)
// before any collective runs. The store, not a communicator, carries it: it works while the
// world's communicator is still forming, and a rank that never comes is a timeout, not a hang.
//
// Thread-safety: thread-safe (the store is).
#ifndef DIOND_SERVER_COMM_AGREEMENT_H_
#define DIOND_SERVER_COMM_AGREEMENT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/comm/key_value_store.h"

namespace diond::comm {

// Publishes `value` as rank `rank`'s under "<prefix><rank>", then waits up to `timeout` for all
// `size` ranks' values and returns them by rank. A prefix must be used once per agreement (a
// rank's earlier value would count as published).
// Errors: the store's (UNAVAILABLE when unreachable). When the wait fails (DEADLINE_EXCEEDED:
// a rank did not publish in time), `missing` (may be null) is set to the ranks whose values are
// still missing then; it is left alone otherwise.
absl::StatusOr<std::vector<std::string>> ExchangeValues(KeyValueStore& kv,
                                                        const std::string& prefix, int rank,
                                                        int size, absl::string_view value,
                                                        absl::Duration timeout,
                                                        std::optional<std::vector<int>>* missing);

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_AGREEMENT_H_
