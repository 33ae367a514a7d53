// Listen addresses of the daemon: parsing, validation and Unix-socket housekeeping.
// No gRPC here (the RPC layer turns these into gRPC URIs; exe/ parses the flags with it).
#ifndef DIOND_SERVER_RPC_LISTEN_H_
#define DIOND_SERVER_RPC_LISTEN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond::rpc {

struct ListenAddress {
  enum class Kind { kUnix, kTcp };
  Kind kind = Kind::kTcp;
  std::string path;  // kUnix: absolute or relative socket path
  std::string host;  // kTcp
  int port = 0;      // kTcp; 0 = the kernel picks
  bool loopback = true;

  // "unix:/path" or "host:port" ("[::1]:port" for IPv6).
  std::string ToString() const;
};

// Parses a comma-separated list such as "unix:/run/diond.sock,127.0.0.1:50551". Empty items are
// ignored; an empty list is an error. INVALID_ARGUMENT names the bad item.
absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(absl::string_view text);

// Makes `path` ready to bind: if a socket file is there and a server answers on it, returns
// ALREADY_EXISTS ("another process is serving on unix:PATH"); if the file is stale (nobody
// accepts), removes it; if it is not a socket, FAILED_PRECONDITION (we never delete other files).
absl::Status PrepareUnixSocketPath(const std::string& path);

// Default socket path: $XDG_RUNTIME_DIR/diond.sock if set, else /tmp/diond-<uid>.sock.
std::string DefaultUnixSocketPath();

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_LISTEN_H_
