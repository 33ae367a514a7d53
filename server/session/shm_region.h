// A POSIX shared-memory segment that a trainer registered, mapped once into the daemon.
//
// The name is validated against [A-Za-z0-9._-]{1,200} (and may not be "." or ".."), so no path
// can be formed; the segment is opened with shm_open("/" + name), its real length read with
// fstat, and (offset, size) checked against it before mmap. Unmapped on destruction.
#ifndef DIOND_SERVER_SESSION_SHM_REGION_H_
#define DIOND_SERVER_SESSION_SHM_REGION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond::session {

// INVALID_ARGUMENT naming the name if it is not a valid segment name.
absl::Status ValidateShmName(absl::string_view name);

class ShmRegion {
 public:
  // NOT_FOUND if the segment does not exist; PERMISSION_DENIED if it cannot be opened;
  // OUT_OF_RANGE if [offset, offset + size) is outside the segment; INVALID_ARGUMENT for a bad
  // name, a negative offset or a non-positive size.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(const std::string& name, int64_t offset,
                                                          int64_t size);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  int64_t offset() const { return offset_; }

 private:
  ShmRegion() = default;
  std::string name_;
  int64_t offset_ = 0;
  int64_t size_ = 0;
  void* map_base_ = nullptr;
  size_t map_length_ = 0;
  uint8_t* data_ = nullptr;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SHM_REGION_H_
