#include "server/rpc/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/server.h"
#include "grpcpp/server_context.h"
#include "grpcpp/server_posix.h"
#include "openssl/crypto.h"
#include "openssl/sha.h"

namespace diond::rpc {
namespace {

constexpr size_t kMinSecretBytes = 16;
constexpr size_t kMaxSecretBytes = 4096;

std::string Sha256(absl::string_view s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  return std::string(reinterpret_cast<const char*>(d), sizeof(d));
}

bool ValidPrincipal(absl::string_view p) {
  if (p.empty() || p.size() > 128) return false;
  for (char c : p) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) &&
        std::strchr("._:@/=+-", c) == nullptr) {
      return false;
    }
  }
  return true;
}

bool ValidToken(absl::string_view t) {
  if (t.size() < kMinSecretBytes || t.size() > kMaxSecretBytes) return false;
  for (char c : t) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// The first value of metadata `key`, if any.
bool Metadata(const grpc::ServerContextBase& ctx, absl::string_view key, absl::string_view* out) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(grpc::string_ref(key.data(), key.size()));
  if (it == md.end()) return false;
  *out = absl::string_view(it->second.data(), it->second.size());
  return true;
}

// The subject of a verified TLS client certificate, or empty.
std::string CertificateSubject(const grpc::ServerContextBase& ctx) {
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const auto& v : auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME)) {
    return std::string(v.data(), v.size());
  }
  // Authenticated without a subject property: fall back to the identity gRPC chose (CN / SAN).
  for (const auto& v : auth->GetPeerIdentity()) return std::string(v.data(), v.size());
  return "";
}

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const std::string da = Sha256(a), db = Sha256(b);
  return CRYPTO_memcmp(da.data(), db.data(), da.size()) == 0;
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text) {
  std::vector<TokenEntry> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() < 2 || f.size() > 3 || (f.size() == 3 && f[2] != "admin")) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_no, ": expected 'TOKEN PRINCIPAL [admin]'"));
    }
    if (!ValidToken(f[0])) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_no, ": the token must be ", kMinSecretBytes, " to ",
                       kMaxSecretBytes, " printable characters"));
    }
    if (!ValidPrincipal(f[1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_no,
                       ": the principal must be 1 to 128 characters of [A-Za-z0-9._:@/=+-]"));
    }
    TokenEntry e{Sha256(f[0]), std::string(f[1]), f.size() == 3};
    for (const TokenEntry& o : out) {
      if (o.digest == e.digest) {
        return absl::InvalidArgumentError(
            absl::StrCat("token file line ", line_no, ": the token is listed twice"));
      }
    }
    out.push_back(std::move(e));
  }
  if (out.empty()) return absl::InvalidArgumentError("token file has no token");
  return out;
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string text(kMaxSecretBytes + 2, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  while (!text.empty() && absl::ascii_isspace(static_cast<unsigned char>(text.back()))) {
    text.pop_back();
  }
  if (text.size() < kMinSecretBytes || text.size() > kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": a secret must be ", kMinSecretBytes,
                                                   " to ", kMaxSecretBytes, " bytes"));
  }
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & 0077) != 0) {
    DIOND_LOG(WARNING) << path << " is readable by group or others (mode "
                       << absl::StrCat(absl::Hex(st.st_mode & 0777)) << "); chmod 0600 it";
  }
  return text;
}

void UnixPeers::Record(int fd, uid_t uid, const session::ProcessId& process) {
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = UnixPeer{uid, process};
}

bool UnixPeers::Lookup(absl::string_view peer, UnixPeer* out) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd)) return false;
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return false;
  *out = it->second;
  return true;
}

Authenticator::Authenticator(AuthOptions options)
    : options_(std::move(options)), self_uid_(geteuid()) {}

bool Authenticator::tcp_usable() const {
  return !options_.tokens.empty() || options_.tls_client_certs ||
         options_.allow_unauthenticated_tcp;
}

absl::StatusOr<Principal> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  CallCredentials call;
  call.peer = ctx.peer();
  absl::string_view header;
  if (Metadata(ctx, "authorization", &header)) {
    call.has_authorization = true;
    call.authorization = std::string(header);
  }
  if (options_.tls_client_certs) call.certificate_subject = CertificateSubject(ctx);
  return Authenticate(call);
}

