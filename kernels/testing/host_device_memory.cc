// TEST BACKEND (host_device_backend.h): the pool of host memory standing for device memory,
// strict mode's guarded mappings, and a lost context.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/testing/host_device_backend.h"
#include "kernels/testing/host_device_internal.h"

namespace diond::kernels::testing {
namespace host_device {
namespace {

std::recursive_mutex& GuardMu() {
  static auto* m = new std::recursive_mutex;
  return *m;
}
int guard_depth = 0;  // under GuardMu()

void ProtectAll(int prot) {
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  for (const auto& [p, len] : st.guarded) {
    if (mprotect(p, len, prot) != 0) std::abort();  // cannot happen for our own mappings
  }
}

// Whether any mapping is guarded (strict mode was on): lenient-mode entries take no lock.
std::atomic<bool> any_guarded{false};

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// ---- a lost context (LoseHostTestDeviceContext): the stand-in for a sticky CUDA error. Its own
// lock: the trigger is user code, asked outside St().mu.
struct Loss {
  std::mutex mu;
  std::string why;  // "" while the context is usable
  std::function<bool()> trigger;
};
Loss& Lost() {
  static auto* l = new Loss;
  return *l;
}
// The reason once lost ("" before); `ask`: an op entry, which asks the trigger first.
std::string LossReason(bool ask) {
  std::function<bool()> trigger;
  {
    std::lock_guard<std::mutex> lock(Lost().mu);
    if (!Lost().why.empty() || !ask || !Lost().trigger) return Lost().why;
    trigger = Lost().trigger;
  }
  if (!trigger()) return "";
  std::lock_guard<std::mutex> lock(Lost().mu);
  if (Lost().why.empty()) Lost().why = "an illegal memory access in a kernel, injected by the test";
  Lost().trigger = nullptr;
  return Lost().why;
}
// The CUDA plugin's refusal once a sticky error was seen (ops_memory.cc LostFail), worded alike.
int LostFail(const DiondOpsCall* call, const std::string& why) {
  return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
              "host-test device " + std::to_string(call->device) +
                  ": the device context is lost (" + why +
                  ", an unrecoverable error); no device work can run until the daemon "
                  "restarts");
}

}  // namespace

State& St() {
  static State* s = new State;
  return *s;
}

EntryGuard::EntryGuard() {
  if (!any_guarded.load()) return;
  GuardMu().lock();
  held_ = true;
  if (guard_depth++ == 0) ProtectAll(PROT_READ | PROT_WRITE);
}

EntryGuard::~EntryGuard() {
  if (!held_) return;
  if (--guard_depth == 0) ProtectAll(PROT_NONE);
  GuardMu().unlock();
}

int Fail(const DiondOpsCall* call, int code, const std::string& msg) {
  if (call->err != nullptr && call->err_len > 0) {
    std::snprintf(call->err, call->err_len, "%s", msg.c_str());
  }
  return code;
}

int FromStatus(const DiondOpsCall* call, const absl::Status& s) {
  if (s.ok()) return DIOND_OPS_OK;
  const int code = s.code() == absl::StatusCode::kFailedPrecondition ? DIOND_OPS_FAILED_PRECONDITION
                   : s.code() == absl::StatusCode::kResourceExhausted ? DIOND_OPS_RESOURCE_EXHAUSTED
                                                                      : DIOND_OPS_INTERNAL;
  return Fail(call, code, std::string(s.message()));
}

bool RefuseIfLost(const DiondOpsCall* call, int* rc, bool ask) {
  const std::string why = LossReason(ask);
  if (why.empty()) return false;
  *rc = LostFail(call, why);
  return true;
}

bool OnDevice(const void* p, size_t bytes) {
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& [block, n] : st.blocks) {
    const auto b = reinterpret_cast<uintptr_t>(block);
    if (a >= b && a + bytes <= b + n) return true;
  }
  return false;
}

