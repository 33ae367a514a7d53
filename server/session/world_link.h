// The daemon world as world sessions reach it (docs/DISTRIBUTED.md). The Daemon destroys its
// World at shutdown while a step may still be in flight; SessionManager::DetachWorld clears the
// link first, so such a step sees "the daemon is shutting down" instead of a dangling pointer.
// Calls through the link are short (status, communicator, epoch, membership); nothing blocks
// while holding it.
//
// Thread-safety: thread-safe.
#ifndef DIOND_SERVER_SESSION_WORLD_LINK_H_
#define DIOND_SERVER_SESSION_WORLD_LINK_H_

#include <functional>

#include "absl/synchronization/mutex.h"
#include "server/comm/world.h"

namespace diond::session {

class WorldLink {
 public:
  explicit WorldLink(comm::World* world)
      : rank_(world->rank()), size_(world->size()), world_(world) {}

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Runs f(world) under the link's lock while the world is attached; returns false (without
  // calling f) after Clear().
  bool With(const std::function<void(comm::World&)>& f) {
    absl::MutexLock lock(&mu_);
    if (world_ == nullptr) return false;
    f(*world_);
    return true;
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    world_ = nullptr;
  }

 private:
  const int rank_, size_;
  absl::Mutex mu_;
  comm::World* world_ ABSL_GUARDED_BY(mu_);
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_WORLD_LINK_H_