absl::StatusOr<Principal> Authenticator::Authenticate(const CallCredentials& call) const {
  Principal p;
  UnixPeer peer;
  if (unix_peers_.Lookup(call.peer, &peer)) {
    p.name = absl::StrCat("uid:", peer.uid);
    p.admin = peer.uid == 0 || peer.uid == self_uid_;
    p.local = true;
    p.uid = peer.uid;
    p.process = peer.process;
    return p;
  }
  if (call.has_authorization) {
    absl::string_view token = call.authorization;
    if (!absl::ConsumePrefix(&token, "Bearer ")) {
      return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
    }
    const std::string digest = Sha256(absl::StripAsciiWhitespace(token));
    const TokenEntry* match = nullptr;
    // Every entry is compared (no early exit), each in constant time.
    for (const TokenEntry& e : options_.tokens) {
      if (CRYPTO_memcmp(e.digest.data(), digest.data(), digest.size()) == 0) match = &e;
    }
    if (match == nullptr) {
      return absl::UnauthenticatedError("the bearer token is not valid for this daemon");
    }
    p.name = match->principal;
    p.admin = match->admin;
    return p;
  }
  if (options_.tls_client_certs) {
    const std::string& subject = call.certificate_subject;
    if (!subject.empty()) {
      p.name = absl::StrCat("x509:", subject.substr(0, 512));
      return p;
    }
  }
  if (options_.allow_unauthenticated_tcp) {
    p.name = "anonymous";
    return p;
  }
  return absl::UnauthenticatedError(
      "TCP calls need a credential: 'authorization: Bearer <token>' metadata with a token of "
      "--auth_token_file, or a TLS client certificate of --tls_client_ca (or start diond with "
      "--allow_unauthenticated_tcp)");
}

absl::Status CheckWorldCredential(const grpc::ServerContextBase& ctx, const std::string& secret,
                                  bool mtls) {
  absl::string_view given;
  if (!secret.empty() && Metadata(ctx, kWorldSecretMetadata, &given)) {
    if (ConstantTimeEquals(given, secret)) return absl::OkStatus();
    return absl::UnauthenticatedError("the world secret is wrong (--world_secret_file)");
  }
  if (mtls && !CertificateSubject(ctx).empty()) return absl::OkStatus();
  return absl::UnauthenticatedError(
      "Peer calls need the world secret (--world_secret_file) or a TLS client certificate "
      "of --tls_client_ca");
}

// ---- UnixListener --------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path) {
  std::unique_ptr<UnixListener> l(new UnixListener);
  l->path_ = path;
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("unix socket path ", path, " is too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  l->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l->listen_fd_ < 0) {
    return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  // Created 0600 (owner only): set the umask around the bind; chmod covers an odd kernel.
  mode_t old_mask = umask(0177);
  int rc = bind(l->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  umask(old_mask);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(err)));
  }
  chmod(path.c_str(), 0600);
  if (listen(l->listen_fd_, 128) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(errno)));
  }
  l->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (l->wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  // Room for fd numbers that are not reused soon (see Renumber).
  rlimit lim;
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    rlim_t want = std::min<rlim_t>(lim.rlim_max, rlim_t{1} << 20);
    if (lim.rlim_cur < want) {
      lim.rlim_cur = want;
      setrlimit(RLIMIT_NOFILE, &lim);
      getrlimit(RLIMIT_NOFILE, &lim);
    }
    l->fd_limit_ = static_cast<int>(std::min<rlim_t>(lim.rlim_cur, rlim_t{1} << 20));
  }
  return l;
}

UnixListener::~UnixListener() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void UnixListener::Start(grpc::Server* server, UnixPeers* peers) {
  server_ = server;
  peers_ = peers;
  next_fd_ = std::max(256, fd_limit_ / 4);
  thread_ = std::thread([this] { Loop(); });
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) DIOND_LOG(WARNING) << "eventfd write failed";
  thread_.join();
}

int UnixListener::Renumber(int fd) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (next_fd_ < fd_limit_ - 64) {
      int moved = fcntl(fd, F_DUPFD_CLOEXEC, next_fd_);
      if (moved >= 0) {
        close(fd);
        next_fd_ = moved + 1;
        return moved;
      }
    }
    next_fd_ = std::max(256, fd_limit_ / 4);  // wrap around
  }
  return fd;  // keep the kernel's number (the table is full)
}

void UnixListener::Loop() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (true) {
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      DIOND_LOG(ERROR) << "unix:" << path_ << ": poll: " << std::strerror(errno);
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        DIOND_LOG(WARNING) << "unix:" << path_ << ": accept: " << std::strerror(errno);
        // EMFILE and friends: back off a little rather than spin.
        poll(nullptr, 0, 50);
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      DIOND_LOG(WARNING) << "unix:" << path_ << ": SO_PEERCRED: " << std::strerror(errno);
      close(fd);
      continue;
    }
    // The start time tells this process apart from a later one with its pid. (Should the peer
    // have exited between connect and accept and its pid been reused already, the newcomer is
    // watched instead: its sessions are then kept longer, never reaped early.)
    const session::ProcessId process = session::IdentifyProcess(cred.pid);
    fd = Renumber(fd);
    int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    peers_->Record(fd, cred.uid, process);
    grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns (and closes) the fd now
  }
}

}  // namespace diond::rpc
