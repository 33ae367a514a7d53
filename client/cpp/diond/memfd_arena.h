// Memfd arenas of one session (docs/DATA_PLANE.md "Region kinds": MEMFD, the recommended host
// path).
//
// Like ShmArena, but the memory is one anonymous memfd (memfd_create with MFD_ALLOW_SEALING),
// sized and then sealed with F_SEAL_SHRINK | F_SEAL_GROW, so that it can never shrink under the
// daemon's mapping. The parameter arena is at offset 0 and the gradient arena at the first page
// boundary after it. Create() sends the memfd over the daemon's fd channel (the layout's
// fd_channel_socket) once per region, and registers both regions (REGION_KIND_MEMFD) with the
// tokens the channel answered.
//
// Lifetime: RAII and move-only. Destruction (or Reset) unregisters the regions (best effort),
// munmaps and closes the memfd (the daemon's own fd keeps the memory alive until it drops the
// regions). The Client passed to Create must outlive the arena.
//
// Thread-safety: as ShmArena.
#ifndef DIOND_CLIENT_CPP_DIOND_MEMFD_ARENA_H_
#define DIOND_CLIENT_CPP_DIOND_MEMFD_ARENA_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "diond/client.h"
#include "diond/types.h"

namespace diond::client {
namespace internal {
class ArenaView;  // diond/internal/arena_view.h
}  // namespace internal

// Kinds of fd the fd channel accepts.
inline constexpr uint32_t kFdKindMemfd = 1;
inline constexpr uint32_t kFdKindCudaVmm = 2;

// Sends `fd` (not closed) over the fd channel at `socket_path` and returns the one-time token
// for RegisterRegion. UNAVAILABLE when the channel cannot be reached or closes early; the
// channel's own code and message when it refuses the fd.
absl::StatusOr<std::string> SendFdToChannel(const std::string& socket_path, int fd,
                                            uint32_t kind = kFdKindMemfd);

class MemfdArena {
 public:
  // Creates, seals and maps the memfd for `layout` and registers both arenas through `client`.
  // FAILED_PRECONDITION when the layout says the daemon has no fd channel / MEMFD regions;
  // INVALID_ARGUMENT for an empty layout; INTERNAL/RESOURCE_EXHAUSTED with errno text; the
  // daemon's status if a registration fails. On any error nothing is left behind.
  static absl::StatusOr<MemfdArena> Create(const Client* client, const Layout& layout);
  // The memfd without registering (for tests, or callers who register by hand).
  static absl::StatusOr<MemfdArena> CreateUnregistered(const Layout& layout);

  MemfdArena(MemfdArena&& other) noexcept;
  MemfdArena& operator=(MemfdArena&& other) noexcept;
  MemfdArena(const MemfdArena&) = delete;
  MemfdArena& operator=(const MemfdArena&) = delete;
  ~MemfdArena();

  // Unregisters, unmaps and closes now; the arena is empty afterwards.
  void Reset();

  const Layout& layout() const { return layout_; }
  const std::string& session_id() const { return layout_.session_id; }

  // As ShmArena's.
  absl::StatusOr<absl::Span<float>> Param(absl::string_view name) const;
  absl::StatusOr<absl::Span<float>> Grad(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint16_t>> ParamBf16(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint16_t>> GradBf16(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint8_t>> ParamBytes(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint8_t>> GradBytes(absl::string_view name) const;

  int fd() const { return fd_; }
  int64_t size_bytes() const { return size_; }
  int64_t grad_offset() const { return grad_offset_; }
  uint8_t* param_arena() const { return base_; }
  uint8_t* grad_arena() const { return base_ == nullptr ? nullptr : base_ + grad_offset_; }
  const std::string& param_region_id() const { return param_region_id_; }
  const std::string& grad_region_id() const { return grad_region_id_; }

 private:
  MemfdArena() = default;
  absl::Status Register(const Client* client);
  internal::ArenaView View() const;  // over this arena's mapping

  Layout layout_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  int64_t size_ = 0;
  int64_t grad_offset_ = 0;
  const Client* client_ = nullptr;
  std::string param_region_id_;
  std::string grad_region_id_;
};

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_MEMFD_ARENA_H_
