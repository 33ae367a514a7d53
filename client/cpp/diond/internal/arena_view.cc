#include "diond/internal/arena_view.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace diond::client::internal {
namespace {

bool Is16Bit(DType d) { return d == DType::kBF16 || d == DType::kF16; }

template <typename T>
absl::StatusOr<absl::Span<T>> Typed(absl::StatusOr<absl::Span<uint8_t>> bytes,
                                    const TensorLayout& t, bool want_16bit) {
  if (!bytes.ok()) return bytes.status();
  if (want_16bit != Is16Bit(t.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", t.name, "' has dtype ", static_cast<int>(t.dtype),
                     want_16bit ? ", not a 16-bit type" : ", not f32"));
  }
  return absl::Span<T>(reinterpret_cast<T*>(bytes->data()), bytes->size() / sizeof(T));
}

}  // namespace

absl::Status CheckArenaLayout(const Layout& layout) {
  if (layout.param_arena_bytes <= 0 || layout.grad_arena_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", layout.session_id, "': empty arenas (param ",
                     layout.param_arena_bytes, ", grad ", layout.grad_arena_bytes, " bytes)"));
  }
  for (const TensorLayout& t : layout.tensors) {
    bool in = t.size_bytes >= 0 && t.param_offset_bytes >= 0 && t.grad_offset_bytes >= 0 &&
              t.param_offset_bytes <= layout.param_arena_bytes - t.size_bytes &&
              t.grad_offset_bytes <= layout.grad_arena_bytes - t.size_bytes;
    if (!in) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' lies outside the arenas of session '", layout.session_id, "'"));
    }
  }
  return absl::OkStatus();
}

int64_t GradArenaOffset(const Layout& layout) {
  const int64_t a = std::max<int64_t>(sysconf(_SC_PAGESIZE), 256);
  return (layout.param_arena_bytes + a - 1) / a * a;
}

absl::Status ErrnoStatus(absl::string_view what, int err) {
  absl::StatusCode code = (err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE)
                              ? absl::StatusCode::kResourceExhausted
                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", strerror(err)));
}

absl::StatusOr<absl::Span<uint8_t>> ArenaView::Bytes(absl::string_view name, bool grad) const {
  if (param_base_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(kind_, " is empty (moved or reset)"));
  }
  const TensorLayout* t = layout_.Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("session '", layout_.session_id, "' has no parameter '", name, "'"));
  }
  // In bounds: CheckArenaLayout checked every offset + size against its arena.
  uint8_t* p = grad ? grad_base_ + t->grad_offset_bytes : param_base_ + t->param_offset_bytes;
  return absl::Span<uint8_t>(p, static_cast<size_t>(t->size_bytes));
}

absl::StatusOr<absl::Span<float>> ArenaView::F32(absl::string_view name, bool grad) const {
  auto b = Bytes(name, grad);
  if (!b.ok()) return b.status();
  return Typed<float>(b, *layout_.Find(name), false);
}

absl::StatusOr<absl::Span<uint16_t>> ArenaView::Bits16(absl::string_view name, bool grad) const {
  auto b = Bytes(name, grad);
  if (!b.ok()) return b.status();
  return Typed<uint16_t>(b, *layout_.Find(name), true);
}

}  // namespace diond::client::internal
