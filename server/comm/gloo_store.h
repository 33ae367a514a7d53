// Adapter from Gloo's rendezvous::Store to our KeyValueStore, with a key prefix per rendezvous.
//
// Gloo's FileStore cannot reuse a directory and a rebuilt world must never read the previous
// world's addresses (TOOLCHAIN.md P12), so every generation of a world rendezvous under its own
// prefix, e.g. "world/<coordinator incarnation>/g<generation>/gloo/". Gloo expects exceptions
// from a store, so failures are thrown as gloo::IoException (caught by GlooCommunicator).
//
// Thread-safety: as thread-safe as the underlying KeyValueStore.
#ifndef DIOND_SERVER_COMM_GLOO_STORE_H_
#define DIOND_SERVER_COMM_GLOO_STORE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "server/comm/key_value_store.h"

namespace diond::comm {

class GlooStore : public gloo::rendezvous::Store {
 public:
  // `kv` must outlive the adapter. `timeout` bounds get() and the one-argument wait().
  GlooStore(KeyValueStore* kv, std::string prefix, absl::Duration timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits up to the timeout for the key, as Gloo's own stores do.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  const std::string& prefix() const { return prefix_; }
  std::string Key(const std::string& key) const { return prefix_ + key; }

 private:
  KeyValueStore* kv_;
  std::string prefix_;
  absl::Duration timeout_;
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_GLOO_STORE_H_