int Allocate(const DiondOpsCall* call, size_t bytes, void** ptr) {
  if (int rc = DIOND_OPS_OK; RefuseIfLost(call, &rc)) return rc;
  std::lock_guard<std::recursive_mutex> guard(GuardMu());  // guard_depth is read below
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.budget != 0 && st.in_use + bytes > st.budget) {
    char msg[256];
    std::snprintf(msg, sizeof(msg),
                  "host-test device %d: pool budget %llu bytes, %llu in use, %zu requested",
                  call->device, static_cast<unsigned long long>(st.budget),
                  static_cast<unsigned long long>(st.in_use), bytes);
    return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED, msg);
  }
  void* p = nullptr;
  if (st.strict) {
    const size_t len = PageRound(bytes > 0 ? bytes : 1);
    // Inside an entry (depth > 0) the live mappings are open: a new one starts open too.
    const int prot = guard_depth > 0 ? PROT_READ | PROT_WRITE : PROT_NONE;
    p = mmap(nullptr, len, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED, "host-test device: mmap");
    st.mapped[p] = len;
    st.guarded[p] = len;
    any_guarded.store(true);
  } else {
    p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED, "host-test device: malloc");
  }
  st.blocks[p] = bytes;
  st.in_use += bytes;
  if (st.in_use > st.peak) st.peak = st.in_use;
  *ptr = p;
  return DIOND_OPS_OK;
}

void Deallocate(int device, void* stream, void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  // Queued work may still read or write the block (on a GPU the pool orders the free after it).
  EntryGuard entry_guard;
  DrainAll();
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.blocks.find(ptr);
  if (it == st.blocks.end()) std::abort();  // a double free or a foreign pointer: a bug
  st.in_use -= it->second;
  st.blocks.erase(it);
  auto g = st.mapped.find(ptr);
  if (g != st.mapped.end()) {
    munmap(ptr, g->second);
    st.mapped.erase(g);
    st.guarded.erase(ptr);
  } else {
    std::free(ptr);
  }
}

int MemoryStats(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak) {
  if (int rc = DIOND_OPS_OK; RefuseIfLost(call, &rc)) return rc;
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  *in_use = st.in_use;
  *peak = st.peak;
  return DIOND_OPS_OK;
}

int DeviceHealth(const DiondOpsCall* call) {
  int rc = DIOND_OPS_OK;
  RefuseIfLost(call, &rc);
  return rc;
}

}  // namespace host_device

using host_device::St;

HostTestDeviceCounters GetHostTestDeviceCounters() {
  std::lock_guard<std::mutex> lock(St().mu);
  return St().counters;
}

void SetHostTestDeviceStrict(bool strict) {
  std::lock_guard<std::recursive_mutex> guard(host_device::GuardMu());
  if (!strict) {
    // Mappings made in strict mode stay mappings (freed with munmap) but are open for good.
    host_device::ProtectAll(PROT_READ | PROT_WRITE);
    std::lock_guard<std::mutex> lock(St().mu);
    St().guarded.clear();
    St().strict = false;
    host_device::any_guarded.store(false);
    return;
  }
  std::lock_guard<std::mutex> lock(St().mu);
  St().strict = true;
}

bool HostTestDeviceStrict() {
  std::lock_guard<std::mutex> lock(St().mu);
  return St().strict;
}

void ResetHostTestDevice(uint64_t budget_bytes) {
  {
    std::lock_guard<std::mutex> lock(host_device::Lost().mu);
    host_device::Lost().why.clear();
    host_device::Lost().trigger = nullptr;
  }
  std::lock_guard<std::mutex> lock(St().mu);
  const int64_t live = St().counters.streams_live;
  St().counters = HostTestDeviceCounters{};
  St().counters.streams_live = live;
  St().counters.host_registered_live = static_cast<int64_t>(St().host_ranges.size());
  St().budget = budget_bytes;
}

void LoseHostTestDeviceContext(const std::string& why) {
  std::lock_guard<std::mutex> lock(host_device::Lost().mu);
  if (host_device::Lost().why.empty())
    host_device::Lost().why = why.empty() ? "lost by the test" : why;
}

void SetHostTestDeviceLossTrigger(std::function<bool()> trigger) {
  std::lock_guard<std::mutex> lock(host_device::Lost().mu);
  host_device::Lost().trigger = std::move(trigger);
}

}  // namespace diond::kernels::testing
