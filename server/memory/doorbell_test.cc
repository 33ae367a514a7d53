// Doorbells on real POSIX shm: the header checks, the waits (order rung, deadline, cancel, a
// trainer ahead, a trainer that abandons the step, a segment truncated under the wait), and the
// handshake with the Python client's half (client/python/diond/doorbell.py) in another process.
#include "server/memory/doorbell.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/memory/testing/shm_segment.h"

namespace diond::memory {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

// A segment of the test's (the trainer's side), mapped, unlinked at the end.
class Segment : public testing::ShmTestSegment {
 public:
  explicit Segment(int64_t bytes) : ShmTestSegment("diond-doorbell-test", bytes) {}
  // The header the client libraries write.
  void Format(uint32_t buckets, const char* magic = "DIONDDB1", uint32_t version = 1) {
    std::memcpy(data(), magic, 8);
    std::memcpy(data() + 8, &version, 4);
    std::memcpy(data() + 12, &buckets, 4);
  }
  void Ring(int k, int64_t step) {
    __atomic_store_n(reinterpret_cast<int64_t*>(data() + 64 + (64 * static_cast<ptrdiff_t>(k))),
                     step, __ATOMIC_RELEASE);
  }
  std::unique_ptr<ShmRegion> Open() {
    auto r = ShmRegion::Open(name(), 0, bytes(), "session-1");
    EXPECT_THAT(r.status(), IsOk());
    return r.ok() ? *std::move(r) : nullptr;
  }
};

constexpr auto kNever = [] { return false; };

TEST(Doorbells, TheHeaderIsChecked) {
  EXPECT_EQ(Doorbells::BytesFor(3), 64 + 3 * 64);
  Segment seg(4096);
  std::unique_ptr<ShmRegion> region = seg.Open();
  ASSERT_NE(region, nullptr);
  seg.Format(3);
  absl::StatusOr<Doorbells> ok = Doorbells::Attach(region.get());
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_EQ(ok->buckets(), 3);

  seg.Format(3, "DIONDDB2");
  EXPECT_THAT(Doorbells::Attach(region.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DIONDDB1")));
  seg.Format(3, "DIONDDB1", 2);
  EXPECT_THAT(Doorbells::Attach(region.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 2")));
  seg.Format(0);
  EXPECT_THAT(Doorbells::Attach(region.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 buckets")));
  seg.Format(Doorbells::kMaxBuckets + 1);
  EXPECT_THAT(Doorbells::Attach(region.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("65537 buckets")));
  seg.Format(64);  // 64 + 64 * 64 bytes do not fit in 4096
  EXPECT_THAT(Doorbells::Attach(region.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("64 buckets need 4160")));
}

TEST(Doorbells, BucketsAreTakenInTheOrderTheyAreRung) {
  Segment seg(4096);
  seg.Format(3);
  std::unique_ptr<ShmRegion> region = seg.Open();
  ASSERT_NE(region, nullptr);
  absl::StatusOr<Doorbells> bells = Doorbells::Attach(region.get());
  ASSERT_THAT(bells.status(), IsOk());
  seg.Ring(0, 6);  // the last step's ring is not this step's
  std::thread trainer([&] {
    for (int k : {2, 0, 1}) {
      absl::SleepFor(absl::Milliseconds(5));
      seg.Ring(k, 7);
    }
  });
  std::vector<bool> taken(3, false);
  std::vector<int> order;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int> k =
        bells->WaitAnyGradients(taken, 7, absl::Now() + absl::Seconds(30), kNever);
    ASSERT_THAT(k.status(), IsOk());
    taken[static_cast<size_t>(*k)] = true;
    order.push_back(*k);
    bells->RingWeights(*k, 7);
  }
  trainer.join();
  EXPECT_EQ(order, (std::vector<int>{2, 0, 1}));
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells->weights(k), 7);
  bells->FailWeights(8);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells->weights(k), -8);
}

TEST(Doorbells, AWaitEndsAtItsDeadlineOnCancelAndOnATrainerAhead) {
  Segment seg(4096);
  seg.Format(12);
  std::unique_ptr<ShmRegion> region = seg.Open();
  ASSERT_NE(region, nullptr);
  absl::StatusOr<Doorbells> bells = Doorbells::Attach(region.get());
  ASSERT_THAT(bells.status(), IsOk());
  std::vector<bool> taken(12, false);
  taken[1] = true;
  const absl::Time start = absl::Now();
  EXPECT_THAT(bells->WaitAnyGradients(taken, 1, start + absl::Milliseconds(50), kNever).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("bucket(s) 0, 2, 3, 4, 5, 6, 7, 8 in time")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));

  std::atomic<bool> stop{false};
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    stop = true;
  });
  EXPECT_THAT(
      bells
          ->WaitAnyGradients(taken, 1, absl::Now() + absl::Seconds(30), [&] { return stop.load(); })
          .status(),
      StatusIs(absl::StatusCode::kCancelled));
  closer.join();

  seg.Ring(5, 2);
  EXPECT_THAT(
      bells->WaitAnyGradients(taken, 1, absl::Now() + absl::Seconds(30), kNever).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("bucket 5 was rung for step 2")));
}

