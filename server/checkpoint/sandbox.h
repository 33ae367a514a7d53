// The checkpoint sandbox (ARCHITECTURE.md §7; docs/OPERATIONS.md "Security"): how a directory a
// client names is opened. A relative path is resolved beneath --state_dir without following any
// symlink or ".." out of it (openat2 RESOLVE_BENEATH, or an equivalent walk on kernels without
// it); without --state_dir a relative path is refused, never resolved against the daemon's
// working directory.
//
// Thread-safety: stateless functions; a CheckpointDir is owned by one thread at a time.
#ifndef DIOND_SERVER_CHECKPOINT_SANDBOX_H_
#define DIOND_SERVER_CHECKPOINT_SANDBOX_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace diond::checkpoint {

// Longest checkpoint path a client may name (messages that echo it stay small).
inline constexpr size_t kMaxCheckpointPathBytes = 1024;

// An open directory (O_DIRECTORY file descriptor) and the path it was opened as (for messages).
class CheckpointDir {
 public:
  CheckpointDir() = default;
  CheckpointDir(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  CheckpointDir(CheckpointDir&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  CheckpointDir& operator=(CheckpointDir&& o) noexcept;
  CheckpointDir(const CheckpointDir&) = delete;
  CheckpointDir& operator=(const CheckpointDir&) = delete;
  ~CheckpointDir();
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Opens the directory a client named. `state_dir` may be empty (no --state_dir).
//  - relative `path`: beneath `state_dir`, no symlink may lead out of it (PERMISSION_DENIED);
//    FAILED_PRECONDITION without a state_dir (never resolved against the daemon's cwd);
//  - absolute `path` inside `state_dir`: the same as its relative remainder;
//  - other absolute paths: opened as given (the RPC layer allows them to Unix-socket peers only).
// `create`: missing directories are made (mode 0700). NOT_FOUND if it does not exist;
// INVALID_ARGUMENT for a path over kMaxCheckpointPathBytes or with a NUL byte.
absl::StatusOr<CheckpointDir> OpenCheckpointDir(const std::string& state_dir,
                                                const std::string& path, bool create);

}  // namespace diond::checkpoint

#endif  // DIOND_SERVER_CHECKPOINT_SANDBOX_H_
