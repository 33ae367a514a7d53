#include "server/fdchannel/fd_channel.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace diond::fdchannel {
namespace {

constexpr size_t kRememberSpent = 4096;
constexpr size_t kMaxConnections = 128;
constexpr int kMaxFdsPerMessage = 8;  // more than one is refused; more than this is truncated

uint32_t Le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
void PutLe32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// The first 8 characters, for messages: enough to tell tokens apart, too few to use one.
std::string TokenPrefix(absl::string_view token) {
  std::string p(token.substr(0, 8));
  for (char& c : p) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) c = '?';
  }
  return absl::StrCat("'", p, "...'");
}

}  // namespace

const char* FdKindName(FdKind kind) {
  switch (kind) {
    case FdKind::kMemfd:
      return "memfd";
    case FdKind::kCudaVmm:
      return "CUDA VMM fd";
  }
  return "unknown kind";
}

std::string DerivedPath(absl::string_view grpc_socket_path) {
  return absl::StrCat(grpc_socket_path, ".fd");
}

// ---- TokenTable -------------------------------------------------------------------------------

absl::StatusOr<std::string> TokenTable::Put(UniqueFd fd, uid_t uid, FdKind kind, absl::Time now) {
  uint8_t raw[kTokenChars / 2];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  std::string token =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
  absl::MutexLock lock(&mu_);
  SweepLocked(now);
  if (static_cast<int>(pending_.size()) >= options_.max_pending) {
    return absl::ResourceExhaustedError(absl::StrCat("the fd channel holds ", pending_.size(),
                                                     " unredeemed tokens (the most); redeem them "
                                                     "with RegisterRegion or let them expire"));
  }
  int& mine = per_uid_[uid];
  if (mine >= options_.max_pending_per_uid) {
    return absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " holds ", mine,
                     " unredeemed fd tokens (the most per uid); redeem them "
                     "with RegisterRegion or let them expire"));
  }
  ++mine;
  pending_.emplace(token, Entry{std::move(fd), uid, kind, now + options_.ttl});
  return token;
}

absl::StatusOr<UniqueFd> TokenTable::Take(absl::string_view token, uid_t caller, FdKind kind,
                                          absl::Time now) {
  bool hex = token.size() == kTokenChars;
  for (char c : token) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) || absl::ascii_isupper(c)) {
      hex = false;
    }
  }
  if (!hex) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fd_token must be the ", kTokenChars, " lowercase hex digits the fd channel answered; got ",
        token.size(), " characters"));
  }
  absl::MutexLock lock(&mu_);
  SweepLocked(now);
  const std::string key(token);
  auto it = pending_.find(key);
  if (it == pending_.end()) {
    auto spent = spent_.find(key);
    if (spent != spent_.end()) {
      return absl::FailedPreconditionError(
          spent->second
              ? absl::StrCat("fd_token ", TokenPrefix(token), " expired (tokens live ",
                             absl::FormatDuration(options_.ttl),
                             "); its fd was closed: send the fd again")
              : absl::StrCat("fd_token ", TokenPrefix(token),
                             " was already used (tokens are one-time): send the fd again"));
    }
    return absl::NotFoundError(
        absl::StrCat("fd_token ", TokenPrefix(token),
                     " is not known to this daemon: send the fd over its fd channel first"));
  }
  Entry& e = it->second;
  if (e.uid != caller) {
    return absl::PermissionDeniedError(absl::StrCat("fd_token ", TokenPrefix(token),
                                                    " was sent by uid ", e.uid,
                                                    "; the caller is uid ", caller));
  }
  if (e.kind != kind) {
    return absl::InvalidArgumentError(absl::StrCat("fd_token ", TokenPrefix(token),
                                                   " was sent as a ", FdKindName(e.kind),
                                                   ", not as a ", FdKindName(kind)));
  }
  UniqueFd fd = std::move(e.fd);
  if (--per_uid_[e.uid] == 0) per_uid_.erase(e.uid);
  pending_.erase(it);
  RememberLocked(key, /*expired=*/false);
  return fd;
}

