#include "server/session/shm_region.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace diond::session {

absl::Status ValidateShmName(absl::string_view name) {
  bool ok = !name.empty() && name.size() <= 200 && name != "." && name != "..";
  for (char c : name) {
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
          c == '.' || c == '_' || c == '-')) {
      ok = false;
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm name '", name.substr(0, 240), "' must match [A-Za-z0-9._-]{1,200} (no paths)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(const std::string& name,
                                                           int64_t offset, int64_t size) {
  if (absl::Status s = ValidateShmName(name); !s.ok()) return s;
  if (offset < 0 || size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("shm region '", name, "': offset ", offset,
                                                   " and size ", size,
                                                   " must be >= 0 and > 0"));
  }
  if (offset > INT64_MAX - size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm region '", name, "': offset + size overflows int64"));
  }
  int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) {
      return absl::NotFoundError(absl::StrCat("shm segment '", name, "' does not exist"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open shm segment '", name, "': ", std::strerror(e)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of shm '", name, "': ", std::strerror(e)));
  }
  if (offset + size > st.st_size) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("shm region '", name, "' [", offset, ", ",
                                              offset + size, ") exceeds the segment's ",
                                              st.st_size, " bytes"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset / page * page;
  const size_t map_length = static_cast<size_t>(offset - map_offset + size);
  void* base = mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(map_offset));
  int e = errno;
  close(fd);  // the mapping keeps the segment alive
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of shm '", name, "' (", map_length, " bytes): ", std::strerror(e)));
  }
  std::unique_ptr<ShmRegion> r(new ShmRegion);
  r->name_ = name;
  r->offset_ = offset;
  r->size_ = size;
  r->map_base_ = base;
  r->map_length_ = map_length;
  r->data_ = static_cast<uint8_t*>(base) + (offset - map_offset);
  return r;
}

ShmRegion::~ShmRegion() {
  if (map_base_ != nullptr) munmap(map_base_, map_length_);
}

}  // namespace diond::session
