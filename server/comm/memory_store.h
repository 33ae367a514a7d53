// The coordinator's in-memory KeyValueStore. Besides the blocking Wait it offers WaitAsync, so
// the Peer gRPC service can park a Wait call without holding a server thread.
//
// Thread-safety: thread-safe. Callbacks of WaitAsync run on the thread that completes them
// (a Set caller, or the store's timer thread), never under the store's lock.
#ifndef DIOND_SERVER_COMM_MEMORY_STORE_H_
#define DIOND_SERVER_COMM_MEMORY_STORE_H_

#include <functional>
#include <list>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/comm/key_value_store.h"

namespace diond::comm {

// Quotas of the store (flags --world_max_*; docs/OPERATIONS.md "Security"). Set refuses a key
// or value over its size, a new key past max_keys, or a total (keys plus values) past max_bytes
// with RESOURCE_EXHAUSTED naming the limit; nothing is stored then.
struct StoreLimits {
  int64_t max_key_bytes = 1024;
  int64_t max_value_bytes = int64_t{16} << 20;
  int64_t max_keys = 100000;
  int64_t max_bytes = int64_t{256} << 20;
};

class MemoryKeyValueStore : public KeyValueStore {
 public:
  explicit MemoryKeyValueStore(StoreLimits limits = {});
  ~MemoryKeyValueStore() override;  // fails pending WaitAsync calls with UNAVAILABLE

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

  // Calls `done` exactly once: OK when every key has a value, DEADLINE_EXCEEDED after `timeout`.
  void WaitAsync(std::vector<std::string> keys, absl::Duration timeout,
                 std::function<void(absl::Status)> done);
  // Fails every parked WaitAsync with UNAVAILABLE (before the server that parked them stops).
  void CancelWaiters();
  // Removes every key that starts with `prefix` (old generations' rendezvous data).
  void DeletePrefix(absl::string_view prefix);
  size_t size() const;
  int64_t bytes() const;  // keys plus values
  const StoreLimits& limits() const { return limits_; }

 private:
  struct Waiter {
    std::vector<std::string> keys;
    absl::Time deadline;
    std::function<void(absl::Status)> done;
  };
  bool HasAll(const std::vector<std::string>& keys) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Missing(const std::vector<std::string>& keys) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TimerLoop();

  const StoreLimits limits_;
  mutable absl::Mutex mu_;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::string, std::less<>> data_ ABSL_GUARDED_BY(mu_);
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread timer_;
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_MEMORY_STORE_H_
