// CheckMemfd on every kind of fd a trainer could send instead of a sealed memfd, and a sealed
// memfd mapped through ShmRegion::Adopt: the daemon's view and the trainer's are the same bytes.
#include "server/memory/memfd_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/fdchannel/unique_fd.h"
#include "server/memory/shm_region.h"

namespace diond::memory {
namespace {

using ::diond::fdchannel::UniqueFd;
using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

UniqueFd SealedMemfd(int64_t bytes, int seals) {
  UniqueFd fd(memfd_create("memfd-region-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid()) << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd.get(), bytes), 0);
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0) << std::strerror(errno);
  }
  return fd;
}

TEST(CheckMemfd, AcceptsASealedMemfd) {
  UniqueFd fd = SealedMemfd(4096, F_SEAL_SHRINK | F_SEAL_GROW);
  EXPECT_THAT(CheckMemfd(fd.get()), IsOk());
  // F_SEAL_SEAL on top is fine: nothing can change the seals any more.
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SEAL), 0);
  EXPECT_THAT(CheckMemfd(fd.get()), IsOk());
}

TEST(CheckMemfd, NamesTheMissingSeals) {
  UniqueFd none = SealedMemfd(4096, 0);
  EXPECT_THAT(CheckMemfd(none.get()), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               HasSubstr("lacks F_SEAL_SHRINK and F_SEAL_GROW")));
  UniqueFd shrink = SealedMemfd(4096, F_SEAL_SHRINK);
  EXPECT_THAT(CheckMemfd(shrink.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lacks F_SEAL_GROW")));
  UniqueFd grow = SealedMemfd(4096, F_SEAL_GROW);
  EXPECT_THAT(CheckMemfd(grow.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lacks F_SEAL_SHRINK")));
  // Without MFD_ALLOW_SEALING no seal can be added: refused the same way.
  UniqueFd plain(memfd_create("memfd-region-test", MFD_CLOEXEC));
  EXPECT_THAT(CheckMemfd(plain.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("MFD_ALLOW_SEALING")));
}

TEST(CheckMemfd, RefusesAWriteSeal) {
  UniqueFd fd = SealedMemfd(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
  EXPECT_THAT(CheckMemfd(fd.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("F_SEAL_WRITE")));
}

TEST(CheckMemfd, RefusesWhatIsNoMemfd) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  EXPECT_THAT(CheckMemfd(r.get()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is a pipe, not a memfd")));
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  EXPECT_THAT(CheckMemfd(a.get()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is a socket, not a memfd")));
  const std::string path = absl::StrCat(::testing::TempDir(), "/memfd-region-test-", getpid());
  UniqueFd file(open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  ASSERT_TRUE(file.valid());
  unlink(path.c_str());
  EXPECT_THAT(CheckMemfd(file.get()), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("is a regular file, not a memfd")));
  // A POSIX shm segment is a tmpfs file that answers F_GET_SEALS too; it is still no memfd.
  const std::string shm = absl::StrCat("/diond-memfd-region-test-", getpid());
  UniqueFd seg(shm_open(shm.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  ASSERT_TRUE(seg.valid());
  shm_unlink(shm.c_str());
  EXPECT_THAT(CheckMemfd(seg.get()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a memfd")));
  UniqueFd null(open("/dev/null", O_RDWR | O_CLOEXEC));
  EXPECT_THAT(CheckMemfd(null.get()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a character device")));
}

TEST(MemfdRegion, AdoptMapsTheTrainersBytesAndCannotShrink) {
  const int64_t bytes = 3 * 4096;
  UniqueFd fd = SealedMemfd(bytes, F_SEAL_SHRINK | F_SEAL_GROW);
  auto* trainer =
      static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(trainer, MAP_FAILED);
  for (int64_t i = 0; i < bytes; ++i) trainer[i] = static_cast<uint8_t>(i * 7);
  // Sealed: the trainer cannot shrink (or grow) it any more.
  EXPECT_NE(ftruncate(fd.get(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
  // Out of range and the good case; the daemon gets its own fd.
  EXPECT_THAT(
      ShmRegion::Adopt(dup(fd.get()), "memfd", MemfdName(fd.get()), 4096, bytes, "s1").status(),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("memfd region")));
  auto r = ShmRegion::Adopt(dup(fd.get()), "memfd", MemfdName(fd.get()), 256, 4096, "s1");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(std::memcmp((*r)->data(), trainer + 256, 4096), 0);
  (*r)->data()[10] = 0xee;  // the daemon writes the parameters in place
  EXPECT_EQ(trainer[266], 0xee);
  EXPECT_THAT((*r)->CheckIntact(), IsOk());
  EXPECT_THAT((*r)->Describe(), HasSubstr("memfd region 'memfd:"));
  // The one-session rule holds for memfds too.
  EXPECT_THAT(ShmRegion::Adopt(dup(fd.get()), "memfd", MemfdName(fd.get()), 0, 4096, "s2").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another session")));
  munmap(trainer, bytes);
}

}  // namespace
}  // namespace diond::memory
