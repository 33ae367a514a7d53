// MEMFD regions and the fd channel against the real daemon (docs/DATA_PLANE.md), over its real
// Unix sockets: the trainer side below makes sealed memfds, sends them with SCM_RIGHTS on the fd
// channel, and presents the tokens to RegisterRegion over gRPC.
//  - a training run over memfd matches the same run over POSIX shm bit for bit (and the replay);
//  - seals are enforced (missing F_SEAL_SHRINK / F_SEAL_GROW named; a sealed memfd cannot be
//    truncated by the trainer);
//  - every fd-channel error: wrong, reused and expired tokens, no fd, several fds, a foreign uid,
//    a closed connection, an fd of the wrong kind (pipe, regular file, shm segment) or size, the
//    per-uid quota; TCP callers refused;
//  - no fd leaks in the daemon (/proc/<pid>/fd) across 1,000 registrations;
//  - CUDA region kinds are FAILED_PRECONDITION on a CPU daemon.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;

// ---- the trainer's side of the fd channel ------------------------------------------------------

struct Reply {
  uint32_t code = 99;
  std::string text;
  bool closed = false;
};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

Fd Connect(const std::string& path) {
  Fd s(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ADD_FAILURE() << "connect " << path << ": " << std::strerror(errno);
  }
  return s;
}

