#include "diond/memfd_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "diond/internal/arena_view.h"

namespace diond::client {
namespace {

using internal::ErrnoStatus;

bool ReadExact(int s, char* out, size_t n) {
  size_t have = 0;
  while (have < n) {
    ssize_t r = recv(s, out + have, n - have, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    have += static_cast<size_t>(r);
  }
  return true;
}

uint32_t Le32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace

absl::StatusOr<std::string> SendFdToChannel(const std::string& socket_path, int fd, uint32_t kind) {
  sockaddr_un addr{};
  if (socket_path.empty() || socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fd channel path '", socket_path, "' is empty or too long"));
  }
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return ErrnoStatus("socket(AF_UNIX)", errno);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    close(s);
    return absl::UnavailableError(absl::StrCat("cannot connect to the daemon's fd channel at ",
                                               socket_path, ": ", strerror(err)));
  }
  timeval tv{10, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char header[16] = {'D', 'I', 'O', 'N', 'D', 'F', 'D', '1'};
  for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<char>((1u >> (8 * i)) & 0xff);
  for (int i = 0; i < 4; ++i) header[12 + i] = static_cast<char>((kind >> (8 * i)) & 0xff);
  iovec iov{header, sizeof(header)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(s, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(header))) {
    int err = errno;
    close(s);
    return absl::UnavailableError(
        absl::StrCat("sending the fd to the fd channel at ", socket_path, ": ", strerror(err)));
  }
  char reply[16];
  std::string text;
  bool ok = ReadExact(s, reply, sizeof(reply)) && std::memcmp(reply, "DIONDFD1", 8) == 0;
  const uint32_t code = ok ? Le32(reply + 8) : 0;
  const uint32_t length = ok ? std::min<uint32_t>(Le32(reply + 12), 4096) : 0;
  text.resize(length);
  if (ok && length > 0) ok = ReadExact(s, text.data(), length);
  close(s);
  if (!ok) {
    return absl::UnavailableError(absl::StrCat("the daemon's fd channel at ", socket_path,
                                               " closed the connection before answering"));
  }
  if (code != 0) {
    return absl::Status(
        code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
        absl::StrCat("fd channel: ", text));
  }
  return text;
}

absl::StatusOr<MemfdArena> MemfdArena::CreateUnregistered(const Layout& layout) {
  absl::Status valid = internal::CheckArenaLayout(layout);
  if (!valid.ok()) return valid;
  MemfdArena a;
  a.layout_ = layout;
  a.grad_offset_ = internal::GradArenaOffset(layout);
  a.size_ = a.grad_offset_ + layout.grad_arena_bytes;
  a.fd_ = memfd_create("diond-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (a.fd_ < 0) return ErrnoStatus("memfd_create", errno);
  if (ftruncate(a.fd_, static_cast<off_t>(a.size_)) != 0) {
    return ErrnoStatus("ftruncate(memfd)", errno);
  }
  if (fcntl(a.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus("fcntl(F_ADD_SEALS) on the memfd", errno);
  }
  void* base =
      mmap(nullptr, static_cast<size_t>(a.size_), PROT_READ | PROT_WRITE, MAP_SHARED, a.fd_, 0);
  if (base == MAP_FAILED) return ErrnoStatus("mmap(memfd)", errno);  // ~MemfdArena closes the fd
  a.base_ = static_cast<uint8_t*>(base);
  return a;
}

absl::StatusOr<MemfdArena> MemfdArena::Create(const Client* client, const Layout& layout) {
  if (client == nullptr) return absl::InvalidArgumentError("MemfdArena::Create: null client");
  if (!layout.memfd_regions) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", layout.session_id,
                     "': the daemon offers no MEMFD regions (no fd channel); "
                     "use ShmArena"));
  }
  auto arena = CreateUnregistered(layout);
  if (!arena.ok()) return arena.status();
  absl::Status s = arena->Register(client);
  if (!s.ok()) return s;
  return arena;
}

absl::Status MemfdArena::Register(const Client* client) {
  client_ = client;
  // One token per region: each RegisterRegion takes its own fd.
  auto ptoken = SendFdToChannel(layout_.fd_channel_socket, fd_);
  if (!ptoken.ok()) return ptoken.status();
  auto pid = client->RegisterMemfdRegion(layout_.session_id, v1::REGION_ROLE_PARAMETERS, *ptoken, 0,
                                         layout_.param_arena_bytes);
  if (!pid.ok()) return pid.status();
  param_region_id_ = *pid;
  auto gtoken = SendFdToChannel(layout_.fd_channel_socket, fd_);
  if (!gtoken.ok()) return gtoken.status();
  auto gid = client->RegisterMemfdRegion(layout_.session_id, v1::REGION_ROLE_GRADIENTS, *gtoken,
                                         grad_offset_, layout_.grad_arena_bytes);
  if (!gid.ok()) return gid.status();
  grad_region_id_ = *gid;
  return absl::OkStatus();
}

MemfdArena::MemfdArena(MemfdArena&& other) noexcept { *this = std::move(other); }

MemfdArena& MemfdArena::operator=(MemfdArena&& other) noexcept {
  if (this != &other) {
    Reset();
    layout_ = std::move(other.layout_);
    fd_ = std::exchange(other.fd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
    grad_offset_ = std::exchange(other.grad_offset_, 0);
    client_ = std::exchange(other.client_, nullptr);
    param_region_id_ = std::exchange(other.param_region_id_, std::string());
    grad_region_id_ = std::exchange(other.grad_region_id_, std::string());
  }
  return *this;
}

MemfdArena::~MemfdArena() { Reset(); }

void MemfdArena::Reset() {
  if (client_ != nullptr) {
    for (const std::string* id : {&grad_region_id_, &param_region_id_}) {
      if (!id->empty()) client_->UnregisterRegion(layout_.session_id, *id).IgnoreError();
    }
  }
  if (base_ != nullptr) munmap(base_, static_cast<size_t>(size_));
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  base_ = nullptr;
  size_ = grad_offset_ = 0;
  client_ = nullptr;
  param_region_id_.clear();
  grad_region_id_.clear();
}

internal::ArenaView MemfdArena::View() const {
  return internal::ArenaView(layout_, base_, grad_arena(), "MemfdArena");
}

absl::StatusOr<absl::Span<uint8_t>> MemfdArena::ParamBytes(absl::string_view name) const {
  return View().Bytes(name, false);
}
absl::StatusOr<absl::Span<uint8_t>> MemfdArena::GradBytes(absl::string_view name) const {
  return View().Bytes(name, true);
}
absl::StatusOr<absl::Span<float>> MemfdArena::Param(absl::string_view name) const {
  return View().F32(name, false);
}
absl::StatusOr<absl::Span<float>> MemfdArena::Grad(absl::string_view name) const {
  return View().F32(name, true);
}
absl::StatusOr<absl::Span<uint16_t>> MemfdArena::ParamBf16(absl::string_view name) const {
  return View().Bits16(name, false);
}
absl::StatusOr<absl::Span<uint16_t>> MemfdArena::GradBf16(absl::string_view name) const {
  return View().Bits16(name, true);
}

}  // namespace diond::client
