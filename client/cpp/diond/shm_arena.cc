#include "diond/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "diond/internal/arena_view.h"

namespace diond::client {
namespace {

absl::Status SegmentError(absl::string_view what, const std::string& name, int err) {
  return internal::ErrnoStatus(absl::StrCat(what, " of shm segment '", name, "'"), err);
}

}  // namespace

// Retries on a name clash.
absl::StatusOr<ShmArena::Segment> internal::CreateShmSegment(int64_t size_bytes) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::string name = RandomShmName();
    std::string path = "/" + name;
    int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST) continue;
      return SegmentError("shm_open", name, errno);
    }
    // The umask may have cleared bits of 0600 but never adds any; set it exactly anyway.
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) {
      int err = errno;
      close(fd);
      shm_unlink(path.c_str());
      return SegmentError("ftruncate", name, err);
    }
    void* base =
        mmap(nullptr, static_cast<size_t>(size_bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);  // the mapping keeps the segment alive
    if (base == MAP_FAILED) {
      shm_unlink(path.c_str());
      return SegmentError("mmap", name, err);
    }
    return ShmArena::Segment{std::move(name), static_cast<uint8_t*>(base), size_bytes};
  }
  return absl::InternalError("shm_open: 8 random segment names in a row already existed");
}

std::string RandomShmName() {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^
                                          (static_cast<uint64_t>(getpid()) << 32)};
  return absl::StrFormat("diond-%d-%016x", static_cast<int>(getpid()), rng());
}

absl::StatusOr<ShmArena> ShmArena::CreateUnregistered(const Layout& layout,
                                                      const Options& options) {
  absl::Status valid = internal::CheckArenaLayout(layout);
  if (!valid.ok()) return valid;
  ShmArena arena;
  arena.layout_ = layout;
  if (options.single_segment) {
    const int64_t grad_offset = internal::GradArenaOffset(layout);
    auto seg = internal::CreateShmSegment(grad_offset + layout.grad_arena_bytes);
    if (!seg.ok()) return seg.status();
    arena.segments_.push_back(*std::move(seg));
    arena.param_base_ = arena.segments_[0].base;
    arena.grad_base_ = arena.segments_[0].base + grad_offset;
  } else {
    for (int64_t size : {layout.param_arena_bytes, layout.grad_arena_bytes}) {
      auto seg = internal::CreateShmSegment(size);
      if (!seg.ok()) return seg.status();  // `arena` unmaps what was made
      arena.segments_.push_back(*std::move(seg));
    }
    arena.param_base_ = arena.segments_[0].base;
    arena.grad_base_ = arena.segments_[1].base;
  }
  return arena;
}

absl::StatusOr<ShmArena> ShmArena::Create(const Client* client, const Layout& layout,
                                          const Options& options) {
  if (client == nullptr) return absl::InvalidArgumentError("ShmArena::Create: null client");
  auto arena = CreateUnregistered(layout, options);
  if (!arena.ok()) return arena.status();
  absl::Status s = arena->Register(client);
  if (!s.ok()) return s;  // the arena's destructor unregisters what was registered
  return arena;
}

absl::Status ShmArena::Register(const Client* client) {
  client_ = client;
  const Segment& ps = segments_.front();
  const Segment& gs = segments_.back();
  auto pid = client->RegisterShmRegion(layout_.session_id, v1::REGION_ROLE_PARAMETERS, ps.name,
                                       param_base_ - ps.base, layout_.param_arena_bytes);
  if (!pid.ok()) return pid.status();
  param_region_id_ = *pid;
  auto gid = client->RegisterShmRegion(layout_.session_id, v1::REGION_ROLE_GRADIENTS, gs.name,
                                       grad_base_ - gs.base, layout_.grad_arena_bytes);
  if (!gid.ok()) return gid.status();
  grad_region_id_ = *gid;
  return absl::OkStatus();
}

ShmArena::ShmArena(ShmArena&& other) noexcept { *this = std::move(other); }

ShmArena& ShmArena::operator=(ShmArena&& other) noexcept {
  if (this != &other) {
    Reset();
    layout_ = std::move(other.layout_);
    segments_ = std::move(other.segments_);
    param_base_ = std::exchange(other.param_base_, nullptr);
    grad_base_ = std::exchange(other.grad_base_, nullptr);
    client_ = std::exchange(other.client_, nullptr);
    param_region_id_ = std::move(other.param_region_id_);
    grad_region_id_ = std::move(other.grad_region_id_);
    other.segments_.clear();
    other.param_region_id_.clear();
    other.grad_region_id_.clear();
  }
  return *this;
}

ShmArena::~ShmArena() { Reset(); }

void ShmArena::Reset() {
  if (client_ != nullptr) {
    // Best effort: the daemon may be gone or the session closed, which already freed them.
    for (const std::string* id : {&grad_region_id_, &param_region_id_}) {
      if (!id->empty()) client_->UnregisterRegion(layout_.session_id, *id).IgnoreError();
    }
  }
  for (const Segment& s : segments_) {
    munmap(s.base, static_cast<size_t>(s.size_bytes));
    shm_unlink(("/" + s.name).c_str());
  }
  segments_.clear();
  param_base_ = grad_base_ = nullptr;
  client_ = nullptr;
  param_region_id_.clear();
  grad_region_id_.clear();
}

internal::ArenaView ShmArena::View() const {
  return internal::ArenaView(layout_, param_base_, grad_base_, "ShmArena");
}

absl::StatusOr<absl::Span<uint8_t>> ShmArena::ParamBytes(absl::string_view name) const {
  return View().Bytes(name, false);
}
absl::StatusOr<absl::Span<uint8_t>> ShmArena::GradBytes(absl::string_view name) const {
  return View().Bytes(name, true);
}
absl::StatusOr<absl::Span<float>> ShmArena::Param(absl::string_view name) const {
  return View().F32(name, false);
}
absl::StatusOr<absl::Span<float>> ShmArena::Grad(absl::string_view name) const {
  return View().F32(name, true);
}
absl::StatusOr<absl::Span<uint16_t>> ShmArena::ParamBf16(absl::string_view name) const {
  return View().Bits16(name, false);
}
absl::StatusOr<absl::Span<uint16_t>> ShmArena::GradBf16(absl::string_view name) const {
  return View().Bits16(name, true);
}

}  // namespace diond::client
