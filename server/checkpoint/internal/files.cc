#include "server/checkpoint/internal/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/bounded.h"

namespace diond::checkpoint::internal {

std::string Echo(absl::string_view s) {
  if (s.size() <= 100) return Bounded(s);
  return absl::StrCat(Bounded(s.substr(0, 100)), "... (", s.size(), " bytes)");
}

absl::Status Errno(absl::string_view what, absl::string_view path, int err) {
  const std::string m = absl::StrCat(what, " ", Echo(path), ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(m);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(m);
  return absl::InternalError(m);
}

Fd& Fd::operator=(Fd&& o) noexcept {
  std::swap(fd_, o.fd_);
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) close(fd_);
}

std::string StripTrailingSlashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

absl::Status WriteFileAt(int dirfd, const char* name, const std::string& bytes,
                         const std::string& display) {
  Fd fd(openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) return Errno("create", display);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", display);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd.get()) != 0) return Errno("fsync", display);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadBounded(int fd, int64_t limit, const std::string& display) {
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::DataLossError(absl::StrCat("cannot stat ", display));
  if (!S_ISREG(st.st_mode)) return absl::DataLossError(absl::StrCat(display, " is not a file"));
  if (st.st_size > limit) {
    return absl::DataLossError(
        absl::StrCat(display, " is ", st.st_size, " bytes; the limit is ", limit, " bytes"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (done != out.size()) {
    return absl::DataLossError(
        absl::StrCat(display, ": short read (", done, " of ", out.size(), " bytes)"));
  }
  return out;
}

void RemoveTreeAt(int parent, const std::string& name) {
  if (unlinkat(parent, name.c_str(), 0) == 0) return;
  int fd = openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    if (DIR* d = fdopendir(fd)) {  // takes fd
      std::vector<std::string> children;
      while (dirent* e = readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") children.push_back(n);
      }
      for (const std::string& c : children) RemoveTreeAt(dirfd(d), c);
      closedir(d);
    } else {
      close(fd);
    }
  }
  unlinkat(parent, name.c_str(), AT_REMOVEDIR);
}

std::vector<std::string> ListDir(int dirfd) {
  std::vector<std::string> out;
  int fd = dup(dirfd);
  if (fd < 0) return out;
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    close(fd);
    return out;
  }
  rewinddir(d);
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  closedir(d);
  return out;
}

int64_t StepOfName(absl::string_view n) {
  if (!absl::ConsumePrefix(&n, "step-") || n.empty() || n.size() > 19) return -1;
  for (char c : n) {
    if (c < '0' || c > '9') return -1;
  }
  int64_t step;
  return absl::SimpleAtoi(n, &step) ? step : -1;
}

}  // namespace diond::checkpoint::internal
