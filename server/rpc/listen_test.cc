#include "server/rpc/listen.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempDir() {
  char tmpl[] = "/tmp/diond_listen_test_XXXXXX";
  return mkdtemp(tmpl);
}

TEST(ParseListenAddresses, ParsesUnixTcpAndIpv6) {
  auto a = ParseListenAddresses("unix:/tmp/x.sock, 127.0.0.1:0,[::1]:50551,0.0.0.0:1");
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->size(), 4u);
  EXPECT_EQ((*a)[0].kind, ListenAddress::Kind::kUnix);
  EXPECT_EQ((*a)[0].path, "/tmp/x.sock");
  EXPECT_EQ((*a)[1].host, "127.0.0.1");
  EXPECT_EQ((*a)[1].port, 0);
  EXPECT_TRUE((*a)[1].loopback);
  EXPECT_EQ((*a)[2].host, "::1");
  EXPECT_EQ((*a)[2].ToString(), "[::1]:50551");
  EXPECT_TRUE((*a)[2].loopback);
  EXPECT_FALSE((*a)[3].loopback);
}

TEST(ParseListenAddresses, RejectsBadItemsByName) {
  EXPECT_THAT(ParseListenAddresses(""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseListenAddresses("unix:"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseListenAddresses("localhost"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'localhost'")));
  EXPECT_THAT(ParseListenAddresses("127.0.0.1:70000"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("70000")));
  EXPECT_THAT(ParseListenAddresses("unix:/" + std::string(200, 'a')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit")));
}

TEST(PrepareUnixSocketPath, MissingPathIsFine) {
  std::string dir = TempDir();
  EXPECT_THAT(PrepareUnixSocketPath(dir + "/none.sock"), IsOk());
  rmdir(dir.c_str());
}

TEST(PrepareUnixSocketPath, RefusesToReplaceARegularFile) {
  std::string dir = TempDir();
  std::string path = dir + "/file";
  std::ofstream(path) << "data";
  EXPECT_THAT(PrepareUnixSocketPath(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a socket")));
  struct stat st;
  EXPECT_EQ(stat(path.c_str(), &st), 0) << "the file must survive";
  unlink(path.c_str());
  rmdir(dir.c_str());
}

int BindUnix(const std::string& path, bool listen_on_it) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  if (listen_on_it) {
    EXPECT_EQ(listen(fd, 1), 0);
  }
  return fd;
}

TEST(PrepareUnixSocketPath, LiveSocketIsAlreadyInUse) {
  std::string dir = TempDir();
  std::string path = dir + "/live.sock";
  int fd = BindUnix(path, true);
  EXPECT_THAT(PrepareUnixSocketPath(path),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("unix:" + path)));
  close(fd);
  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST(PrepareUnixSocketPath, StaleSocketIsRemoved) {
  std::string dir = TempDir();
  std::string path = dir + "/stale.sock";
  int fd = BindUnix(path, false);
  close(fd);  // the file stays, nobody accepts
  EXPECT_THAT(PrepareUnixSocketPath(path), IsOk());
  struct stat st;
  EXPECT_NE(lstat(path.c_str(), &st), 0);
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace diond::rpc
