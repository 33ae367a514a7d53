// The state dir's upkeep for store.h: listing a session's checkpoints, the start-up clean-up of
// what dead writers left, and the marker of sessions their client closed.
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "server/checkpoint/internal/files.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/store.h"

namespace diond::checkpoint {
namespace {

using internal::Echo;
using internal::Fd;
using internal::ListDir;
using internal::RemoveTreeAt;
using internal::StepOfName;
using internal::StripTrailingSlashes;

constexpr char kClosedMarker[] = "closed";

// One entry .{tmp,old}-step-<N>-<pid>-<seq> of session directory `sfd` (`present`: its entries):
// an interrupted fallback switch (.old- without its step-<N>) is moved back, anything else
// removed, unless a live writer other than this process owns it. Returns whether it removed it.
bool CleanUpTemporary(int sfd, const std::string& n, const std::set<std::string>& present,
                      const std::string& where) {
  const bool old = absl::StartsWith(n, ".old-step-");
  std::vector<std::string> f = absl::StrSplit(n.substr(5), '-');
  int pid = 0;
  if (f.size() >= 3 && absl::SimpleAtoi(f[2], &pid) && pid > 0 && pid != getpid() &&
      kill(pid, 0) == 0) {
    return false;
  }
  if (old && f.size() >= 2) {
    const std::string final_name = absl::StrCat("step-", f[1]);
    if (present.count(final_name) == 0 && renameat(sfd, n.c_str(), sfd, final_name.c_str()) == 0) {
      DIOND_LOG(WARNING) << "checkpoint " << where << "/" << final_name
                         << " restored from an interrupted re-save";
      return false;
    }
  }
  RemoveTreeAt(sfd, n);
  return true;
}

}  // namespace

std::vector<std::string> CheckpointsNewestFirst(const std::string& root,
                                                const std::string& session_id) {
  std::vector<std::string> out;
  if (!IsValidSessionId(session_id)) return out;
  const std::string parent = absl::StrCat(StripTrailingSlashes(root), "/", session_id);
  Fd fd(open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return out;
  std::vector<int64_t> steps;
  for (const std::string& n : ListDir(fd.get())) {
    const int64_t s = StepOfName(n);
    if (s >= 0) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  for (int64_t s : steps) out.push_back(absl::StrCat(parent, "/step-", s));
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root,
                                             const std::string& session_id) {
  std::vector<std::string> all = CheckpointsNewestFirst(root, session_id);
  if (all.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoints in ", Echo(root), "/", Echo(session_id)));
  }
  return all.front();
}

int64_t RemoveStaleTemporaries(const std::string& state_dir) {
  int64_t removed = 0;
  Fd root(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.get() < 0) return 0;
  for (const std::string& session : ListDir(root.get())) {
    if (!IsValidSessionId(session)) continue;
    Fd sfd(openat(root.get(), session.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (sfd.get() < 0) continue;
    const std::vector<std::string> names = ListDir(sfd.get());
    const std::set<std::string> present(names.begin(), names.end());
    for (const std::string& n : names) {
      if (!absl::StartsWith(n, ".tmp-step-") && !absl::StartsWith(n, ".old-step-")) continue;
      if (CleanUpTemporary(sfd.get(), n, present, absl::StrCat(state_dir, "/", session))) {
        ++removed;
      }
    }
    fsync(sfd.get());
  }
  return removed;
}

std::vector<std::string> CheckpointSessions(const std::string& state_dir) {
  std::vector<std::string> out;
  Fd root(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.get() < 0) return out;
  for (const std::string& n : ListDir(root.get())) {
    if (IsValidSessionId(n)) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void MarkSessionClosed(const std::string& state_dir, const std::string& session_id) {
  if (state_dir.empty() || !IsValidSessionId(session_id)) return;
  const std::string dir = absl::StrCat(StripTrailingSlashes(state_dir), "/", session_id);
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return;  // never checkpointed: nothing to recover anyway
  Fd m(openat(fd.get(), kClosedMarker, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (m.get() >= 0) fsync(m.get());
  fsync(fd.get());
}

bool SessionMarkedClosed(const std::string& state_dir, const std::string& session_id) {
  const std::string p =
      absl::StrCat(StripTrailingSlashes(state_dir), "/", session_id, "/", kClosedMarker);
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

}  // namespace diond::checkpoint
