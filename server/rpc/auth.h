// Who is calling: the principals of the daemon's RPCs (docs/OPERATIONS.md "Security").
//
// - On the Unix socket the principal is the peer's uid ("uid:<N>"), read with SO_PEERCRED when
//   the connection is accepted (UnixListener below accepts the connections itself and hands each
//   one to gRPC, whose peer string is then "fd:<N>"). uid 0 and the daemon's own uid are admins.
// - Over TCP: a bearer token ("authorization: Bearer <token>" metadata) from --auth_token_file,
//   compared in constant time; else a verified TLS client certificate (--tls_client_ca), whose
//   subject is the principal ("x509:<subject>"); else, only with --allow_unauthenticated_tcp,
//   "anonymous". Anything else is UNAUTHENTICATED.
//
// Sessions store the principal's name as an opaque owner string; OptimizerService compares it.
//
// Thread-safety: Authenticator and UnixListener are thread-safe.
#ifndef DIOND_SERVER_RPC_AUTH_H_
#define DIOND_SERVER_RPC_AUTH_H_

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/session/process_watch.h"

namespace grpc {
class Server;
class ServerContextBase;
}  // namespace grpc

namespace diond::rpc {

struct Principal {
  std::string name;                    // the owner string of the sessions it creates
  bool admin = false;                  // sees and may use every session
  bool local = false;                  // came over the daemon's Unix socket
  uid_t uid = static_cast<uid_t>(-1);  // local only
  // Local only: the peer process (SO_PEERCRED's pid, with its start time), when the daemon can
  // see it; the session manager's orphan reaper watches it. Unknown over TCP.
  session::ProcessId process;
};

// Metadata key of the world secret on Peer calls (peer.proto).
inline constexpr char kWorldSecretMetadata[] = "x-diond-world-secret";

struct TokenEntry {
  std::string digest;  // SHA-256 of the token
  std::string principal;
  bool admin = false;
};

// --auth_token_file: one credential a line, "TOKEN PRINCIPAL [admin]" separated by blanks; blank
// lines and lines starting with '#' are ignored. A token has at least 16 and at most 4096
// printable non-blank characters; a principal matches [A-Za-z0-9._:@/=+-]{1,128}. Tokens must be
// unique. INVALID_ARGUMENT names the line (never echoes a token).
absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view text);

// A secret file (--world_secret_file): its bytes without trailing blanks/newlines; at least 16
// and at most 4096 bytes. The error names the path.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// Equality of two strings in time that depends on their lengths only (both sides hashed with
// SHA-256, then compared with CRYPTO_memcmp).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// Who is on the other end of an accepted Unix connection (SO_PEERCRED when it was accepted).
struct UnixPeer {
  uid_t uid = static_cast<uid_t>(-1);
  // The process that connected: its pid and start time. Unknown when its pid is 0 (a process of
  // another pid namespace, e.g. another container of a pod without a shared process namespace)
  // or /proc does not show it.
  session::ProcessId process;
};

// Maps the "fd:<N>" peer strings of connections UnixListener accepted to their peer.
class UnixPeers {
 public:
  void Record(int fd, uid_t uid, const session::ProcessId& process = {});
  // False if `peer` is not an accepted Unix connection.
  bool Lookup(absl::string_view peer, UnixPeer* out) const;

 private:
  mutable absl::Mutex mu_;
  std::map<int, UnixPeer> by_fd_ ABSL_GUARDED_BY(mu_);
};

struct AuthOptions {
  std::vector<TokenEntry> tokens;
  bool allow_unauthenticated_tcp = false;
  bool tls_client_certs = false;  // mTLS: verified client certificates are credentials
};

// What a call presents to the Authenticator, as read from its gRPC context.
struct CallCredentials {
  std::string peer;                 // grpc::ServerContextBase::peer(), e.g. "fd:7", "ipv4:..."
  bool has_authorization = false;   // an "authorization" metadata entry was sent
  std::string authorization;        // its (first) value
  std::string certificate_subject;  // of a verified TLS client certificate; empty if none
};

class Authenticator {
 public:
  explicit Authenticator(AuthOptions options);
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The same decision from the credentials alone (what Authenticate(ctx) reads, then calls).
  absl::StatusOr<Principal> Authenticate(const CallCredentials& call) const;
  UnixPeers* unix_peers() { return &unix_peers_; }
  // True when some TCP caller can authenticate (tokens, mTLS or the anonymous flag).
  bool tcp_usable() const;

 private:
  AuthOptions options_;
  UnixPeers unix_peers_;
  uid_t self_uid_;
};

// The Peer service's check: the world secret in kWorldSecretMetadata, or (if `mtls`) a verified
// client certificate. UNAUTHENTICATED otherwise.
absl::Status CheckWorldCredential(const grpc::ServerContextBase& ctx, const std::string& secret,
                                  bool mtls);

// Accepts connections on a Unix socket, records each peer's uid (SO_PEERCRED) and hands the
// connection to a started gRPC server (grpc::AddInsecureChannelFromFd). Connections get fd
// numbers that grow, so that an "fd:<N>" peer string is not reused for another uid while an
// older call with that string may still be running (numbers wrap only at RLIMIT_NOFILE).
class UnixListener {
 public:
  // Binds `path` with mode 0600 and listens. FAILED_PRECONDITION / UNAVAILABLE naming the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path);
  ~UnixListener();  // Stop()
  // Starts the accept thread. `server` and `peers` must outlive Stop().
  void Start(grpc::Server* server, UnixPeers* peers);
  // Stops accepting and closes the listening socket (does not unlink it). Idempotent.
  void Stop();

 private:
  UnixListener() = default;
  void Loop();
  int Renumber(int fd);
  std::string path_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that stops the accept loop
  grpc::Server* server_ = nullptr;
  UnixPeers* peers_ = nullptr;
  std::thread thread_;
  int next_fd_ = 0;
  int fd_limit_ = 0;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_AUTH_H_