void TokenTable::Sweep(absl::Time now) {
  absl::MutexLock lock(&mu_);
  SweepLocked(now);
}

int TokenTable::pending() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

void TokenTable::SweepLocked(absl::Time now) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    if (--per_uid_[it->second.uid] == 0) per_uid_.erase(it->second.uid);
    const std::string token = it->first;
    it = pending_.erase(it);  // closes the fd
    RememberLocked(token, /*expired=*/true);
  }
}

void TokenTable::RememberLocked(const std::string& token, bool expired) {
  spent_[token] = expired;
  spent_order_.push_back(token);
  while (spent_order_.size() > kRememberSpent) {
    spent_.erase(spent_order_.front());
    spent_order_.pop_front();
  }
}

// ---- FdChannel --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Start(const std::string& path,
                                                            TokenOptions options) {
  std::unique_ptr<FdChannel> c(new FdChannel(options));
  c->path_ = path;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel socket path '", path,
                                                   "' is empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("fd channel socket path ", path, " exists and is not a socket"));
    }
    unlink(path.c_str());  // a stale socket of an earlier daemon
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  c->listen_fd_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!c->listen_fd_.valid()) {
    return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  mode_t old_mask = umask(0177);  // created 0600, as the gRPC socket
  int rc = bind(c->listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  umask(old_mask);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the fd channel at ", path, ": ", std::strerror(err)));
  }
  chmod(path.c_str(), 0600);
  if (listen(c->listen_fd_.get(), 64) != 0) {
    err = errno;
    unlink(path.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot listen on the fd channel at ", path, ": ", std::strerror(err)));
  }
  c->wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!c->wake_fd_.valid()) {
    err = errno;
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(err)));
  }
  c->thread_ = std::thread([raw = c.get()] { raw->Loop(); });
  return c;
}

FdChannel::~FdChannel() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_.get(), &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }
  if (listen_fd_.valid()) unlink(path_.c_str());
}

absl::StatusOr<UniqueFd> FdChannel::Take(absl::string_view token, uid_t caller, FdKind kind) {
  auto fd = tokens_.Take(token, caller, kind, absl::Now());
  if (!fd.ok() && fd.status().code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(absl::StrCat(fd.status().message(), " (", path_, ")"));
  }
  return fd;
}

