// An owned file descriptor: closed on destruction, movable, not copyable.
#ifndef DIOND_SERVER_FDCHANNEL_UNIQUE_FD_H_
#define DIOND_SERVER_FDCHANNEL_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace diond::fdchannel {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the returned fd.
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace diond::fdchannel

#endif  // DIOND_SERVER_FDCHANNEL_UNIQUE_FD_H_
