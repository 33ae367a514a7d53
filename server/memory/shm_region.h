// A POSIX shared-memory segment that a trainer registered, mapped once into the daemon.
//
// The name is validated against [A-Za-z0-9._-]{1,200} (and may not be "." or ".."), so no path
// can be formed; the segment is opened with shm_open("/" + name), its real length read with
// fstat, and (offset, size) checked against it before mmap. Unmapped on destruction.
//
// Guard against a trainer that shrinks (ftruncate) its segment: touching a page of a MAP_SHARED
// mapping beyond the end of its file raises SIGBUS, which would kill the daemon and every session
// in it. Every mapped region is entered in a process-wide table that a SIGBUS handler (installed
// once, with SA_SIGINFO) consults: a fault inside a registered region maps anonymous zero pages
// over the rest of the region (MAP_FIXED) and marks the region broken, so the faulting access
// completes harmlessly; the caller checks `broken()` after each access and fails its request with
// FAILED_PRECONDITION. A fault outside every registered region goes to the previous handler, or
// kills the process as before (the default action). As a cheap first line, `CheckIntact()` compares
// the segment's current size (fstat) with the region.
//
// A segment (device, inode) belongs to one session: Open refuses a segment that a region of
// another owner has mapped, so that one principal cannot read or write another's arena.
#ifndef DIOND_SERVER_MEMORY_SHM_REGION_H_
#define DIOND_SERVER_MEMORY_SHM_REGION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond::memory {

// INVALID_ARGUMENT naming the name if it is not a valid segment name.
absl::Status ValidateShmName(absl::string_view name);

class ShmRegion {
 public:
  // NOT_FOUND if the segment does not exist; PERMISSION_DENIED if it cannot be opened;
  // OUT_OF_RANGE if [offset, offset + size) is outside the segment; INVALID_ARGUMENT for a bad
  // name, a negative offset or a non-positive size; FAILED_PRECONDITION if a region of another
  // `owner` (a session id) has the same segment mapped.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(const std::string& name, int64_t offset,
                                                         int64_t size, const std::string& owner);
  // Maps an fd the caller opened (a memfd from the fd channel), taking ownership of it (closed on
  // every error too), with the same checks, SIGBUS guard and one-session rule as Open. `kind`
  // ("memfd") and `name` label it in messages and Describe().
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Adopt(int fd, const std::string& kind,
                                                          const std::string& name, int64_t offset,
                                                          int64_t size, const std::string& owner);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  int64_t offset() const { return offset_; }

  // A SIGBUS was caught in this region: its segment shrank under the mapping, and the region's
  // pages from the fault on are anonymous memory now (reads give zeros, writes go nowhere).
  // Stays broken until the region is unregistered.
  bool broken() const;
  // FAILED_PRECONDITION ("... shrank ...") when broken, or when the segment is now shorter than
  // offset + size (fstat; the trainer truncated it and nothing touched the lost pages yet).
  absl::Status CheckIntact() const;
  // "<kind> region '<name>' [a, b)", kind "shm" for Open's regions.
  std::string Describe() const;
  // Whether the memory can still go away under the mapping: true for POSIX shm, false for a
  // memfd (Adopt's callers check F_SEAL_SHRINK first, server/memory/memfd_region.h).
  bool can_shrink() const { return kind_ != "memfd"; }

 private:
  ShmRegion() = default;
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Map(int fd, const std::string& kind,
                                                        const std::string& name, int64_t offset,
                                                        int64_t size, const std::string& owner);
  std::string kind_ = "shm";
  std::string name_;
  int64_t offset_ = 0;
  int64_t size_ = 0;
  void* map_base_ = nullptr;
  size_t map_length_ = 0;
  uint8_t* data_ = nullptr;
  int fd_ = -1;    // kept open for CheckIntact's fstat
  int slot_ = -1;  // entry in the SIGBUS guard's table
  uint64_t dev_ = 0, ino_ = 0;
};

// For tests: how many SIGBUS faults the guard absorbed in this process.
int64_t ShmGuardFaultsCaught();

}  // namespace diond::memory

#endif  // DIOND_SERVER_MEMORY_SHM_REGION_H_
