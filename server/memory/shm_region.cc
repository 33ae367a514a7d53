#include "server/memory/shm_region.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/bounded.h"

namespace diond::memory {
namespace {

// ---- the SIGBUS guard ----------------------------------------------------------------------
// A fixed table, so that the handler reads it without locks or allocation: a slot is live while
// `begin` is non-zero. Slots are claimed and released under g_table_mu (never in the handler).
constexpr int kGuardSlots = 4096;
struct GuardSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int> broken{0};
};
GuardSlot g_slots[kGuardSlots];
std::atomic<int64_t> g_faults{0};
uintptr_t g_page = 4096;
struct sigaction g_previous;
std::once_flag g_install_once;

absl::Mutex g_table_mu;
bool g_slot_used[kGuardSlots] ABSL_GUARDED_BY(g_table_mu) = {};
// Segment (device, inode) -> (owner session, regions of that owner mapping it).
std::map<std::pair<uint64_t, uint64_t>, std::pair<std::string, int>> g_owners
    ABSL_GUARDED_BY(g_table_mu);

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (info->si_code > 0) {  // raised by the kernel for a memory access (not kill/raise)
    for (GuardSlot& s : g_slots) {
      const uintptr_t begin = s.begin.load(std::memory_order_acquire);
      if (begin == 0 || addr < begin) continue;
      const uintptr_t end = s.end.load(std::memory_order_acquire);
      if (addr >= end) continue;
      // Everything from the faulting page to the end of the region becomes anonymous memory:
      // the access that faulted, and every later one, completes harmlessly.
      const uintptr_t page = addr & ~(g_page - 1);
      // NOLINTNEXTLINE(performance-no-int-to-ptr): the fault address arrives as an integer.
      void* r = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (r == MAP_FAILED) break;  // cannot repair: fall through to the previous behaviour
      s.broken.store(1, std::memory_order_release);
      g_faults.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  // Not a registered region: behave as without the guard.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  // A memory fault repeats when the instruction is retried and now kills the process; a
  // signal sent by kill() does not repeat, so send it again.
  if (info->si_code <= 0) raise(sig);
}

void InstallGuard() {
  std::call_once(g_install_once, [] {
    g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

}  // namespace

int64_t ShmGuardFaultsCaught() { return g_faults.load(); }

absl::Status ValidateShmName(absl::string_view name) {
  bool ok = !name.empty() && name.size() <= 200 && name != "." && name != "..";
  for (char c : name) {
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == '-')) {
      ok = false;
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm name '", Bounded(name), "' must match [A-Za-z0-9._-]{1,200} (no paths)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(const std::string& name, int64_t offset,
                                                           int64_t size, const std::string& owner) {
  if (absl::Status s = ValidateShmName(name); !s.ok()) return s;
  if (offset < 0 || size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("shm region '", name, "': offset ", offset,
                                                   " and size ", size, " must be >= 0 and > 0"));
  }
  if (offset > INT64_MAX - size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm region '", name, "': offset + size overflows int64"));
  }
  int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) {
      return absl::NotFoundError(absl::StrCat("shm segment '", name, "' does not exist"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open shm segment '", name, "': ", std::strerror(e)));
  }
  return Map(fd, "shm", name, offset, size, owner);
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Adopt(int fd, const std::string& kind,
                                                            const std::string& name, int64_t offset,
                                                            int64_t size,
                                                            const std::string& owner) {
  if (offset < 0 || size <= 0 || offset > INT64_MAX - size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(kind, " region '", name, "': offset ", offset,
                                                   " and size ", size,
                                                   " must be >= 0 and > 0, without overflow"));
  }
  return Map(fd, kind, name, offset, size, owner);
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Map(int fd, const std::string& kind,
                                                          const std::string& name, int64_t offset,
                                                          int64_t size, const std::string& owner) {
  InstallGuard();
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("fstat of ", kind, " '", name, "': ", std::strerror(e)));
  }
  if (offset + size > st.st_size) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat(kind, " region '", name, "' [", offset, ", ",
                                              offset + size, ") exceeds the segment's ", st.st_size,
                                              " bytes"));
  }
  const std::pair<uint64_t, uint64_t> key{static_cast<uint64_t>(st.st_dev),
                                          static_cast<uint64_t>(st.st_ino)};
  int slot = -1;
  {
    absl::MutexLock lock(&g_table_mu);
    auto it = g_owners.find(key);
    if (it != g_owners.end() && it->second.first != owner) {
      close(fd);
      // The other session is not named: it may belong to another client.
      return absl::FailedPreconditionError(absl::StrCat(
          kind, " segment '", name, "' is registered by another session; a segment (device ",
          key.first, ", inode ", key.second, ") belongs to one session"));
    }
    for (int i = 0; i < kGuardSlots; ++i) {
      if (!g_slot_used[i]) {
        slot = i;
        break;
      }
    }
    if (slot < 0) {
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("this daemon has ", kGuardSlots, " shm regions mapped; no more"));
    }
    g_slot_used[slot] = true;
    auto& entry = g_owners[key];
    entry.first = owner;
    ++entry.second;
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset / page * page;
  const size_t map_length = static_cast<size_t>(offset - map_offset + size);
  void* base = mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(map_offset));
  int e = errno;
  std::unique_ptr<ShmRegion> r(new ShmRegion);
  r->kind_ = kind;
  r->name_ = name;
  r->offset_ = offset;
  r->size_ = size;
  r->fd_ = fd;
  r->slot_ = slot;
  r->dev_ = key.first;
  r->ino_ = key.second;
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(  // ~ShmRegion releases the slot, owner and fd
        absl::StrCat("mmap of ", kind, " '", name, "' (", map_length,
                     " bytes): ", std::strerror(e)));
  }
  r->map_base_ = base;
  r->map_length_ = map_length;
  r->data_ = static_cast<uint8_t*>(base) + (offset - map_offset);
  GuardSlot& s = g_slots[slot];
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  s.broken.store(0, std::memory_order_relaxed);
  s.end.store(b + (map_length + page - 1) / page * page, std::memory_order_release);
  s.begin.store(b, std::memory_order_release);
  return r;
}

ShmRegion::~ShmRegion() {
  if (slot_ >= 0) g_slots[slot_].begin.store(0, std::memory_order_release);
  if (map_base_ != nullptr) munmap(map_base_, map_length_);  // the shm and any anonymous pages
  if (fd_ >= 0) close(fd_);
  if (slot_ >= 0) {
    absl::MutexLock lock(&g_table_mu);
    g_slot_used[slot_] = false;
    auto it = g_owners.find({dev_, ino_});
    if (it != g_owners.end() && --it->second.second == 0) g_owners.erase(it);
  }
}

bool ShmRegion::broken() const {
  return slot_ >= 0 && g_slots[slot_].broken.load(std::memory_order_acquire) != 0;
}

std::string ShmRegion::Describe() const {
  return absl::StrCat(kind_, " region '", name_, "' [", offset_, ", ", offset_ + size_, ")");
}

absl::Status ShmRegion::CheckIntact() const {
  if (broken()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Describe(),
                     " shrank: its segment was truncated under the daemon's mapping (SIGBUS "
                     "caught); unregister it and register an intact region"));
  }
  struct stat st;
  if (fstat(fd_, &st) == 0 && st.st_size < offset_ + size_) {
    return absl::FailedPreconditionError(
        absl::StrCat(Describe(), " shrank: its segment now has ", st.st_size,
                     " bytes; restore its size, or unregister it and register an intact region"));
  }
  return absl::OkStatus();
}

}  // namespace diond::memory
