#include "server/rpc/listen.h"

#include <arpa/inet.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"

namespace diond::rpc {
namespace {

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a4;
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) {
    return (ntohl(a4.s_addr) >> 24) == 127;
  }
  return false;
}

}  // namespace

std::string ListenAddress::ToString() const {
  if (kind == Kind::kUnix) return absl::StrCat("unix:", path);
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::vector<ListenAddress>> ParseListenAddresses(absl::string_view text) {
  std::vector<ListenAddress> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    ListenAddress a;
    if (absl::ConsumePrefix(&item, "unix:")) {
      if (item.empty()) {
        return absl::InvalidArgumentError("listen address 'unix:' has no socket path");
      }
      if (item.size() >= sizeof(sockaddr_un{}.sun_path)) {
        return absl::InvalidArgumentError(absl::StrCat("unix socket path '", item, "' is ",
                                                       item.size(), " bytes; the limit is ",
                                                       sizeof(sockaddr_un{}.sun_path) - 1));
      }
      a.kind = ListenAddress::Kind::kUnix;
      a.path = std::string(item);
      out.push_back(a);
      continue;
    }
    size_t colon = item.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address '", item, "' is neither unix:PATH nor HOST:PORT"));
    }
    absl::string_view host = item.substr(0, colon);
    absl::string_view port = item.substr(colon + 1);
    if (absl::ConsumePrefix(&host, "[")) {
      if (!absl::ConsumeSuffix(&host, "]")) {
        return absl::InvalidArgumentError(absl::StrCat("listen address '", item, "': bad IPv6"));
      }
    }
    int p = -1;
    if (host.empty() || !absl::SimpleAtoi(port, &p) || p < 0 || p > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address '", item, "' needs HOST:PORT with a port in 0..65535"));
    }
    a.kind = ListenAddress::Kind::kTcp;
    a.host = std::string(host);
    a.port = p;
    a.loopback = IsLoopbackHost(a.host);
    out.push_back(a);
  }
  if (out.empty()) return absl::InvalidArgumentError("no listen address given");
  return out;
}

absl::Status PrepareUnixSocketPath(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot stat unix socket path ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  close(fd);
  if (rc == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("address already in use: another process is serving on unix:", path));
  }
  if (err != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot probe unix socket ", path, ": ", std::strerror(err)));
  }
  if (unlink(path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale socket ", path, ": ", std::strerror(errno)));
  }
  DIOND_LOG(WARNING) << "removed stale socket file " << path << " (no server answered on it)";
  return absl::OkStatus();
}

std::string DefaultUnixSocketPath() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] != '\0') return absl::StrCat(xdg, "/diond.sock");
  return absl::StrCat("/tmp/diond-", getuid(), ".sock");
}

}  // namespace diond::rpc