std::string Header(uint32_t kind) {
  std::string h = "DIONDFD1";
  for (uint32_t v : {1u, kind}) {
    for (int i = 0; i < 4; ++i) h += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return h;
}

bool SendWithFds(int s, const std::string& bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
  if (!fds.empty()) {
    m.msg_control = control.data();
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(s, &m, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

bool ReadExact(int s, char* out, size_t n) {
  size_t have = 0;
  while (have < n) {
    ssize_t r = recv(s, out + have, n - have, 0);
    if (r <= 0) return false;
    have += static_cast<size_t>(r);
  }
  return true;
}

Reply ReadReply(int s) {
  Reply r;
  char h[16];
  if (!ReadExact(s, h, sizeof(h))) {
    r.closed = true;
    return r;
  }
  EXPECT_EQ(std::string(h, 8), "DIONDFD1");
  auto le = [&](int at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
      v |= static_cast<uint32_t>(static_cast<uint8_t>(h[at + i])) << (8 * i);
    return v;
  };
  r.code = le(8);
  r.text.resize(le(12));
  if (!ReadExact(s, r.text.data(), r.text.size())) r.closed = true;
  return r;
}

// Sends `fds` with one request of `kind` on a fresh connection; the reply.
Reply SendFds(const std::string& path, const std::vector<int>& fds, uint32_t kind = 1) {
  Fd s = Connect(path);
  if (!SendWithFds(s.get(), Header(kind), fds)) {
    ADD_FAILURE() << "sendmsg: " << std::strerror(errno);
  }
  return ReadReply(s.get());
}

std::string Token(const std::string& path, int fd, uint32_t kind = 1) {
  Reply r = SendFds(path, {fd}, kind);
  EXPECT_EQ(r.code, 0u) << r.text;
  return r.text;
}

Fd Memfd(int64_t bytes, int seals = F_SEAL_SHRINK | F_SEAL_GROW) {
  Fd fd(memfd_create("memfd-service-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_GE(fd.get(), 0);
  EXPECT_EQ(ftruncate(fd.get(), bytes), 0);
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

int CountFds(pid_t pid) {
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

// ---- a session over one memfd -----------------------------------------------------------------

struct MemfdSession {
  std::string id;
  v1::CreateSessionResponse layout;
  Fd fd;
  uint8_t* base = nullptr;
  int64_t size = 0, grad_base = 0;
  std::string param_region, grad_region;
  ~MemfdSession() {
    if (base != nullptr) munmap(base, static_cast<size_t>(size));
  }
  void WriteGrad(size_t i, const std::vector<float>& g) {
    std::memcpy(base + grad_base + layout.layout(static_cast<int>(i)).grad_offset_bytes(), g.data(),
                g.size() * sizeof(float));
  }
  std::string Params() const {
    return std::string(reinterpret_cast<const char*>(base), layout.param_arena_bytes());
  }
};

grpc::Status RegisterMemfd(v1::Optimizer::Stub& stub, const std::string& session,
                           v1::RegionRole role, const std::string& token, int64_t offset,
                           int64_t size, std::string* id = nullptr) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_MEMFD);
  req.mutable_memfd()->set_fd_token(token);
  req.mutable_memfd()->set_offset_bytes(offset);
  req.mutable_memfd()->set_size_bytes(size);
  v1::RegisterRegionResponse resp;
  auto ctx = Ctx();
  grpc::Status s = stub.RegisterRegion(ctx.get(), req, &resp);
  if (id != nullptr) *id = resp.region_id();
  return s;
}

std::unique_ptr<MemfdSession> CreateMemfdSession(v1::Optimizer::Stub& stub,
                                                 const v1::CreateSessionRequest& req) {
  auto m = std::make_unique<MemfdSession>();
  auto ctx = Ctx();
  grpc::Status s = stub.CreateSession(ctx.get(), req, &m->layout);
  if (!s.ok()) {
    ADD_FAILURE() << s.error_message();
    return nullptr;
  }
  m->id = m->layout.session_id();
  const std::string path = m->layout.fd_channel_socket();
  m->grad_base = (m->layout.param_arena_bytes() + 4095) / 4096 * 4096;
  m->size = m->grad_base + m->layout.grad_arena_bytes();
  m->fd = Memfd(m->size);
  m->base = static_cast<uint8_t*>(mmap(nullptr, static_cast<size_t>(m->size),
                                       PROT_READ | PROT_WRITE, MAP_SHARED, m->fd.get(), 0));
  s = RegisterMemfd(stub, m->id, v1::REGION_ROLE_PARAMETERS, Token(path, m->fd.get()), 0,
                    m->layout.param_arena_bytes(), &m->param_region);
  if (!s.ok()) {
    ADD_FAILURE() << s.error_message();
    return nullptr;
  }
  s = RegisterMemfd(stub, m->id, v1::REGION_ROLE_GRADIENTS, Token(path, m->fd.get()), m->grad_base,
                    m->layout.grad_arena_bytes(), &m->grad_region);
  if (!s.ok()) {
    ADD_FAILURE() << s.error_message();
    return nullptr;
  }
  return m;
}

class Memfd_ : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = Daemon::Start({"--fd_token_ttl=1s", "--fd_max_pending_per_uid=16"}, true).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr); }
  static std::string Path() { return daemon_->dir() + "/d.sock.fd"; }
  static SessionDesc Desc() {
    SessionDesc d;
    d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
    d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
    d.params.push_back({"w", {16, 8}, "m"});
    d.params.push_back({"b", {8}, "a"});
    return d;
  }
  // A session with no regions yet; its CreateSessionResponse.
  static v1::CreateSessionResponse NewSession() {
    v1::CreateSessionResponse resp;
    auto ctx = Ctx();
    EXPECT_TRUE(daemon_->stub().CreateSession(ctx.get(), Desc().Request(), &resp).ok());
    return resp;
  }
  static Daemon* daemon_;
};
Daemon* Memfd_::daemon_ = nullptr;

TEST_F(Memfd_, CreateSessionAnnouncesTheFdChannel) {
  v1::CreateSessionResponse r = NewSession();
  EXPECT_EQ(r.fd_channel_socket(), Path());
  std::vector<int> kinds(r.region_kinds().begin(), r.region_kinds().end());
  EXPECT_EQ(kinds, (std::vector<int>{v1::REGION_KIND_SYSTEM_SHM, v1::REGION_KIND_MEMFD}));
  struct stat st;
  ASSERT_EQ(stat(Path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(Memfd_, TrainingOverMemfdMatchesShmBitForBit) {
  const SessionDesc d = Desc();
  auto ctx = kernels::Context::CpuDefault();
  auto replay = *Replay::Create(d);
  auto shm = CreateShmSession(daemon_->stub(), d.Request());
  auto mem = CreateMemfdSession(daemon_->stub(), d.Request());
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(mem, nullptr);
  // The same initial weights, written by the trainer into its own memory.
  for (size_t i = 0; i < d.params.size(); ++i) {
    replay->params()[i] = SyntheticValues(1, 0, i, d.Numel(i));
    const std::string bytes = FloatBytes(replay->params()[i]);
    shm->params_seg->Write(shm->tensor(i).param_offset_bytes(), bytes);
    std::memcpy(mem->base + mem->layout.layout(static_cast<int>(i)).param_offset_bytes(),
                bytes.data(), bytes.size());
  }
  for (int64_t t = 1; t <= 5; ++t) {
    std::vector<std::vector<float>> g;
    for (size_t i = 0; i < d.params.size(); ++i) g.push_back(SyntheticValues(9, t, i, d.Numel(i)));
    for (size_t i = 0; i < g.size(); ++i) {
      shm->WriteGrad(i, g[i]);
      mem->WriteGrad(i, g[i]);
    }
    v1::StepResponse a, b;
    ASSERT_TRUE(DoStep(daemon_->stub(), shm->id, t, &a).ok());
    grpc::Status s = DoStep(daemon_->stub(), mem->id, t, &b);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(replay->Step(*ctx, g).ok());
    ASSERT_EQ(mem->Params(), shm->params_seg->Bytes(0, shm->layout.param_arena_bytes()))
        << "step " << t;
    for (size_t i = 0; i < d.params.size(); ++i) {
      const auto& tl = mem->layout.layout(static_cast<int>(i));
      EXPECT_EQ(mem->Params().substr(tl.param_offset_bytes(), tl.size_bytes()),
                FloatBytes(replay->params()[i]))
          << d.params[i].name << " step " << t;
    }
  }
  // The daemon wrote into the trainer's memfd in place: nonzero weights that moved.
  EXPECT_NE(mem->Params().substr(0, 64), FloatBytes(SyntheticValues(1, 0, 0, 16)));
  EXPECT_TRUE(CloseSession(daemon_->stub(), shm->id).ok());
  EXPECT_TRUE(CloseSession(daemon_->stub(), mem->id).ok());
}

TEST_F(Memfd_, SealsAreEnforced) {
  v1::CreateSessionResponse r = NewSession();
  const int64_t bytes = r.param_arena_bytes();
  struct Case {
    int seals;
    const char* message;
  };
  for (const Case& c :
       {Case{0, "lacks F_SEAL_SHRINK and F_SEAL_GROW"}, Case{F_SEAL_SHRINK, "lacks F_SEAL_GROW"},
        Case{F_SEAL_GROW, "lacks F_SEAL_SHRINK"},
        Case{F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE, "has F_SEAL_WRITE"}}) {
    Fd m = Memfd(bytes, c.seals);
    grpc::Status s = RegisterMemfd(daemon_->stub(), r.session_id(), v1::REGION_ROLE_PARAMETERS,
                                   Token(Path(), m.get()), 0, bytes);
    EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION) << c.message;
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.message)) << s.error_message();
  }
  // Sealed, registered, and the trainer can no longer shrink or grow it.
  Fd m = Memfd(bytes);
  ASSERT_TRUE(RegisterMemfd(daemon_->stub(), r.session_id(), v1::REGION_ROLE_PARAMETERS,
                            Token(Path(), m.get()), 0, bytes)
                  .ok());
  EXPECT_NE(ftruncate(m.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(m.get(), bytes * 2), 0);
  EXPECT_TRUE(CloseSession(daemon_->stub(), r.session_id()).ok());
}

TEST_F(Memfd_, TokenErrors) {
  v1::CreateSessionResponse r = NewSession();
  const std::string& id = r.session_id();
  const int64_t bytes = r.param_arena_bytes();
  auto reg = [&](const std::string& token) {
    return RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_PARAMETERS, token, 0, bytes);
  };
  // Malformed and unknown.
  grpc::Status s = reg("");
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "fd_token must be")) << s.error_message();
  s = reg(std::string(32, '0'));
  EXPECT_EQ(s.error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "not known to this daemon"))
      << s.error_message();
  // Reused.
  Fd m = Memfd(bytes);
  const std::string token = Token(Path(), m.get());
  std::string region;
  ASSERT_TRUE(
      RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_PARAMETERS, token, 0, bytes, &region)
          .ok());
  s = RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_GRADIENTS, token, 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "already used")) << s.error_message();
  // Expired: the suite's daemon runs with --fd_token_ttl=1s.
  const std::string late = Token(Path(), m.get());
  sleep(3);
  s = RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_GRADIENTS, late, 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "expired")) << s.error_message();
  // A token of another kind.
  const std::string vmm = Token(Path(), m.get(), 2);
  s = RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_GRADIENTS, vmm, 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "sent as a CUDA VMM fd")) << s.error_message();
  EXPECT_TRUE(CloseSession(daemon_->stub(), id).ok());
}

