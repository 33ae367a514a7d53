// ComputeThread (compute_thread.h): one thread runs every task, results and exceptions come
// back to the caller, nested calls run inline, the caller's log context goes with the task.
#include "server/session/compute_thread.h"

#include <pthread.h>

#include <atomic>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace diond::session {
namespace {

using ::diond::testing::StatusIs;

TEST(ComputeThread, RunsEveryTaskOnItsOneThreadWhoeverPostsIt) {
  ComputeThread compute;
  absl::Mutex mu;
  std::set<std::thread::id> ran_on;
  std::set<std::thread::id> callers;
  std::atomic<int> runs{0};
  std::vector<std::thread> posters;
  for (int p = 0; p < 4; ++p) {
    posters.emplace_back([&] {
      {
        absl::MutexLock lock(&mu);
        callers.insert(std::this_thread::get_id());
      }
      EXPECT_FALSE(compute.OnThread());
      for (int i = 0; i < 50; ++i) {
        compute.Run([&] {
          EXPECT_TRUE(compute.OnThread());
          absl::MutexLock lock(&mu);
          ran_on.insert(std::this_thread::get_id());
          runs.fetch_add(1);
        });
      }
    });
  }
  for (std::thread& t : posters) t.join();
  EXPECT_EQ(runs.load(), 200);
  EXPECT_EQ(compute.tasks_run(), 200);
  ASSERT_EQ(ran_on.size(), 1u);
  EXPECT_EQ(callers.count(*ran_on.begin()), 0u);
  EXPECT_NE(*ran_on.begin(), std::this_thread::get_id());
}

TEST(ComputeThread, TasksRunOneAtATime) {
  ComputeThread compute;
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  std::vector<std::thread> posters;
  for (int p = 0; p < 3; ++p) {
    posters.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        compute.Run([&] {
          const int now = inside.fetch_add(1) + 1;
          int seen = most.load();
          while (now > seen && !most.compare_exchange_weak(seen, now)) {
          }
          std::this_thread::sleep_for(std::chrono::microseconds(50));
          inside.fetch_sub(1);
        });
      }
    });
  }
  for (std::thread& t : posters) t.join();
  EXPECT_EQ(most.load(), 1);
}

TEST(ComputeThread, CallReturnsTheTasksStatus) {
  ComputeThread compute;
  EXPECT_TRUE(compute.Call([] { return absl::OkStatus(); }).ok());
  EXPECT_THAT(compute.Call([] { return absl::ResourceExhaustedError("12 bytes short"); }),
              StatusIs(absl::StatusCode::kResourceExhausted, "12 bytes short"));
  // Null: on the calling thread.
  std::thread::id where;
  EXPECT_THAT(CallOnCompute(nullptr,
                            [&] {
                              where = std::this_thread::get_id();
                              return absl::InvalidArgumentError("x");
                            }),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(where, std::this_thread::get_id());
  RunOnCompute(&compute, [&] { where = std::this_thread::get_id(); });
  EXPECT_NE(where, std::this_thread::get_id());
}

TEST(ComputeThread, NestedCallsRunInline) {
  ComputeThread compute;
  std::thread::id outer, inner;
  compute.Run([&] {
    outer = std::this_thread::get_id();
    // Would deadlock if it were queued behind the task that posts it.
    EXPECT_TRUE(compute
                    .Call([&] {
                      inner = std::this_thread::get_id();
                      return absl::OkStatus();
                    })
                    .ok());
  });
  EXPECT_EQ(outer, inner);
  EXPECT_EQ(compute.tasks_run(), 1);
}

TEST(ComputeThread, TheCallersLogContextGoesWithTheTask) {
  ComputeThread compute;
  LogContextSnapshot seen;
  {
    ScopedLogContext context("s-42", 7);
    compute.Run([&] { seen = CurrentLogContext(); });
  }
  EXPECT_EQ(seen.session, "s-42");
  EXPECT_EQ(seen.step, 7);
  // ... and does not stay behind on the compute thread.
  compute.Run([&] { seen = CurrentLogContext(); });
  EXPECT_EQ(seen.session, "");
  EXPECT_EQ(seen.step, -1);
}

TEST(ComputeThread, AnExceptionIsRethrownOnTheCallerAndTheThreadGoesOn) {
  ComputeThread compute;
  EXPECT_THROW(compute.Run([] { throw std::runtime_error("out of memory, say"); }),
               std::runtime_error);
  int v = 0;
  compute.Run([&] { v = 5; });
  EXPECT_EQ(v, 5);
}

TEST(ComputeThread, TheThreadIsNamed) {
  ComputeThread compute("diond-compute");
  char name[16] = {};
  compute.Run([&] { pthread_getname_np(pthread_self(), name, sizeof(name)); });
  EXPECT_STREQ(name, "diond-compute");
}

}  // namespace
}  // namespace diond::session
