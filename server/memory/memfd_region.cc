#include "server/memory/memfd_region.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace diond::memory {
namespace {

const char* FileKind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a pipe";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISDIR(mode)) return "a directory";
  return "a regular file";
}

}  // namespace

std::string MemfdName(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "memfd:?";
  return absl::StrCat("memfd:", st.st_ino);
}

absl::Status CheckMemfd(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the fd sent is not usable: fstat: ", std::strerror(errno)));
  }
  // A memfd is a regular file whose /proc/self/fd link reads "/memfd:<name> (deleted)". A
  // tmpfs file (/dev/shm) also answers F_GET_SEALS, so the link is what tells them apart.
  bool memfd = false;
  if (S_ISREG(st.st_mode)) {
    char link[512];
    ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
    memfd = n > 0 && absl::StartsWith(absl::string_view(link, static_cast<size_t>(n)), "/memfd:");
  }
  if (!memfd) {
    return absl::InvalidArgumentError(
        absl::StrCat("the fd sent is ", FileKind(st.st_mode),
                     ", not a memfd: a MEMFD region needs memfd_create(MFD_ALLOW_SEALING) memory"));
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the memfd sent does not answer F_GET_SEALS: ", std::strerror(errno)));
  }
  std::vector<const char*> missing;
  if ((seals & F_SEAL_SHRINK) == 0) missing.push_back("F_SEAL_SHRINK");
  if ((seals & F_SEAL_GROW) == 0) missing.push_back("F_SEAL_GROW");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the memfd lacks ", absl::StrJoin(missing, " and "),
        ": seal it with fcntl(F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) after sizing it (it "
        "must be created with MFD_ALLOW_SEALING), so that it cannot shrink under the daemon"));
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the memfd has ", (seals & F_SEAL_WRITE) != 0 ? "F_SEAL_WRITE" : "F_SEAL_FUTURE_WRITE",
        ": the daemon writes the parameters (and reads the gradients) in place; seal it with "
        "F_SEAL_SHRINK | F_SEAL_GROW only"));
  }
  return absl::OkStatus();
}

}  // namespace diond::memory
