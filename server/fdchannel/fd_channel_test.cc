// The fd channel: TokenTable's rules on a fake clock, and FdChannel over a real Unix socket with
// real SCM_RIGHTS messages (a well-behaved sender and every malformed one). The daemon-level
// flow (RegisterRegion presenting the token, uid checks, the fd-leak count) is tested against the
// real daemon in tests/service/memfd_service_test.cc.
#include "server/fdchannel/fd_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::fdchannel {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

UniqueFd Memfd() { return UniqueFd(memfd_create("fd-channel-test", MFD_CLOEXEC)); }

int OpenFds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (fcntl(fd, F_GETFD) >= 0) ++n;
  }
  return n;
}

TEST(TokenTable, TokenIsOneTimeBoundToUidAndKind) {
  TokenTable t(TokenOptions{});
  const absl::Time now = absl::FromUnixSeconds(1000);
  UniqueFd fd = Memfd();
  const int raw = fd.get();
  auto token = t.Put(std::move(fd), 1000, FdKind::kMemfd, now);
  ASSERT_THAT(token.status(), IsOk());
  EXPECT_EQ(token->size(), kTokenChars);
  EXPECT_EQ(t.pending(), 1);
  EXPECT_THAT(t.Take(*token, 1001, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("sent by uid 1000; the caller is uid 1001")));
  EXPECT_THAT(t.Take(*token, 1000, FdKind::kCudaVmm, now).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sent as a memfd")));
  auto got = t.Take(*token, 1000, FdKind::kMemfd, now);  // the refusals left it pending
  ASSERT_THAT(got.status(), IsOk());
  EXPECT_EQ(got->get(), raw);
  EXPECT_EQ(t.pending(), 0);
  EXPECT_THAT(t.Take(*token, 1000, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already used")));
}

TEST(TokenTable, TokensExpireAndCloseTheirFd) {
  TokenOptions o;
  o.ttl = absl::Seconds(5);
  TokenTable t(o);
  const absl::Time now = absl::FromUnixSeconds(1000);
  UniqueFd fd = Memfd();
  const int raw = fd.get();
  auto token = t.Put(std::move(fd), 7, FdKind::kMemfd, now);
  ASSERT_THAT(token.status(), IsOk());
  t.Sweep(now + absl::Seconds(4));
  EXPECT_EQ(t.pending(), 1);
  EXPECT_GE(fcntl(raw, F_GETFD), 0);
  t.Sweep(now + absl::Seconds(5));
  EXPECT_EQ(t.pending(), 0);
  EXPECT_LT(fcntl(raw, F_GETFD), 0) << "an expired token's fd must be closed";
  EXPECT_THAT(t.Take(*token, 7, FdKind::kMemfd, now + absl::Seconds(6)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expired")));
}

TEST(TokenTable, MalformedAndUnknownTokens) {
  TokenTable t(TokenOptions{});
  const absl::Time now = absl::Now();
  EXPECT_THAT(t.Take("", 0, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("32 lowercase hex")));
  EXPECT_THAT(t.Take(std::string(32, 'G'), 0, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(t.Take(std::string(32, 'a'), 0, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not known")));
}

TEST(TokenTable, QuotasPerUidAndInTotal) {
  TokenOptions o;
  o.max_pending_per_uid = 2;
  o.max_pending = 3;
  TokenTable t(o);
  const absl::Time now = absl::Now();
  ASSERT_THAT(t.Put(Memfd(), 1, FdKind::kMemfd, now).status(), IsOk());
  auto second = t.Put(Memfd(), 1, FdKind::kMemfd, now);
  ASSERT_THAT(second.status(), IsOk());
  EXPECT_THAT(t.Put(Memfd(), 1, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("per uid")));
  ASSERT_THAT(t.Put(Memfd(), 2, FdKind::kMemfd, now).status(), IsOk());
  EXPECT_THAT(t.Put(Memfd(), 3, FdKind::kMemfd, now).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("unredeemed tokens")));
  ASSERT_THAT(t.Take(*second, 1, FdKind::kMemfd, now).status(), IsOk());  // frees one place
  EXPECT_THAT(t.Put(Memfd(), 1, FdKind::kMemfd, now).status(), IsOk());
}

// ---- over the socket ----

struct Answer {
  uint32_t code = 99;
  std::string text;
  bool closed = false;  // the daemon closed the connection (no reply)
};

class Channel : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = absl::StrCat(::testing::TempDir(), "/fdch-", getpid(), ".sock");
    auto c = FdChannel::Start(path_, TokenOptions{});
    ASSERT_THAT(c.status(), IsOk());
    channel_ = *std::move(c);
  }
  UniqueFd Connect() {
    UniqueFd s(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path_.data(), path_.size());
    EXPECT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return s;
  }
  static std::string Header(uint32_t kind, const char* magic = "DIONDFD1", uint32_t version = 1) {
    std::string h(16, '\0');
    std::memcpy(h.data(), magic, 8);
    for (int i = 0; i < 4; ++i) h[8 + i] = static_cast<char>(version >> (8 * i));
    for (int i = 0; i < 4; ++i) h[12 + i] = static_cast<char>(kind >> (8 * i));
    return h;
  }
  static void Send(int s, const std::string& bytes, const std::vector<int>& fds) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
    if (!fds.empty()) {
      m.msg_control = control.data();
      m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ASSERT_EQ(sendmsg(s, &m, MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  }
  static Answer Read(int s) {
    Answer a;
    char h[16];
    size_t have = 0;
    while (have < sizeof(h)) {
      ssize_t n = recv(s, h + have, sizeof(h) - have, 0);
      if (n <= 0) {
        a.closed = true;
        return a;
      }
      have += static_cast<size_t>(n);
    }
    EXPECT_EQ(std::memcmp(h, "DIONDFD1", 8), 0);
    uint32_t len = 0;
    a.code = 0;
    for (int i = 0; i < 4; ++i)
      a.code |= static_cast<uint32_t>(static_cast<uint8_t>(h[8 + i])) << (8 * i);
    for (int i = 0; i < 4; ++i)
      len |= static_cast<uint32_t>(static_cast<uint8_t>(h[12 + i])) << (8 * i);
    a.text.resize(len);
    have = 0;
    while (have < len) {
      ssize_t n = recv(s, a.text.data() + have, len - have, 0);
      if (n <= 0) break;
      have += static_cast<size_t>(n);
    }
    return a;
  }
  std::string path_;
  std::unique_ptr<FdChannel> channel_;
};

TEST_F(Channel, SocketIsOwnerOnly) {
  struct stat st;
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(Channel, TokenRedeemsTheSameFileForTheSenderUid) {
  UniqueFd s = Connect();
  UniqueFd m = Memfd();
  ASSERT_EQ(ftruncate(m.get(), 4096), 0);
  struct stat mine;
  ASSERT_EQ(fstat(m.get(), &mine), 0);
  Send(s.get(), Header(1), {m.get()});
  Answer a = Read(s.get());
  ASSERT_EQ(a.code, 0u) << a.text;
  ASSERT_EQ(a.text.size(), kTokenChars);
  // Several requests on one connection.
  Send(s.get(), Header(1), {m.get()});
  Answer b = Read(s.get());
  ASSERT_EQ(b.code, 0u) << b.text;
  EXPECT_NE(a.text, b.text);
  EXPECT_EQ(channel_->pending(), 2);
  auto fd = channel_->Take(a.text, getuid(), FdKind::kMemfd);
  ASSERT_THAT(fd.status(), IsOk());
  struct stat theirs;
  ASSERT_EQ(fstat(fd->get(), &theirs), 0);
  EXPECT_EQ(theirs.st_ino, mine.st_ino);
  EXPECT_THAT(channel_->Take(a.text, getuid(), FdKind::kMemfd).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already used")));
  EXPECT_THAT(channel_->Take(b.text, getuid() + 1, FdKind::kMemfd).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST_F(Channel, MalformedRequestsAreAnsweredAndTheirFdsClosed) {
  const int before = OpenFds();
  {
    UniqueFd s = Connect();
    UniqueFd m1 = Memfd(), m2 = Memfd();
    Send(s.get(), Header(1), {});
    Answer none = Read(s.get());
    EXPECT_EQ(none.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(none.text, HasSubstr("no file descriptor"));
    Send(s.get(), Header(1), {m1.get(), m2.get()});
    Answer several = Read(s.get());
    EXPECT_EQ(several.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(several.text, HasSubstr("2 file descriptors"));
    std::vector<int> many(12, m1.get());
    Send(s.get(), Header(1), many);
    Answer truncated = Read(s.get());
    EXPECT_THAT(truncated.text, HasSubstr("more than 8 file descriptors"));
    Send(s.get(), Header(9), {m1.get()});
    Answer kind = Read(s.get());
    EXPECT_EQ(kind.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(kind.text, HasSubstr("fd kind 9 is not known"));
    // The connection still works after those.
    Send(s.get(), Header(1), {m1.get()});
    EXPECT_EQ(Read(s.get()).code, 0u);
    // A bad magic is answered, then the connection closed.
    Send(s.get(), Header(1, "HTTP/1.1"), {m1.get()});
    Answer magic = Read(s.get());
    EXPECT_THAT(magic.text, HasSubstr("not a diond fd channel request"));
    EXPECT_TRUE(Read(s.get()).closed);
  }
  {
    UniqueFd s = Connect();
    UniqueFd m = Memfd();
    Send(s.get(), Header(1, "DIONDFD1", 2), {m.get()});
    EXPECT_THAT(Read(s.get()).text, HasSubstr("version 1"));
  }
  {  // The sender closes after half a header, with an fd attached.
    UniqueFd s = Connect();
    UniqueFd m = Memfd();
    Send(s.get(), Header(1).substr(0, 7), {m.get()});
  }
  // The channel's thread closes the refused fds; give it a moment (this is not a timing
  // assertion: the loop below waits until it happened, or fails after 10 s).
  EXPECT_EQ(channel_->pending(), 1);
  int after = OpenFds();
  for (int i = 0; i < 1000 && after != before + 1; ++i) {
    usleep(10000);
    after = OpenFds();
  }
  EXPECT_EQ(after, before + 1) << "only the one pending token's fd may stay open";
}

TEST_F(Channel, StaleSocketIsReplacedOtherFilesAreNot) {
  channel_.reset();
  // A regular file at the path is refused.
  const std::string file = path_ + ".plain";
  UniqueFd f(open(file.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  EXPECT_THAT(FdChannel::Start(file, TokenOptions{}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a socket")));
  unlink(file.c_str());
  // A stale socket file is replaced.
  UniqueFd stale(socket(AF_UNIX, SOCK_STREAM, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path_.data(), path_.size());
  ASSERT_EQ(bind(stale.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  auto c = FdChannel::Start(path_, TokenOptions{});
  EXPECT_THAT(c.status(), IsOk());
}

}  // namespace
}  // namespace diond::fdchannel