TEST_F(Memfd_, WrongKindOrSizeOfFd) {
  v1::CreateSessionResponse r = NewSession();
  const std::string& id = r.session_id();
  const int64_t bytes = r.param_arena_bytes();
  auto reg = [&](int fd, int64_t offset, int64_t size) {
    return RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_PARAMETERS, Token(Path(), fd), offset,
                         size);
  };
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  Fd rd(p[0]), wr(p[1]);
  grpc::Status s = reg(rd.get(), 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "is a pipe, not a memfd")) << s.error_message();
  const std::string file = daemon_->dir() + "/plain-file";
  Fd f(open(file.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  ASSERT_EQ(ftruncate(f.get(), bytes), 0);
  s = reg(f.get(), 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "is a regular file, not a memfd"))
      << s.error_message();
  auto seg = ShmSegment::Create(bytes);
  Fd shm(shm_open(("/" + seg->name()).c_str(), O_RDWR | O_CLOEXEC, 0));
  s = reg(shm.get(), 0, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "not a memfd")) << s.error_message();
  // Sizes: smaller than the arena; larger than the memfd; a misaligned offset.
  Fd m = Memfd(bytes);
  s = reg(m.get(), 0, bytes - 4);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "smaller than the PARAMETERS arena"))
      << s.error_message();
  s = reg(m.get(), 256, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "memfd region")) << s.error_message();
  s = reg(m.get(), 8, bytes);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "multiple of 256")) << s.error_message();
  EXPECT_TRUE(CloseSession(daemon_->stub(), id).ok());
}

