#include "server/rpc/handler_pool.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

namespace diond::rpc {

HandlerPool::HandlerPool(int max_threads) : max_threads_(std::max(1, max_threads)) {}

HandlerPool::~HandlerPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

void HandlerPool::Run(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
  // A new thread when none is idle for this work and the cap allows one.
  if (idle_ < static_cast<int>(queue_.size()) && static_cast<int>(threads_.size()) < max_threads_) {
    threads_.emplace_back([this] { Loop(); });
  }
}

int HandlerPool::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

int HandlerPool::busy() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

bool HandlerPool::HasWorkOrStops() const { return stopping_ || !queue_.empty(); }

void HandlerPool::Loop() {
  // Named for top -H / gdb (a thread otherwise inherits its creator's name, gRPC's).
  pthread_setname_np(pthread_self(), "diond-rpc");
  mu_.Lock();
  for (;;) {
    // Idle from here until work is taken (busy_ and idle_ change under one hold of the lock, so
    // Run never sees a thread that just finished as neither).
    ++idle_;
    mu_.Await(absl::Condition(this, &HandlerPool::HasWorkOrStops));
    --idle_;
    if (queue_.empty()) break;  // stopping, and nothing left to run
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    mu_.Unlock();
    work();
    work = nullptr;  // what it captured goes before the next wait
    mu_.Lock();
    --busy_;
  }
  mu_.Unlock();
}

}  // namespace diond::rpc
