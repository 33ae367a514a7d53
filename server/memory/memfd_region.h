// MEMFD regions (docs/DATA_PLANE.md "Region kinds"): host memory a trainer created with
// memfd_create(MFD_ALLOW_SEALING), sealed with F_SEAL_SHRINK and F_SEAL_GROW, and passed to the
// daemon over the fd channel. Sealed, it can never shrink under the daemon's mapping (no SIGBUS),
// so it is the recommended host path; it is otherwise used exactly like a POSIX shm region
// (ShmRegion::Adopt maps it).
#ifndef DIOND_SERVER_MEMORY_MEMFD_REGION_H_
#define DIOND_SERVER_MEMORY_MEMFD_REGION_H_

#include <string>

#include "absl/status/status.h"

namespace diond::memory {

// OK when `fd` is a memfd with F_SEAL_SHRINK and F_SEAL_GROW and without F_SEAL_WRITE /
// F_SEAL_FUTURE_WRITE (the daemon writes the parameters). INVALID_ARGUMENT naming what the fd is
// when it is no memfd (a pipe, a socket, a regular file, ...); FAILED_PRECONDITION naming the
// missing seal(s), or the write seal that is present.
absl::Status CheckMemfd(int fd);

// "memfd:<inode>": the name of a memfd region in messages and the overlap check.
std::string MemfdName(int fd);

}  // namespace diond::memory

#endif  // DIOND_SERVER_MEMORY_MEMFD_REGION_H_