TEST_F(Memfd_, ChannelRefusesBadRequestsAndSurvivesClosedConnections) {
  Fd a = Memfd(4096), b = Memfd(4096);
  Reply none = SendFds(Path(), {});
  EXPECT_EQ(none.code, static_cast<uint32_t>(StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StrContains(none.text, "no file descriptor")) << none.text;
  Reply several = SendFds(Path(), {a.get(), b.get()});
  EXPECT_EQ(several.code, static_cast<uint32_t>(StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StrContains(several.text, "2 file descriptors")) << several.text;
  {  // Closed after half a request, with an fd attached; and closed before sending anything.
    Fd s = Connect(Path());
    ASSERT_TRUE(SendWithFds(s.get(), Header(1).substr(0, 5), {a.get()}));
  }
  { Fd s = Connect(Path()); }
  // The channel still serves.
  EXPECT_EQ(SendFds(Path(), {a.get()}).code, 0u);
  EXPECT_TRUE(daemon_->Alive());
}

TEST_F(Memfd_, ForeignUidCannotRedeemAToken) {
  // A process of uid 65534 sends a memfd over the channel (the test opens the socket to it);
  // root presents its token over gRPC: refused, since the uids differ, even for an admin.
  if (geteuid() != 0) GTEST_SKIP() << "needs root to become another uid";
  chmod(daemon_->dir().c_str(), 0755);
  chmod(Path().c_str(), 0666);
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string path = Path();
  const std::string header = Header(1);
  pid_t child = fork();
  if (child == 0) {  // only system calls from here on
    close(out[0]);
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(2);
    int m = memfd_create("foreign", MFD_ALLOW_SEALING);
    if (m < 0 || ftruncate(m, 1 << 16) != 0 ||
        fcntl(m, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      _exit(3);
    }
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(4);
    if (!SendWithFds(s, header, {m})) _exit(5);
    char buf[16 + 512];
    if (recv(s, buf, 16, MSG_WAITALL) != 16) _exit(6);
    const size_t len = static_cast<size_t>(static_cast<uint8_t>(buf[12])) |
                       static_cast<size_t>(static_cast<uint8_t>(buf[13])) << 8;
    if (len > 512 ||
        (len > 0 && recv(s, buf + 16, len, MSG_WAITALL) != static_cast<ssize_t>(len))) {
      _exit(7);
    }
    if (write(out[1], buf, 16 + len) != static_cast<ssize_t>(16 + len)) _exit(8);
    _exit(0);
  }
  close(out[1]);
  std::string reply;
  char buf[1024];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0) reply.append(buf, static_cast<size_t>(n));
  close(out[0]);
  int status = 0;
  waitpid(child, &status, 0);
  chmod(Path().c_str(), 0600);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ASSERT_GE(reply.size(), 16u + 32u);
  const std::string token = reply.substr(16, 32);
  v1::CreateSessionResponse r = NewSession();
  grpc::Status s = RegisterMemfd(daemon_->stub(), r.session_id(), v1::REGION_ROLE_PARAMETERS, token,
                                 0, r.param_arena_bytes());
  EXPECT_EQ(s.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "sent by uid 65534; the caller is uid 0"))
      << s.error_message();
  EXPECT_TRUE(CloseSession(daemon_->stub(), r.session_id()).ok());
}

TEST_F(Memfd_, PendingTokensAreCappedPerUid) {
  // The suite's daemon allows 16 pending tokens per uid; earlier tests' tokens are spent or
  // expire within 1 s.
  sleep(2);
  Fd m = Memfd(4096);
  std::vector<std::string> tokens;
  for (int i = 0; i < 16; ++i) tokens.push_back(Token(Path(), m.get()));
  Reply over = SendFds(Path(), {m.get()});
  EXPECT_EQ(over.code, static_cast<uint32_t>(StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_TRUE(absl::StrContains(over.text, "per uid")) << over.text;
  sleep(3);  // they expire, and their fds are closed
  EXPECT_EQ(SendFds(Path(), {m.get()}).code, 0u);
}

TEST_F(Memfd_, TcpCallersCannotRegisterMemfd) {
  v1::CreateSessionResponse r = NewSession();
  Fd m = Memfd(r.param_arena_bytes());
  auto tcp = daemon_->NewTcpStub();
  grpc::Status s = RegisterMemfd(*tcp, r.session_id(), v1::REGION_ROLE_PARAMETERS,
                                 Token(Path(), m.get()), 0, r.param_arena_bytes());
  EXPECT_EQ(s.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "Unix socket")) << s.error_message();
  EXPECT_TRUE(CloseSession(daemon_->stub(), r.session_id()).ok());
}

TEST_F(Memfd_, NoFdLeaksAcrossAThousandRegistrations) {
  sleep(2);  // earlier tests' pending tokens expire
  v1::CreateSessionResponse r = NewSession();
  const std::string& id = r.session_id();
  const int64_t bytes = r.param_arena_bytes();
  Fd m = Memfd(bytes);
  auto cycle = [&](int i) {
    std::string region;
    grpc::Status s = RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_PARAMETERS,
                                   Token(Path(), m.get()), 0, bytes, &region);
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
    auto ctx = Ctx();
    v1::UnregisterRegionRequest u;
    u.set_session_id(id);
    u.set_region_id(region);
    v1::UnregisterRegionResponse ur;
    ASSERT_TRUE(daemon_->stub().UnregisterRegion(ctx.get(), u, &ur).ok());
    if (i % 10 == 0) {  // refused registrations must not leak either
      Fd unsealed = Memfd(bytes, 0);
      EXPECT_EQ(RegisterMemfd(daemon_->stub(), id, v1::REGION_ROLE_PARAMETERS,
                              Token(Path(), unsealed.get()), 0, bytes)
                    .error_code(),
                StatusCode::FAILED_PRECONDITION);
    }
  };
  for (int i = 0; i < 20; ++i) cycle(i);  // warm-up: gRPC's own fds settle
  // The channel's thread closes a connection once it sees the client's close, so a count taken
  // right after a cycle may still include the last one (CI saw 17 before, 16 after): the
  // settled, lowest count over a second.
  int before = CountFds(daemon_->pid());
  for (int i = 0; i < 10; ++i) {
    usleep(100000);
    before = std::min(before, CountFds(daemon_->pid()));
  }
  ASSERT_GT(before, 0);
  for (int i = 0; i < 1000; ++i) {
    cycle(i);
    if (HasFatalFailure()) return;
  }
  // The channel's thread closes a connection once it sees the client's close; wait for it
  // (up to 10 s; one fd kept per registration would leave 1,000 more).
  int after = CountFds(daemon_->pid());
  for (int i = 0; i < 100 && after > before; ++i) {
    usleep(100000);
    after = CountFds(daemon_->pid());
  }
  EXPECT_LE(after, before) << "the daemon's open fds after 1,000 memfd registrations";
  EXPECT_TRUE(CloseSession(daemon_->stub(), id).ok());
}

TEST_F(Memfd_, CudaKindsAreRefusedOnACpuDaemon) {
  v1::CreateSessionResponse r = NewSession();
  auto reg = [&](const v1::RegisterRegionRequest& req) {
    v1::RegisterRegionResponse resp;
    auto ctx = Ctx();
    return daemon_->stub().RegisterRegion(ctx.get(), req, &resp);
  };
  v1::RegisterRegionRequest ipc;
  ipc.set_session_id(r.session_id());
  ipc.set_role(v1::REGION_ROLE_PARAMETERS);
  ipc.set_kind(v1::REGION_KIND_CUDA_IPC);
  ipc.mutable_cuda_ipc()->set_mem_handle(std::string(64, '\x01'));
  ipc.mutable_cuda_ipc()->set_gpu_uuid(std::string(16, '\xab'));
  ipc.mutable_cuda_ipc()->set_size_bytes(r.param_arena_bytes());
  grpc::Status s = reg(ipc);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(),
                                "REGION_KIND_CUDA_IPC needs a daemon that computes on a GPU"))
      << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "GPU-abababab-abab")) << s.error_message();
  ipc.mutable_cuda_ipc()->set_mem_handle("short");
  s = reg(ipc);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "64 bytes")) << s.error_message();

  Fd m = Memfd(4096);  // stands in for the exported VMM fd
  const std::string token = Token(Path(), m.get(), 2);
  v1::RegisterRegionRequest vmm;
  vmm.set_session_id(r.session_id());
  vmm.set_role(v1::REGION_ROLE_GRADIENTS);
  vmm.set_kind(v1::REGION_KIND_CUDA_VMM_FD);
  vmm.mutable_cuda_vmm_fd()->set_gpu_uuid(std::string(16, '\x01'));
  vmm.mutable_cuda_vmm_fd()->set_size_bytes(r.grad_arena_bytes());
  vmm.mutable_cuda_vmm_fd()->set_granularity_bytes(2 << 20);
  vmm.mutable_cuda_vmm_fd()->set_fd_token(token);
  s = reg(vmm);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "REGION_KIND_CUDA_VMM_FD needs a daemon"))
      << s.error_message();
  s = reg(vmm);  // the refused request consumed the token (and closed its fd)
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "already used")) << s.error_message();
  EXPECT_TRUE(CloseSession(daemon_->stub(), r.session_id()).ok());
}

TEST(MemfdOff, NoFdChannelMeansNoMemfdRegions) {
  auto daemon = Daemon::Start({"--fd_channel_socket=none"});
  ASSERT_NE(daemon, nullptr);
  v1::CreateSessionResponse r;
  SessionDesc d;
  d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"b", {8}, "a"});
  {
    auto ctx = Ctx();
    ASSERT_TRUE(daemon->stub().CreateSession(ctx.get(), d.Request(), &r).ok());
  }
  EXPECT_EQ(r.fd_channel_socket(), "");
  ASSERT_EQ(r.region_kinds_size(), 1);
  EXPECT_EQ(r.region_kinds(0), v1::REGION_KIND_SYSTEM_SHM);
  struct stat st;
  EXPECT_NE(stat((daemon->dir() + "/d.sock.fd").c_str(), &st), 0);
  grpc::Status s = RegisterMemfd(daemon->stub(), r.session_id(), v1::REGION_ROLE_PARAMETERS,
                                 std::string(32, 'a'), 0, r.param_arena_bytes());
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "has none")) << s.error_message();
}

}  // namespace
}  // namespace diond::service_testing
