#include "server/session/process_watch.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture (Linux 5.3)
#endif

namespace diond::session {

absl::StatusOr<uint64_t> ProcessStartTicks(pid_t pid) {
  if (pid <= 0) return absl::NotFoundError(absl::StrCat("no process ", pid));
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ESRCH) return absl::NotFoundError(absl::StrCat("no process ", pid));
    return absl::UnavailableError(absl::StrCat("cannot read ", path, ": ", std::strerror(err)));
  }
  char buf[1024];  // the line is short: the name is at most 16 bytes, then ~50 numbers
  ssize_t n;
  do {
    n = read(fd, buf, sizeof(buf) - 1);
  } while (n < 0 && errno == EINTR);
  const int err = errno;
  close(fd);
  if (n < 0) {
    if (err == ESRCH) return absl::NotFoundError(absl::StrCat("no process ", pid));
    return absl::UnavailableError(absl::StrCat("cannot read ", path, ": ", std::strerror(err)));
  }
  // "pid (comm) state ppid ... starttime ...": comm may hold blanks and parentheses, so the
  // fields are counted from the last ')'. starttime is field 22, the 20th after comm.
  absl::string_view line(buf, static_cast<size_t>(n));
  const size_t close_paren = line.rfind(')');
  if (close_paren == absl::string_view::npos) {
    return absl::UnavailableError(absl::StrCat(path, ": no ')' in '", line.substr(0, 64), "'"));
  }
  std::vector<absl::string_view> fields =
      absl::StrSplit(line.substr(close_paren + 1), ' ', absl::SkipEmpty());
  uint64_t start = 0;
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &start)) {
    return absl::UnavailableError(absl::StrCat(path, ": no start time"));
  }
  if (fields[0] == "Z" || fields[0] == "X" || fields[0] == "x") {
    return absl::NotFoundError(absl::StrCat("process ", pid, " has exited"));
  }
  return start;
}

ProcessId IdentifyProcess(pid_t pid) {
  ProcessId id;
  if (pid <= 0) return id;
  absl::StatusOr<uint64_t> start = ProcessStartTicks(pid);
  if (!start.ok() || *start == 0) return id;
  id.pid = pid;
  id.start_ticks = *start;
  return id;
}

ProcessWatch::ProcessWatch(const ProcessId& id, Method method) : id_(id) {
  if (!id.known()) {
    exited_ = true;
    return;
  }
  if (method != Method::kProcStat) {
    const long fd = syscall(SYS_pidfd_open, id.pid, 0);
    if (fd < 0 && errno == ESRCH) {
      exited_ = true;
      return;
    }
    // Other errors (ENOSYS before Linux 5.3, EPERM under a seccomp filter): /proc below.
    if (fd >= 0) {
      pidfd_ = static_cast<int>(fd);
      fcntl(pidfd_, F_SETFD, FD_CLOEXEC);
    }
  }
  // The pidfd names whatever process had the pid when it was opened: if that is no longer the
  // process of `id` (it exited, and maybe the pid was reused), the watched process is gone.
  // Unreadable /proc: the pidfd alone decides (at worst it watches a later process with the
  // same pid, which keeps a session longer, never shorter).
  absl::StatusOr<uint64_t> start = ProcessStartTicks(id.pid);
  if (absl::IsNotFound(start.status()) || (start.ok() && *start != id.start_ticks)) {
    exited_ = true;
    if (pidfd_ >= 0) {
      close(pidfd_);
      pidfd_ = -1;
    }
  }
}

ProcessWatch::~ProcessWatch() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool ProcessWatch::Exited() {
  if (exited_.load(std::memory_order_acquire)) return true;
  bool gone = false;
  if (pidfd_ >= 0) {
    pollfd p{pidfd_, POLLIN, 0};
    int n;
    do {
      n = poll(&p, 1, 0);
    } while (n < 0 && errno == EINTR);
    gone = n > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
  } else {
    absl::StatusOr<uint64_t> start = ProcessStartTicks(id_.pid);
    // UNAVAILABLE (e.g. out of descriptors) tells nothing: alive until known otherwise.
    gone = absl::IsNotFound(start.status()) || (start.ok() && *start != id_.start_ticks);
  }
  if (gone) exited_.store(true, std::memory_order_release);
  return gone;
}

std::string ProcessWatch::MethodName() const {
  return method() == Method::kPidfd ? "pidfd" : "/proc start time";
}

}  // namespace diond::session