namespace {

struct Connection {
  UniqueFd fd;
  uid_t uid = 0;
  uint8_t header[kHeaderBytes] = {};
  size_t have = 0;
  std::vector<UniqueFd> fds;  // that came with the request being read
  bool truncated = false;     // MSG_CTRUNC: more fds than kMaxFdsPerMessage
};

// False if the reply could not be sent whole (the connection is then closed).
bool Reply(int fd, absl::StatusCode code, absl::string_view text) {
  if (text.size() > kMaxReplyText) text = text.substr(0, kMaxReplyText);
  std::string out(kHeaderBytes + text.size(), '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  std::memcpy(p, kMagic, sizeof(kMagic));
  PutLe32(p + 8, static_cast<uint32_t>(code));
  PutLe32(p + 12, static_cast<uint32_t>(text.size()));
  std::memcpy(p + kHeaderBytes, text.data(), text.size());
  ssize_t n = send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return n == static_cast<ssize_t>(out.size());
}

}  // namespace

void FdChannel::Loop() {
  std::vector<std::unique_ptr<Connection>> conns;
  std::vector<pollfd> pfds;
  while (true) {
    pfds.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (const auto& c : conns) pfds.push_back({c->fd.get(), POLLIN, 0});
    int n = poll(pfds.data(), pfds.size(), 1000);
    tokens_.Sweep(absl::Now());  // expired tokens close their fds within about a second
    if (n < 0) {
      if (errno == EINTR) continue;
      DIOND_LOG(ERROR) << "fd channel " << path_ << ": poll: " << std::strerror(errno);
      return;
    }
    if (pfds[0].revents != 0) return;  // stop: the connections close with `conns`
    std::vector<bool> drop(conns.size(), false);
    for (size_t i = 0; i < conns.size(); ++i) {
      if (pfds[i + 2].revents == 0) continue;
      Connection& c = *conns[i];
      char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
      iovec iov{c.header + c.have, kHeaderBytes - c.have};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ssize_t got = recvmsg(c.fd.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); got >= 0 && cm != nullptr;
           cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t k = 0; k < count; ++k) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof(int));
          c.fds.emplace_back(fd);
        }
      }
      if (got >= 0 && (msg.msg_flags & MSG_CTRUNC) != 0) c.truncated = true;
      if (got <= 0) {  // closed by the peer (mid-request or not), or an error: drop its fds
        if (c.have > 0 || !c.fds.empty()) {
          DIOND_LOG(DEBUG) << "fd channel: uid " << c.uid << " closed the connection after "
                           << c.have << " of " << kHeaderBytes << " request bytes";
        }
        drop[i] = true;
        continue;
      }
      c.have += static_cast<size_t>(got);
      if (c.have < kHeaderBytes) continue;
      // A whole request.
      std::vector<UniqueFd> fds = std::move(c.fds);
      c.fds.clear();
      const bool truncated = std::exchange(c.truncated, false);
      c.have = 0;
      if (std::memcmp(c.header, kMagic, sizeof(kMagic)) != 0 || Le32(c.header + 8) != kVersion) {
        Reply(c.fd.get(), absl::StatusCode::kInvalidArgument,
              absl::StrCat("not a diond fd channel request: the header must start with "
                           "\"DIONDFD1\" and version ",
                           kVersion, "; closing the connection"));
        drop[i] = true;
        continue;
      }
      const uint32_t kind = Le32(c.header + 12);
      absl::Status bad;
      if (kind != static_cast<uint32_t>(FdKind::kMemfd) &&
          kind != static_cast<uint32_t>(FdKind::kCudaVmm)) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("fd kind ", kind, " is not known (1 = memfd, 2 = CUDA VMM fd)"));
      } else if (truncated) {
        bad = absl::InvalidArgumentError(absl::StrCat(
            "more than ", kMaxFdsPerMessage,
            " file descriptors came with the request; send exactly one (all were closed)"));
      } else if (fds.empty()) {
        bad = absl::InvalidArgumentError(
            "no file descriptor came with the request: attach exactly one with SCM_RIGHTS to "
            "its 16 header bytes");
      } else if (fds.size() > 1) {
        bad = absl::InvalidArgumentError(
            absl::StrCat(fds.size(),
                         " file descriptors came with the request; send exactly one (all were "
                         "closed)"));
      }
      if (!bad.ok()) {
        fds.clear();
        if (!Reply(c.fd.get(), bad.code(), bad.message())) drop[i] = true;
        continue;
      }
      auto token = tokens_.Put(std::move(fds[0]), c.uid, static_cast<FdKind>(kind), absl::Now());
      const bool sent = token.ok()
                            ? Reply(c.fd.get(), absl::StatusCode::kOk, *token)
                            : Reply(c.fd.get(), token.status().code(), token.status().message());
      if (!sent) drop[i] = true;  // an unanswered token expires and closes its fd
    }
    for (size_t i = conns.size(); i-- > 0;) {
      if (drop[i]) conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (pfds[1].revents != 0) {
      while (true) {
        UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!fd.valid()) break;
        ucred cred{};
        socklen_t len = sizeof(cred);
        if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) continue;
        if (conns.size() >= kMaxConnections) {
          Reply(fd.get(), absl::StatusCode::kResourceExhausted,
                absl::StrCat("the fd channel has ", kMaxConnections,
                             " connections open (the most); close one and retry"));
          continue;
        }
        auto c = std::make_unique<Connection>();
        c->fd = std::move(fd);
        c->uid = cred.uid;
        conns.push_back(std::move(c));
      }
    }
  }
}

}  // namespace diond::fdchannel
