// The rendezvous key-value store every daemon of a world shares (ARCHITECTURE.md §6).
//
// Domain interface: rank 0 holds the data in a MemoryKeyValueStore (memory_store.h) and serves
// it over the Peer gRPC service; other ranks reach it through rpc::PeerClient, which implements
// this interface. Gloo's rendezvous and NCCL's unique-id exchange both go through it, each under
// a per-generation key prefix (gloo_store.h).
//
// Thread-safety: implementations are thread-safe.
#ifndef DIOND_SERVER_COMM_KEY_VALUE_STORE_H_
#define DIOND_SERVER_COMM_KEY_VALUE_STORE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace diond::comm {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Stores `value` under `key`, replacing an earlier value. UNAVAILABLE if the store is
  // unreachable.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // NOT_FOUND if `key` has no value; UNAVAILABLE if the store is unreachable.
  virtual absl::StatusOr<std::string> Get(absl::string_view key) = 0;
  // Blocks until every key has a value (OK), or until `timeout` passes (DEADLINE_EXCEEDED naming
  // the missing keys). UNAVAILABLE if the store is unreachable.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_KEY_VALUE_STORE_H_
