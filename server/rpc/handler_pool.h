// The threads that run the Optimizer service's handlers, off gRPC's callback threads.
//
// gRPC runs callback-API handlers on a few threads shared by every server and channel of the
// process (gRPC 1.51: cores / 2, at least 2). A handler that waits there (a world session's
// CreateSession agreeing on its plan with the other ranks, a Step computing or waiting in a
// collective for a slow peer, a checkpoint writing to disk) holds one of them; two such waits on a
// two-core daemon left none, and rank 0 then served no other call at all: not the Peer service
// (the other ranks' heartbeats, so they were declared lost), not a ListSessions. The Optimizer
// service therefore does its work here and finishes the call from this pool; gRPC's threads only
// accept calls and move bytes.
//
// Threads start on demand, up to `max_threads`, and stay until the pool is destroyed; past that
// cap work waits in FIFO order. Thread-safe.
#ifndef DIOND_SERVER_RPC_HANDLER_POOL_H_
#define DIOND_SERVER_RPC_HANDLER_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace diond::rpc {

class HandlerPool {
 public:
  explicit HandlerPool(int max_threads);
  // Runs what is queued, then joins every thread.
  ~HandlerPool();
  HandlerPool(const HandlerPool&) = delete;
  HandlerPool& operator=(const HandlerPool&) = delete;

  void Run(std::function<void()> work);

  int threads() const;  // started so far
  int busy() const;     // running work now

 private:
  void Loop();
  bool HasWorkOrStops() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_threads_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_HANDLER_POOL_H_
