// Shared-memory arenas of one session (ARCHITECTURE.md §5, "CPU: a POSIX shm name").
//
// Given the layout CreateSession returned, ShmArena creates a POSIX shm segment (a random name
// "diond-<pid>-<hex>" matching [A-Za-z0-9._-]{1,200}, O_CREAT|O_EXCL, mode 0600), sizes and maps
// it, lays out the parameter arena at offset 0 and the gradient arena after it (or, with
// Options::single_segment = false, in a second segment), and hands out spans for every
// parameter and gradient by name. Create() also registers both regions with the daemon
// (SYSTEM_SHM, roles PARAMETERS and GRADIENTS), so Step reads the gradients and writes the
// weights in place.
//
// The gradient arena starts at a page boundary (a multiple of 4096 and so of the layout's
// 256-byte alignment), so a daemon that mmaps the region at its offset gets a valid offset.
//
// Lifetime: RAII and move-only. Destruction (or Reset) unregisters the regions (best effort:
// errors are ignored, the daemon may already be gone), munmaps and shm_unlinks every segment.
// The Client passed to Create must outlive the arena. Spans stay valid until then.
//
// Thread-safety: const methods may run concurrently; the span contents are shared with the
// daemon, which writes parameters during Step and reads gradients: don't touch them while a
// Step of the same session is in flight.
#ifndef DIOND_CLIENT_CPP_DIOND_SHM_ARENA_H_
#define DIOND_CLIENT_CPP_DIOND_SHM_ARENA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "diond/client.h"
#include "diond/types.h"

namespace diond::client {
namespace internal {
class ArenaView;  // diond/internal/arena_view.h
}  // namespace internal

class ShmArena {
 public:
  struct Options {
    bool single_segment = true;  // false: one segment per arena
  };

  // One mapped POSIX shm segment.
  struct Segment {
    std::string name;  // without the leading '/'; what RegisterRegion gets
    uint8_t* base = nullptr;
    int64_t size_bytes = 0;
  };

  // Creates and maps the segment(s) for `layout` and registers both arenas with the daemon
  // through `client` (which must outlive the arena). INVALID_ARGUMENT for an empty layout;
  // INTERNAL/RESOURCE_EXHAUSTED from shm_open/ftruncate/mmap with errno text; the daemon's
  // status if a registration fails. On any error nothing is left behind: no segment, no
  // mapping, no region.
  static absl::StatusOr<ShmArena> Create(const Client* client, const Layout& layout,
                                         const Options& options);
  static absl::StatusOr<ShmArena> Create(const Client* client, const Layout& layout) {
    return Create(client, layout, Options());
  }
  // The same without registering: for tests, or callers who register with RegisterShmRegion.
  static absl::StatusOr<ShmArena> CreateUnregistered(const Layout& layout, const Options& options);
  static absl::StatusOr<ShmArena> CreateUnregistered(const Layout& layout) {
    return CreateUnregistered(layout, Options());
  }

  ShmArena(ShmArena&& other) noexcept;
  ShmArena& operator=(ShmArena&& other) noexcept;
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;
  ~ShmArena();

  // Unregisters, unmaps and unlinks now; the arena is empty afterwards.
  void Reset();

  const Layout& layout() const { return layout_; }
  const std::string& session_id() const { return layout_.session_id; }

  // Spans over the parameter / gradient of `name`. NOT_FOUND for an unknown name,
  // INVALID_ARGUMENT if the tensor's dtype does not match (F32: kF32; BF16: kBF16 or kF16 raw
  // 16-bit values).
  absl::StatusOr<absl::Span<float>> Param(absl::string_view name) const;
  absl::StatusOr<absl::Span<float>> Grad(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint16_t>> ParamBf16(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint16_t>> GradBf16(absl::string_view name) const;
  // Raw bytes of any dtype.
  absl::StatusOr<absl::Span<uint8_t>> ParamBytes(absl::string_view name) const;
  absl::StatusOr<absl::Span<uint8_t>> GradBytes(absl::string_view name) const;

  // The segments (one or two) and where each arena starts.
  const std::vector<Segment>& segments() const { return segments_; }
  uint8_t* param_arena() const { return param_base_; }
  uint8_t* grad_arena() const { return grad_base_; }
  // Region ids the daemon returned (empty when unregistered).
  const std::string& param_region_id() const { return param_region_id_; }
  const std::string& grad_region_id() const { return grad_region_id_; }

 private:
  ShmArena() = default;
  absl::Status Register(const Client* client);
  internal::ArenaView View() const;  // over this arena's mapping

  Layout layout_;
  std::vector<Segment> segments_;
  uint8_t* param_base_ = nullptr;
  uint8_t* grad_base_ = nullptr;
  const Client* client_ = nullptr;
  std::string param_region_id_;
  std::string grad_region_id_;
};

// A random segment name "diond-<pid>-<16 hex digits>"; matches [A-Za-z0-9._-]{1,200}.
std::string RandomShmName();

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_SHM_ARENA_H_
