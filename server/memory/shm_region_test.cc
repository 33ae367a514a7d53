// In-process tests of ShmRegion's SIGBUS guard and segment ownership, on real POSIX shm
// segments that the test truncates under the mapping as a hostile trainer would. The daemon-level
// behaviour (a Step on a shrinking segment, other sessions unaffected) is tested against the real
// daemon in tests/service/shm_shrink_service_test.cc.
#include "server/memory/shm_region.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/memory/testing/shm_segment.h"

namespace diond::memory {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

// A segment of 0x5a bytes created by the test (the trainer's side), unlinked at the end.
class Segment : public testing::ShmTestSegment {
 public:
  explicit Segment(int64_t bytes) : ShmTestSegment("diond-shm-region-test", bytes, 0x5a) {}
};

constexpr int64_t kSize = 1 << 20;

TEST(ShmRegion, ReadsAndWritesTheSegment) {
  Segment seg(kSize);
  auto r = ShmRegion::Open(seg.name(), 4096, kSize - 4096, "s-a");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ((*r)->data()[0], 0x5a);
  EXPECT_FALSE((*r)->broken());
  EXPECT_THAT((*r)->CheckIntact(), IsOk());
}

TEST(ShmRegion, TruncationIsSeenByFstatBeforeAnyAccess) {
  Segment seg(kSize);
  auto r = ShmRegion::Open(seg.name(), 0, kSize, "s-a");
  ASSERT_THAT(r.status(), IsOk());
  seg.Truncate(kSize / 2);
  EXPECT_THAT((*r)->CheckIntact(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("now has 524288 bytes")));
  EXPECT_FALSE((*r)->broken());  // nothing touched the lost pages
  seg.Truncate(kSize);           // the trainer may grow it back
  EXPECT_THAT((*r)->CheckIntact(), IsOk());
}

TEST(ShmRegion, AFaultInsideARegionIsAbsorbedAndMarksItBroken) {
  Segment seg(kSize);
  auto r = ShmRegion::Open(seg.name(), 0, kSize, "s-a");
  ASSERT_THAT(r.status(), IsOk());
  const int64_t faults = ShmGuardFaultsCaught();
  seg.Truncate(8192);
  volatile uint8_t* p = (*r)->data();
  EXPECT_EQ(p[100], 0x5a);     // still backed by the segment
  EXPECT_EQ(p[kSize / 2], 0);  // SIGBUS, absorbed: an anonymous zero page now
  p[kSize - 1] = 7;            // writes land harmlessly too (no second fault)
  EXPECT_EQ(p[kSize - 1], 7);
  EXPECT_EQ(ShmGuardFaultsCaught(), faults + 1);
  EXPECT_TRUE((*r)->broken());
  EXPECT_THAT((*r)->CheckIntact(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("shrank")));
}

TEST(ShmRegion, AFaultOnAnotherThreadIsAbsorbedToo) {
  Segment seg(kSize);
  auto r = ShmRegion::Open(seg.name(), 0, kSize, "s-a");
  ASSERT_THAT(r.status(), IsOk());
  seg.Truncate(0);
  uint64_t sum = 1;
  std::thread t([&] {
    volatile uint8_t* p = (*r)->data();
    for (int64_t i = 0; i < kSize; i += 4096) sum += p[i];
  });
  t.join();
  EXPECT_EQ(sum, 1u);
  EXPECT_TRUE((*r)->broken());
}

TEST(ShmRegion, ARegionOpenedAfterADestroyedBrokenOneStartsIntact) {
  Segment seg(kSize);
  {
    auto r = ShmRegion::Open(seg.name(), 0, kSize, "s-a");
    ASSERT_THAT(r.status(), IsOk());
    seg.Truncate(0);
    EXPECT_EQ(static_cast<volatile uint8_t*>((*r)->data())[0], 0);
    EXPECT_TRUE((*r)->broken());
  }
  seg.Truncate(kSize);
  auto again = ShmRegion::Open(seg.name(), 0, kSize, "s-a");
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_FALSE((*again)->broken());
}

// A SIGBUS outside every registered region still kills the process, as without the guard.
TEST(ShmRegionDeathTest, AFaultOutsideEveryRegionStillCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Segment seg(kSize);
  auto r = ShmRegion::Open(seg.name(), 0, kSize, "s-a");  // the guard is installed
  ASSERT_THAT(r.status(), IsOk());
  seg.UnlinkNow();  // the child below dies with its copy of this segment: leave no name behind
  EXPECT_EXIT(
      {
        char path[] = "/tmp/diond-shm-region-test-XXXXXX";
        int fd = mkstemp(path);
        unlink(path);
        if (fd < 0 || ftruncate(fd, 65536) != 0) std::_Exit(3);
        void* m = mmap(nullptr, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED || ftruncate(fd, 0) != 0) std::_Exit(4);
        volatile uint8_t* p = static_cast<uint8_t*>(m);
        p[4096] = 1;  // beyond the file's end, in no registered region
        std::_Exit(0);
      },
      [](int status) {
#if defined(__SANITIZE_ADDRESS__)
        // The previous handler is AddressSanitizer's: it reports the BUS and aborts.
        return WIFSIGNALED(status) && (WTERMSIG(status) == SIGBUS || WTERMSIG(status) == SIGABRT);
#else
        return WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
#endif
      },
      "");
}

TEST(ShmRegion, ASegmentBelongsToOneSession) {
  Segment seg(kSize);
  auto a = ShmRegion::Open(seg.name(), 0, kSize / 2, "s-a");
  ASSERT_THAT(a.status(), IsOk());
  // The same session may map another part (its other arena).
  auto a2 = ShmRegion::Open(seg.name(), kSize / 2, kSize / 2, "s-a");
  ASSERT_THAT(a2.status(), IsOk());
  EXPECT_THAT(
      ShmRegion::Open(seg.name(), 0, kSize / 2, "s-b").status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("registered by another session")));
  a->reset();
  EXPECT_THAT(ShmRegion::Open(seg.name(), 0, kSize / 2, "s-b").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  a2->reset();  // the last region of s-a is gone: the segment is free again
  EXPECT_THAT(ShmRegion::Open(seg.name(), 0, kSize / 2, "s-b").status(), IsOk());
}

}  // namespace
}  // namespace diond::memory
