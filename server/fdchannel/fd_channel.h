// The fd channel (docs/DATA_PLANE.md "The fd channel"): a Unix socket, mode 0600, beside the
// daemon's gRPC socket, on which a trainer passes file descriptors (a sealed memfd, a CUDA VMM
// export) with SCM_RIGHTS, since gRPC cannot carry them. Each fd received is bound to a random
// one-time token, to the sender's uid (SO_PEERCRED) and to its kind; the token goes back on the
// same connection. RegisterRegion over gRPC presents the token, and the daemon hands the fd over
// only to a caller of the same uid.
//
// Wire protocol (all integers little-endian; one connection may carry many requests in turn):
//   request  16 bytes: "DIONDFD1" | u32 version (1) | u32 kind (1 = memfd, 2 = CUDA VMM fd),
//            with exactly one fd attached (SCM_RIGHTS) to those bytes.
//   reply    16 bytes: "DIONDFD1" | u32 code (absl::StatusCode; 0 = OK) | u32 length (<= 512),
//            then `length` bytes: the token (32 lowercase hex digits) when OK, else the error.
// A request with a bad magic or version is answered, and the connection closed (its framing is
// lost); every other error is answered and the connection stays usable. Fds that came with a
// refused request are closed at once.
//
// Thread-safety: FdChannel and TokenTable are thread-safe. No gRPC here (ARCHITECTURE.md §3).
#ifndef DIOND_SERVER_FDCHANNEL_FD_CHANNEL_H_
#define DIOND_SERVER_FDCHANNEL_FD_CHANNEL_H_

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/fdchannel/unique_fd.h"

namespace diond::fdchannel {

inline constexpr char kMagic[8] = {'D', 'I', 'O', 'N', 'D', 'F', 'D', '1'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kMaxReplyText = 512;
inline constexpr size_t kTokenChars = 32;

enum class FdKind : uint32_t { kMemfd = 1, kCudaVmm = 2 };
// "memfd" / "CUDA VMM fd".
const char* FdKindName(FdKind kind);

struct TokenOptions {
  absl::Duration ttl = absl::Seconds(60);  // a token not redeemed by then expires (fd closed)
  int max_pending_per_uid = 64;            // tokens one uid may hold unredeemed
  int max_pending = 1024;                  // all uids together
};

// The tokens and their fds; the channel's state without its socket (unit-testable with any
// clock). Redeemed and expired tokens are remembered (the last 4096) so that a second use says
// "already used" or "expired" rather than "unknown".
class TokenTable {
 public:
  explicit TokenTable(TokenOptions options) : options_(options) {}
  // RESOURCE_EXHAUSTED when `uid` or the daemon holds the most pending tokens.
  absl::StatusOr<std::string> Put(UniqueFd fd, uid_t uid, FdKind kind, absl::Time now);
  // INVALID_ARGUMENT for a malformed token or one of another kind; NOT_FOUND for an unknown one;
  // FAILED_PRECONDITION for a used or expired one; PERMISSION_DENIED when `caller` is not the
  // sender's uid (the token stays pending). On success the token is spent.
  absl::StatusOr<UniqueFd> Take(absl::string_view token, uid_t caller, FdKind kind, absl::Time now);
  // Closes the fds of expired tokens.
  void Sweep(absl::Time now);
  int pending() const;

 private:
  struct Entry {
    UniqueFd fd;
    uid_t uid;
    FdKind kind;
    absl::Time expires;
  };
  void SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberLocked(const std::string& token, bool expired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const TokenOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> pending_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, int> per_uid_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> spent_ ABSL_GUARDED_BY(mu_);  // token -> expired (else redeemed)
  std::deque<std::string> spent_order_ ABSL_GUARDED_BY(mu_);
};

// "<socket>.fd": the fd channel's path derived from the gRPC Unix socket's.
std::string DerivedPath(absl::string_view grpc_socket_path);

class FdChannel {
 public:
  // Binds `path` (mode 0600; a stale socket file there is replaced, any other file is
  // FAILED_PRECONDITION) and starts serving. UNAVAILABLE naming the path on socket errors.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Start(const std::string& path,
                                                          TokenOptions options);
  ~FdChannel();  // stops, closes every connection and pending fd, unlinks the socket

  const std::string& path() const { return path_; }
  // TokenTable::Take at the current time; the error names this channel's path where useful.
  absl::StatusOr<UniqueFd> Take(absl::string_view token, uid_t caller, FdKind kind);
  int pending() const { return tokens_.pending(); }

 private:
  explicit FdChannel(TokenOptions options) : tokens_(options) {}
  void Loop();
  std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;
  TokenTable tokens_;
  std::thread thread_;
};

}  // namespace diond::fdchannel

#endif  // DIOND_SERVER_FDCHANNEL_FD_CHANNEL_H_
