// What ShmArena, MemfdArena and DoorbellPage share (not installed): the checks on a layout
// before its arenas are mapped, where the gradient arena starts in a single mapping, errno
// statuses, new POSIX shm segments, and the views (bytes, f32, 16-bit) over the parameter and
// gradient of one tensor.
#ifndef DIOND_CLIENT_CPP_DIOND_INTERNAL_ARENA_VIEW_H_
#define DIOND_CLIENT_CPP_DIOND_INTERNAL_ARENA_VIEW_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "diond/shm_arena.h"
#include "diond/types.h"

namespace diond::client::internal {

// INVALID_ARGUMENT for empty arenas or a tensor outside them. Spans are handed out without
// further checks, so a hand-made layout is checked here too.
absl::Status CheckArenaLayout(const Layout& layout);

// Where the gradient arena starts when both arenas share one mapping: the first page boundary
// after the parameters (non-overlapping, a multiple of the layout's 256-byte alignment and a
// valid mmap offset).
int64_t GradArenaOffset(const Layout& layout);

// RESOURCE_EXHAUSTED for ENOMEM/ENOSPC/EMFILE/ENFILE, INTERNAL otherwise; "<what>: <strerror>".
absl::Status ErrnoStatus(absl::string_view what, int err);

// A new POSIX shm segment of `size_bytes` (a fresh random name, O_EXCL, mode 0600), mapped
// MAP_SHARED; errors as ErrnoStatus's, nothing left behind.
absl::StatusOr<ShmArena::Segment> CreateShmSegment(int64_t size_bytes);

// Spans over the two arenas of one layout, mapped at `param_base` and `grad_base`.
// `kind` names the owner in the error of an empty view ("ShmArena", "MemfdArena").
class ArenaView {
 public:
  ArenaView(const Layout& layout, uint8_t* param_base, uint8_t* grad_base, const char* kind)
      : layout_(layout), param_base_(param_base), grad_base_(grad_base), kind_(kind) {}

  // FAILED_PRECONDITION when unmapped (param_base null), NOT_FOUND for an unknown name.
  absl::StatusOr<absl::Span<uint8_t>> Bytes(absl::string_view name, bool grad) const;
  // As Bytes; INVALID_ARGUMENT unless the dtype is f32.
  absl::StatusOr<absl::Span<float>> F32(absl::string_view name, bool grad) const;
  // As Bytes; INVALID_ARGUMENT unless the dtype is BF16 or F16 (raw 16-bit values).
  absl::StatusOr<absl::Span<uint16_t>> Bits16(absl::string_view name, bool grad) const;

 private:
  const Layout& layout_;
  uint8_t* param_base_;
  uint8_t* grad_base_;
  const char* kind_;
};

}  // namespace diond::client::internal

#endif  // DIOND_CLIENT_CPP_DIOND_INTERNAL_ARENA_VIEW_H_
