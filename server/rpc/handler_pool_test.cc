#include "server/rpc/handler_pool.h"

#include <atomic>
#include <memory>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

// Work that blocks (a world agreement, a collective) never keeps other work from running while
// the cap allows a thread more: that is what the pool is for.
TEST(HandlerPool, BlockedWorkDoesNotStallOtherWork) {
  HandlerPool pool(8);
  absl::Notification release;
  std::atomic<int> blocked_started{0};
  for (int i = 0; i < 4; ++i) {
    pool.Run([&] {
      blocked_started.fetch_add(1);
      release.WaitForNotification();
    });
  }
  absl::Notification quick;
  pool.Run([&] { quick.Notify(); });
  EXPECT_TRUE(quick.WaitForNotificationWithTimeout(absl::Seconds(30)))
      << "work queued behind 4 blocked items did not run";
  EXPECT_EQ(pool.threads(), 5);
  release.Notify();
}

// Past the cap, work waits its turn (FIFO) and runs once a thread is free.
TEST(HandlerPool, PastTheCapWorkWaitsForAFreeThread) {
  HandlerPool pool(2);
  absl::Notification release;
  std::atomic<int> started{0};
  for (int i = 0; i < 2; ++i) {
    pool.Run([&] {
      started.fetch_add(1);
      release.WaitForNotification();
    });
  }
  absl::Notification third;
  pool.Run([&] { third.Notify(); });
  EXPECT_FALSE(third.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  EXPECT_EQ(pool.threads(), 2);
  release.Notify();
  EXPECT_TRUE(third.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

// Idle threads are reused: sequential work does not start a thread each.
TEST(HandlerPool, IdleThreadsAreReused) {
  HandlerPool pool(16);
  for (int i = 0; i < 50; ++i) {
    absl::Notification done;
    pool.Run([&] { done.Notify(); });
    done.WaitForNotification();
    // The thread that ran it goes back to waiting; let it get there.
    for (int k = 0; k < 1000 && pool.busy() > 0; ++k) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_LE(pool.threads(), 2);
}

// Destruction runs what was queued, then joins.
TEST(HandlerPool, DestructionRunsWhatWasQueued) {
  std::atomic<int> ran{0};
  {
    HandlerPool pool(1);
    for (int i = 0; i < 10; ++i) pool.Run([&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 10);
}

}  // namespace
}  // namespace diond::rpc
