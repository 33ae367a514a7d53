// ProcessWatch against real processes: a forked child that is alive, then SIGKILLed (a zombie
// until reaped, then gone), and a pid whose start time says it now names another process. Both
// ways of looking, the pidfd and /proc's start time, must agree.
#include "server/session/process_watch.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::session {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using Method = ProcessWatch::Method;

// A child that sleeps until killed; it renames itself to `name` first (then writes a byte to
// `ready`), so that the parser meets blanks and parentheses in the command name.
pid_t SleepingChild(const char* name) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    prctl(PR_SET_NAME, name);
    const char c = 'r';
    if (write(fds[1], &c, 1) != 1) _exit(3);
    for (;;) pause();
  }
  close(fds[1]);
  char c = 0;
  if (pid > 0 && read(fds[0], &c, 1) != 1) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    close(fds[0]);
    return -1;
  }
  close(fds[0]);
  return pid;
}

// What the watches should pick: a pidfd where this kernel (and its seccomp filter) gives one.
bool KernelHasPidfd() {
  const long fd = syscall(SYS_pidfd_open, getpid(), 0);
  if (fd < 0) return false;
  close(static_cast<int>(fd));
  return true;
}

Method Expected(Method asked) {
  return asked != Method::kProcStat && KernelHasPidfd() ? Method::kPidfd : Method::kProcStat;
}

// Exited() polled until `want` or a generous deadline (the kernel marks the exit asynchronously
// after SIGKILL).
bool ExitedWithin(ProcessWatch& w, bool want = true) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (w.Exited() != want && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  return w.Exited() == want;
}

TEST(ProcessStartTicks, ReadsTheStartTimeWhateverTheCommandName) {
  const pid_t pid = SleepingChild("a) b (c");
  ASSERT_GT(pid, 0);
  auto child = ProcessStartTicks(pid);
  ASSERT_THAT(child, IsOk());
  auto self = ProcessStartTicks(getpid());
  ASSERT_THAT(self, IsOk());
  // A property: the child was started after this process.
  EXPECT_GE(*child, *self);
  EXPECT_GT(*self, 0u);
  // The same process read again gives the same time.
  EXPECT_EQ(*ProcessStartTicks(pid), *child);
  ProcessId id = IdentifyProcess(pid);
  EXPECT_TRUE(id.known());
  EXPECT_EQ(id.pid, pid);
  EXPECT_EQ(id.start_ticks, *child);

  kill(pid, SIGKILL);
  // A zombie (not yet reaped) has exited: it counts as no process.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ProcessStartTicks(pid).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(ProcessStartTicks(pid), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
  EXPECT_THAT(ProcessStartTicks(pid), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(IdentifyProcess(pid).known());
}

TEST(ProcessStartTicks, UnknownPidsAreNotFound) {
  EXPECT_THAT(ProcessStartTicks(0), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(ProcessStartTicks(-5), StatusIs(absl::StatusCode::kNotFound));
  // Above the kernel's largest pid (pid_max is at most 2^22).
  EXPECT_THAT(ProcessStartTicks((1 << 22) + 1), StatusIs(absl::StatusCode::kNotFound));
  // SO_PEERCRED reports pid 0 for a peer of another pid namespace: unknown, never watched.
  EXPECT_FALSE(IdentifyProcess(0).known());
}

class ProcessWatchTest : public ::testing::TestWithParam<Method> {};

TEST_P(ProcessWatchTest, ALiveChildIsAliveUntilKilledAndStaysExited) {
  const pid_t pid = SleepingChild("trainer");
  ASSERT_GT(pid, 0);
  const ProcessId id = IdentifyProcess(pid);
  ASSERT_TRUE(id.known());
  ProcessWatch w(id, GetParam());
  EXPECT_EQ(w.method(), Expected(GetParam()));
  EXPECT_FALSE(w.Exited());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(w.Exited());
  kill(pid, SIGKILL);
  EXPECT_TRUE(ExitedWithin(w)) << "SIGKILLed, not yet reaped: a zombie has exited";
  ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
  EXPECT_TRUE(w.Exited());
  // A watch opened after the exit knows at once.
  EXPECT_TRUE(ProcessWatch(id, GetParam()).Exited());
}

TEST_P(ProcessWatchTest, APidThatNamesAnotherProcessNowIsExited) {
  // This process stands in for a newcomer that got a dead trainer's pid: same pid, another
  // start time.
  const ProcessId self = IdentifyProcess(getpid());
  ASSERT_TRUE(self.known());
  EXPECT_FALSE(ProcessWatch(self, GetParam()).Exited());
  ProcessId earlier = self;
  earlier.start_ticks -= 1;
  ProcessWatch reused(earlier, GetParam());
  EXPECT_TRUE(reused.Exited());
  ProcessId later = self;
  later.start_ticks += 1000;
  EXPECT_TRUE(ProcessWatch(later, GetParam()).Exited());
}

TEST_P(ProcessWatchTest, AnUnknownProcessIsNeverWatchedAsAlive) {
  EXPECT_TRUE(ProcessWatch(ProcessId{}, GetParam()).Exited());
  EXPECT_TRUE(ProcessWatch(ProcessId{getpid(), 0}, GetParam()).Exited());
}

INSTANTIATE_TEST_SUITE_P(Methods, ProcessWatchTest,
                         ::testing::Values(Method::kPidfd, Method::kProcStat),
                         [](const ::testing::TestParamInfo<Method>& i) {
                           return i.param == Method::kPidfd ? "Pidfd" : "ProcStat";
                         });

TEST(ProcessWatch, AutoUsesAPidfdWhereTheKernelHasOne) {
  ProcessWatch w(IdentifyProcess(getpid()));
  EXPECT_EQ(w.method(), Expected(Method::kAuto));
  EXPECT_EQ(w.MethodName(), KernelHasPidfd() ? "pidfd" : "/proc start time");
  EXPECT_EQ(ProcessWatch(IdentifyProcess(getpid()), Method::kProcStat).MethodName(),
            "/proc start time");
}

}  // namespace
}  // namespace diond::session
