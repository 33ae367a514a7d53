// Whether a local process is still alive, told apart from a later process that reuses its pid:
// what the orphan reaper (SessionManager::ReapOrphanSessions, docs/OPERATIONS.md "Orphan
// sessions") asks of the trainers that created or used a session over the Unix socket.
//
// A process is named by its pid and its start time (field 22 of /proc/<pid>/stat, clock ticks
// since boot), read when its connection was accepted. A watch then holds a pidfd (pidfd_open(2),
// Linux 5.3+), which refers to that one process whatever its pid becomes and turns readable when
// it exits; where the kernel gives none (older kernels, a seccomp filter), every look re-reads
// /proc/<pid>/stat and compares the start time.
//
// Thread-safety: ProcessWatch is thread-safe; the functions are pure reads of /proc.
#ifndef DIOND_SERVER_SESSION_PROCESS_WATCH_H_
#define DIOND_SERVER_SESSION_PROCESS_WATCH_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace diond::session {

struct ProcessId {
  pid_t pid = 0;             // 0: unknown (a TCP peer, a pid of another pid namespace)
  uint64_t start_ticks = 0;  // /proc/<pid>/stat starttime; 0: unknown
  bool known() const { return pid > 0 && start_ticks > 0; }
  bool operator==(const ProcessId& o) const { return pid == o.pid && start_ticks == o.start_ticks; }
};

// The start time of process `pid`. NOT_FOUND when no such process exists, or it has exited and
// waits to be reaped (a zombie); UNAVAILABLE when /proc cannot be read for it.
absl::StatusOr<uint64_t> ProcessStartTicks(pid_t pid);

// `pid` with its start time, or an unknown ProcessId when it cannot be identified (pid <= 0, as
// SO_PEERCRED reports a peer of another pid namespace; no /proc; the process is gone).
ProcessId IdentifyProcess(pid_t pid);

class ProcessWatch {
 public:
  enum class Method {
    kAuto,      // a pidfd if the kernel gives one, else kProcStat
    kPidfd,     // pidfd_open; falls back to kProcStat when the kernel refuses it
    kProcStat,  // the start time in /proc/<pid>/stat, compared at every look
  };
  // Watches `id`, which must be known(). A process already gone (or whose pid now names another
  // process) is Exited() at once.
  explicit ProcessWatch(const ProcessId& id, Method method = Method::kAuto);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  // True once the process has exited (a zombie counts as exited), and from then on.
  bool Exited();
  const ProcessId& id() const { return id_; }
  // kPidfd or kProcStat: how this watch looks.
  Method method() const { return pidfd_ >= 0 ? Method::kPidfd : Method::kProcStat; }
  // "pidfd" or "/proc start time" (for logs).
  std::string MethodName() const;

 private:
  ProcessId id_;
  int pidfd_ = -1;
  std::atomic<bool> exited_{false};
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_PROCESS_WATCH_H_
