// Test helper shared by the server/memory tests that open real POSIX shm segments (shm_region_test,
// doorbell_test): a segment created by the test, as the trainer's side would. Header-only; for
// gtest binaries.
#ifndef DIOND_SERVER_MEMORY_TESTING_SHM_SEGMENT_H_
#define DIOND_SERVER_MEMORY_TESTING_SHM_SEGMENT_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace diond::memory::testing {

// Created (O_EXCL), sized to `bytes`, filled with `fill` and kept mapped (data()); the destructor
// unmaps, closes and unlinks it. A failed step fails the test and leaves data() null.
class ShmTestSegment {
 public:
  // The name is `prefix`, the pid, a counter and a random part: a death test's child dies with
  // its segment still linked, and a later test process may get the same pid.
  ShmTestSegment(const std::string& prefix, int64_t bytes, uint8_t fill = 0)
      : name_(absl::StrCat(prefix, "-", getpid(), "-", counter_++, "-", std::random_device{}())),
        bytes_(bytes) {
    fd_ = shm_open(("/" + name_).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << name_ << ": " << std::strerror(errno);
    if (fd_ < 0) return;
    EXPECT_EQ(ftruncate(fd_, bytes), 0);
    void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    if (p == MAP_FAILED) return;
    data_ = static_cast<uint8_t*>(p);
    std::memset(data_, fill, static_cast<size_t>(bytes));
  }
  ~ShmTestSegment() {
    if (data_ != nullptr) munmap(data_, static_cast<size_t>(bytes_));
    close(fd_);
    shm_unlink(("/" + name_).c_str());
  }
  ShmTestSegment(const ShmTestSegment&) = delete;
  ShmTestSegment& operator=(const ShmTestSegment&) = delete;

  const std::string& name() const { return name_; }
  int64_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_; }
  // Unlinks the name now (the mappings stay): for a death test, whose child process re-runs the
  // test body and dies without running destructors.
  void UnlinkNow() { shm_unlink(("/" + name_).c_str()); }
  // Resizes the segment under the mappings, as a hostile trainer would.
  void Truncate(int64_t bytes) { ASSERT_EQ(ftruncate(fd_, bytes), 0); }

 private:
  static inline int counter_ = 0;
  std::string name_;
  int64_t bytes_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;
};

}  // namespace diond::memory::testing

#endif  // DIOND_SERVER_MEMORY_TESTING_SHM_SEGMENT_H_
