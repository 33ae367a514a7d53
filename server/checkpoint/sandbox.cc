#include "server/checkpoint/sandbox.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "server/checkpoint/internal/files.h"

namespace diond::checkpoint {
namespace {

using internal::Echo;
using internal::Errno;
using internal::Fd;
using internal::StripTrailingSlashes;

// openat2(dirfd, path, RESOLVE_BENEATH): nothing in `path`, symlinks and ".." included, may
// resolve outside `dirfd`. Where the kernel lacks openat2 (before 5.6), an equivalent walk: one
// component at a time with O_NOFOLLOW, refusing ".." and every symlink.
int OpenBeneath(int dirfd, const std::string& path, int flags) {
  struct open_how how;
  std::memset(&how, 0, sizeof(how));
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = syscall(SYS_openat2, dirfd, path.c_str(), &how, sizeof(how));
  if (fd >= 0 || errno != ENOSYS) return static_cast<int>(fd);
  Fd cur(dup(dirfd));
  std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
  if (parts.empty()) parts.push_back(".");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i] == "..") {
      errno = EXDEV;
      return -1;
    }
    const bool last = i + 1 == parts.size();
    int f = openat(cur.get(), parts[i].c_str(),
                   (last ? flags : (O_RDONLY | O_DIRECTORY)) | O_NOFOLLOW | O_CLOEXEC);
    if (f < 0) return -1;  // ELOOP for a symlink
    cur = Fd(f);
  }
  return cur.release();
}

absl::Status MakeDirs(const std::string& path) {
  std::string cur;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      cur = path.substr(0, i);
      if (!cur.empty() && mkdir(cur.c_str(), 0700) != 0 && errno != EEXIST) {
        return Errno("mkdir", cur);
      }
    }
  }
  return absl::OkStatus();
}

// The path names a directory outside the state dir: opened as given.
absl::StatusOr<CheckpointDir> OpenOutside(const std::string& path, bool create) {
  if (create) DIOND_RETURN_IF_ERROR(MakeDirs(path));
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("no checkpoint directory at ", Echo(path)));
    }
    return Errno("open", path);
  }
  return CheckpointDir(fd, StripTrailingSlashes(path));
}

absl::Status Escapes(const std::string& path) {
  return absl::PermissionDeniedError(absl::StrCat(
      "checkpoint path '", Echo(path), "' leaves --state_dir (through '..' or a symlink)"));
}

// `parts` (the path `path` named, relative to the state dir `base`), made one component at a
// time when `create`, each made in and resolved beneath its parent.
absl::StatusOr<CheckpointDir> OpenBeneathStateDir(int base, const std::vector<std::string>& parts,
                                                  const std::string& path,
                                                  const std::string& display, bool create) {
  if (!create) {
    const std::string joined = parts.empty() ? "." : absl::StrJoin(parts, "/");
    int fd = OpenBeneath(base, joined, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
      if (errno == EXDEV || errno == ELOOP) return Escapes(path);
      if (errno == ENOENT || errno == ENOTDIR) {
        return absl::NotFoundError(absl::StrCat("no checkpoint directory at ", Echo(display)));
      }
      return Errno("open", display);
    }
    return CheckpointDir(fd, display);
  }
  Fd cur(dup(base));
  for (const std::string& part : parts) {
    if (part == ".") continue;
    if (part == "..") return Escapes(path);
    if (mkdirat(cur.get(), part.c_str(), 0700) != 0 && errno != EEXIST) {
      return Errno("mkdir", display);
    }
    int fd = OpenBeneath(cur.get(), part, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
      if (errno == EXDEV || errno == ELOOP) return Escapes(path);
      return Errno("open", display);
    }
    cur = Fd(fd);
  }
  return CheckpointDir(cur.release(), display);
}

}  // namespace

CheckpointDir& CheckpointDir::operator=(CheckpointDir&& o) noexcept {
  std::swap(fd_, o.fd_);
  std::swap(path_, o.path_);
  return *this;
}

CheckpointDir::~CheckpointDir() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<CheckpointDir> OpenCheckpointDir(const std::string& state_dir_in,
                                                const std::string& path, bool create) {
  if (path.size() > kMaxCheckpointPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint path '", Echo(path), "' of ",
                                                   path.size(), " bytes: at most ",
                                                   kMaxCheckpointPathBytes));
  }
  // The system calls below read up to the first NUL: "a\0/b" would open "a", another directory
  // than the one named.
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", Echo(path), "' contains a NUL byte"));
  }
  const std::string state_dir = state_dir_in.empty() ? "" : StripTrailingSlashes(state_dir_in);
  std::string rel;
  bool beneath = false;
  if (path.empty() || path[0] != '/') {
    if (state_dir.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "relative checkpoint path '", Echo(path),
          "' needs --state_dir to resolve against (it is never resolved against the daemon's "
          "working directory)"));
    }
    rel = path;
    beneath = true;
  } else if (!state_dir.empty() &&
             (path == state_dir || absl::StartsWith(path, absl::StrCat(state_dir, "/")))) {
    rel = path.substr(state_dir.size());
    beneath = true;
  }
  if (!beneath) return OpenOutside(path, create);
  if (create) DIOND_RETURN_IF_ERROR(MakeDirs(state_dir));
  Fd base(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (base.get() < 0) return Errno("open --state_dir", state_dir);
  std::vector<std::string> parts = absl::StrSplit(rel, '/', absl::SkipEmpty());
  const std::string display =
      parts.empty() ? state_dir : absl::StrCat(state_dir, "/", absl::StrJoin(parts, "/"));
  return OpenBeneathStateDir(base.get(), parts, path, display, create);
}

}  // namespace diond::checkpoint
