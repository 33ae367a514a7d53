// What the checkpoint room's files share: bounded echoes of client text, an owned file
// descriptor, errno as a status, and the few file operations the writer, the reader and the
// state dir's upkeep all use. Nothing here follows a symlink it was not asked to.
//
// Thread-safety: stateless functions; an Fd is owned by one thread at a time.
#ifndef DIOND_SERVER_CHECKPOINT_INTERNAL_FILES_H_
#define DIOND_SERVER_CHECKPOINT_INTERNAL_FILES_H_

#include <errno.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond::checkpoint::internal {

// Client-controlled text in messages: at most 100 bytes of a path or value, control characters
// shown as '?' (common/bounded.h), so that a message stays short and one line (a newline in a
// path reached it raw: session_fuzz).
std::string Echo(absl::string_view s);

// `what` `path`: strerror(err); NOT_FOUND for ENOENT, PERMISSION_DENIED for EACCES/EPERM, else
// INTERNAL.
absl::Status Errno(absl::string_view what, absl::string_view path, int err = errno);

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

std::string StripTrailingSlashes(std::string p);

// Creates `name` in `dirfd` (never an existing file, never through a symlink), writes `bytes`
// and fsyncs it. `display` names it in messages.
absl::Status WriteFileAt(int dirfd, const char* name, const std::string& bytes,
                         const std::string& display);

// Reads all of an open regular file whose size is at most `limit` (checked with fstat before
// reading). DATA_LOSS naming `display` otherwise.
absl::StatusOr<std::string> ReadBounded(int fd, int64_t limit, const std::string& display);

// Removes `name` (a directory tree or a file) under `parent`, never following symlinks.
void RemoveTreeAt(int parent, const std::string& name);

// "step-<N>" -> N (N a plain non-negative decimal), else -1.
int64_t StepOfName(absl::string_view name);

// The names in directory `dirfd` but "." and "..".
std::vector<std::string> ListDir(int dirfd);

}  // namespace diond::checkpoint::internal

#endif  // DIOND_SERVER_CHECKPOINT_INTERNAL_FILES_H_