// -N on any bucket, taken or not, abandons step N at once; the -(N - 1) a retried earlier step
// left is no abandon of step N.
TEST(Doorbells, ATrainerAbandonsTheStepFromAnyBucket) {
  Segment seg(4096);
  seg.Format(3);
  std::unique_ptr<ShmRegion> region = seg.Open();
  ASSERT_NE(region, nullptr);
  absl::StatusOr<Doorbells> bells = Doorbells::Attach(region.get());
  ASSERT_THAT(bells.status(), IsOk());
  seg.Ring(0, -2);  // step 2 was abandoned (and retried synchronously)
  seg.Ring(1, 3);
  std::vector<bool> taken(3, false);
  absl::StatusOr<int> k =
      bells->WaitAnyGradients(taken, 3, absl::Now() + absl::Seconds(30), kNever);
  ASSERT_THAT(k.status(), IsOk());
  EXPECT_EQ(*k, 1);
  taken[1] = true;
  EXPECT_THAT(
      bells->WaitAnyGradients(taken, 3, absl::Now() + absl::Milliseconds(20), kNever).status(),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("bucket(s) 0, 2 in time")));
  // Abandoned through the bucket already taken: heard with buckets still to come.
  seg.Ring(1, -3);
  EXPECT_THAT(bells->WaitAnyGradients(taken, 3, absl::Now() + absl::Seconds(30), kNever).status(),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("the trainer abandoned step 3 (bucket 1's doorbell says -3)")));
  // Through one not taken, while the wait runs.
  seg.Ring(1, 3);
  std::thread trainer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    seg.Ring(2, -3);
  });
  EXPECT_THAT(bells->WaitAnyGradients(taken, 3, absl::Now() + absl::Seconds(30), kNever).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("bucket 2's doorbell says -3")));
  trainer.join();
}

TEST(Doorbells, ATruncatedSegmentFailsTheWaitAndSparesTheDaemon) {
  Segment seg(8192);
  seg.Format(2);
  std::unique_ptr<ShmRegion> region = seg.Open();
  ASSERT_NE(region, nullptr);
  absl::StatusOr<Doorbells> bells = Doorbells::Attach(region.get());
  ASSERT_THAT(bells.status(), IsOk());
  seg.Truncate(0);
  EXPECT_THAT(
      bells->WaitAnyGradients({false, false}, 1, absl::Now() + absl::Seconds(30), kNever).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("shrank")));
}

// The Python client's half, in its own process: it makes the page in a shm arena of its own,
// rings step 1's buckets in the order 2, 0, 1 and waits for each bucket's weights; then waits
// on step 2, which the daemon's side fails.
TEST(Doorbells, ThePythonClientRingsAndWaitsAcrossProcesses) {
  const std::string script =
      absl::StrCat("import sys; sys.path.insert(0, '", DIOND_SOURCE_DIR, "/client/python')\n",
                   R"(from diond.host_arena import ShmArena
from diond.doorbell import Doorbells, DoorbellError, bytes_for
arena = ShmArena(bytes_for(3))
bells = Doorbells(arena.buf, 3)
print(arena.name, flush=True)
for k in (2, 0, 1):
    bells.ring_gradients(k, 1)
for k in (0, 1, 2):
    bells.wait_weights(k, 1, timeout=60)
for k in (0, 1, 2):
    bells.ring_gradients(k, 2)
try:
    bells.wait_weights(1, 2, timeout=60)
    print('not failed', flush=True)
except DoorbellError as e:
    print('failed:', e, flush=True)
arena.unlink()
)");
  const std::string path = ::testing::TempDir() + "/doorbell_client.py";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(script.c_str(), f);
  std::fclose(f);
  FILE* py =
      popen(absl::StrCat("DIOND_PROTO_PATH=", DIOND_PROTO_PATH, " /usr/bin/python3 ", path, " 2>&1")
                .c_str(),
            "r");
  ASSERT_NE(py, nullptr);
  char line[512];
  ASSERT_NE(std::fgets(line, sizeof line, py), nullptr);
  const std::string name(absl::StripTrailingAsciiWhitespace(line));
  auto region = ShmRegion::Open(name, 0, Doorbells::BytesFor(3), "session-1");
  ASSERT_THAT(region.status(), IsOk()) << name;
  absl::StatusOr<Doorbells> bells = Doorbells::Attach(region->get());
  ASSERT_THAT(bells.status(), IsOk());
  std::vector<bool> taken(3, false);
  std::vector<int> order;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int> k =
        bells->WaitAnyGradients(taken, 1, absl::Now() + absl::Seconds(60), kNever);
    ASSERT_THAT(k.status(), IsOk());
    taken[static_cast<size_t>(*k)] = true;
    order.push_back(*k);
  }
  // All three were rung before the first wait: the lowest comes first.
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  for (int k : {0, 1, 2}) bells->RingWeights(k, 1);
  taken.assign(3, false);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int> k =
        bells->WaitAnyGradients(taken, 2, absl::Now() + absl::Seconds(60), kNever);
    ASSERT_THAT(k.status(), IsOk());
    taken[static_cast<size_t>(*k)] = true;
  }
  bells->FailWeights(2);
  std::string rest;
  while (std::fgets(line, sizeof line, py) != nullptr) rest += line;
  EXPECT_EQ(pclose(py), 0) << rest;
  EXPECT_THAT(rest, HasSubstr("failed: step 2 failed in the daemon")) << rest;
}

}  // namespace
}  // namespace diond::memory
