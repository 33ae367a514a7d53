// TEST BACKEND (host_device_backend.h): host memory behind the plugin C ABI.
#include "kernels/testing/host_device_backend.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/context.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"
#include "kernels/plugin/plugin_backend.h"

namespace diond::kernels::testing {
namespace {

struct State {
  std::mutex mu;
  std::unordered_map<void*, size_t> blocks;
  // Strict mode (SetHostTestDeviceStrict): blocks allocated while it is on are their own
  // page-aligned mappings (address -> mapped length), PROT_NONE outside the backend's entries.
  bool strict = false;
  std::unordered_map<void*, size_t> mapped;   // every such mapping (freed with munmap)
  std::unordered_map<void*, size_t> guarded;  // those still guarded (strict mode not left)
  uint64_t in_use = 0, peak = 0, budget = 0;
  std::set<void*> streams;
  std::map<uintptr_t, size_t> host_ranges;  // devsession: host_register'ed [start, start+bytes)
  HostTestDeviceCounters counters;
};
State& St() {
  static State* s = new State;
  return *s;
}

// The entry guard of strict mode: the first (outermost) entry of the backend makes every guarded
// mapping readable and writable, the last exit makes them PROT_NONE again. One entry at a time
// (a recursive mutex: an entry may call another one through the CPU ops only, never back into
// this table, but a nested guard costs nothing).
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

class EntryGuard {
 public:
  EntryGuard() {
    if (!any_guarded.load()) return;
    lock_ = std::unique_lock<std::recursive_mutex>(GuardMu());
    if (guard_depth++ == 0) ProtectAll(PROT_READ | PROT_WRITE);
  }
  ~EntryGuard() {
    if (lock_.owns_lock() && --guard_depth == 0) ProtectAll(PROT_NONE);
  }
  EntryGuard(const EntryGuard&) = delete;
  EntryGuard& operator=(const EntryGuard&) = delete;

 private:
  std::unique_lock<std::recursive_mutex> lock_;
};

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
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
              "host-test device " + std::to_string(call->device) + ": the device context is lost (" +
                  why + ", an unrecoverable error); no device work can run until the daemon "
                  "restarts");
}
bool RefuseIfLost(const DiondOpsCall* call, int* rc, bool ask = false) {
  const std::string why = LossReason(ask);
  if (why.empty()) return false;
  *rc = LostFail(call, why);
  return true;
}

// Every op entry: the context must not be lost (the trigger is asked here), and the stream must
// be one of ours (or null: the default stream).
bool CheckStream(const DiondOpsCall* call, int* rc) {
  if (RefuseIfLost(call, rc, /*ask=*/true)) return false;
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  ++st.counters.ops;
  if (call->stream == nullptr) {
    ++st.counters.ops_on_default_stream;
    return true;
  }
  if (st.streams.count(call->stream) == 0) {
    *rc = Fail(call, DIOND_OPS_INTERNAL, "host-test device: unknown stream");
    return false;
  }
  return true;
}
void CountSync() {
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.syncs;
}

// ---- asynccopy: the streams' deferred work ----
// An entry issued on a stream of ours (not the default stream) that only writes device memory
// is not run by the call: it is queued on its stream, and the queue runs, in issue order, when
// the host waits for the stream (stream_synchronize, a synchronous copy, an entry that hands a
// value to the host) or when device memory is freed. So, as on a GPU, a host read of a
// copy_to_host_async destination before the wait sees the old bytes, and a host write of a
// copy_from_host_async source before the wait reaches the device. A queued entry's failure is
// kept (the first one per stream; the rest of the queue is dropped) and returned by the next
// wait, like a CUDA stream's sticky error.
struct Work {
  int device = 0;
  const char* op = "";
  std::function<int(const DiondOpsCall*)> run;
};
struct Queues {
  std::mutex mu;
  std::unordered_map<void*, std::deque<Work>> pending;
  struct Error {
    int code = DIOND_OPS_OK;
    std::string message;
  };
  std::unordered_map<void*, Error> failed;
};
Queues& Qs() {
  static Queues* q = new Queues;
  return *q;
}

// ---- graph: stream capture emulated. While a stream captures, the work its entries would queue
// is appended to the capture instead (nothing runs); a sync point on it fails and invalidates
// the capture, as cudaStreamBeginCapture's global mode does. The ended capture is a graph: its
// works, each a copy of the closure with the arguments it was given (a device-side scalar
// record is read when the work runs, other scalars were copied at the call). A launch queues
// copies of them on the launching stream, so a replay runs exactly what was captured.
struct Capture {
  std::vector<Work> works;
  std::string invalid;  // why the capture is invalid ("" while valid)
};
struct Graph {
  std::vector<Work> works;
};
// Under Queues::mu.
std::unordered_map<void*, Capture>& Capturing() {
  static auto* m = new std::unordered_map<void*, Capture>;
  return *m;
}

void Enqueue(const DiondOpsCall* call, const char* op,
             std::function<int(const DiondOpsCall*)> run) {
  Queues& q = Qs();
  std::lock_guard<std::mutex> lock(q.mu);
  if (auto it = Capturing().find(call->stream); it != Capturing().end()) {
    it->second.works.push_back(Work{call->device, op, std::move(run)});
    return;
  }
  q.pending[call->stream].push_back(Work{call->device, op, std::move(run)});
  std::lock_guard<std::mutex> c(St().mu);
  ++St().counters.deferred;
}

// Runs the queue of `stream` (the caller holds an EntryGuard). One item at a time, popped under
// the lock and run outside it.
void Drain(void* stream) {
  Queues& q = Qs();
  for (;;) {
    Work w;
    {
      std::lock_guard<std::mutex> lock(q.mu);
      auto it = q.pending.find(stream);
      if (it == q.pending.end() || it->second.empty()) return;
      w = std::move(it->second.front());
      it->second.pop_front();
    }
    char err[512] = {0};
    const DiondOpsCall c{w.device, stream, err, sizeof(err)};
    int rc = DIOND_OPS_OK;
    if (!RefuseIfLost(&c, &rc)) rc = w.run(&c);  // nothing runs on a lost context
    if (rc == DIOND_OPS_OK) continue;
    std::lock_guard<std::mutex> lock(q.mu);
    q.pending[stream].clear();
    Queues::Error& e = q.failed[stream];
    if (e.code == DIOND_OPS_OK) {
      e.code = rc;
      e.message = std::string("host-test device: a queued ") + w.op + " failed: " + err;
    }
    return;
  }
}
void DrainAll() {
  std::vector<void*> streams;
  {
    std::lock_guard<std::mutex> lock(Qs().mu);
    for (const auto& [stream, work] : Qs().pending) {
      if (!work.empty()) streams.push_back(stream);
    }
  }
  for (void* s : streams) Drain(s);
}
// Drains the call's stream and takes its kept failure, if any (then *rc is set and true).
bool WaitForStream(const DiondOpsCall* call, int* rc) {
  Drain(call->stream);
  std::lock_guard<std::mutex> lock(Qs().mu);
  auto it = Qs().failed.find(call->stream);
  if (it == Qs().failed.end()) return false;
  Queues::Error e = std::move(it->second);
  Qs().failed.erase(it);
  if (call->err != nullptr && call->err_len > 0) {
    std::snprintf(call->err, call->err_len, "%s", e.message.c_str());
  }
  *rc = e.code;
  return true;
}

TensorLayout L(const DiondTensor& t) {
  TensorLayout l;
  l.dtype = static_cast<DType>(t.dtype);
  l.rank = t.rank;
  for (int i = 0; i < 3; ++i) {
    l.dims[i] = t.dims[i];
    l.strides[i] = t.strides[i];
  }
  return l;
}
ConstTensorView In(const DiondTensor* t) {
  return t->data == nullptr && t->rank == 0 ? ConstTensorView() : ConstTensorView(t->data, L(*t));
}
TensorView Out(const DiondTensor* t) {
  return t->data == nullptr && t->rank == 0 ? TensorView() : TensorView(t->data, L(*t));
}

const Context& Cpu() {
  thread_local std::unique_ptr<Context> ctx = Context::CpuDefault(1);
  return *ctx;
}

// The body of an entry (the stream is checked, and the entry queued or waited for, by the
// Queued / SyncPoint wrappers of the table).
#define DIOND_TEST_OP_BEGIN \
  EntryGuard entry_guard_;  \
  int rc = DIOND_OPS_OK;    \
  (void)rc

// ---- memory ----
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
int CopyFromHost(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(dst, host, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_device;
  St().counters.bytes_to_device += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int CopyToHost(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(host, src, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_host;
  St().counters.bytes_to_host += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
// asynccopy: the queued copies (run when their stream is drained).
int CopyFromHostAsync(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(dst, host, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_device;
  ++St().counters.async_copies_to_device;
  St().counters.bytes_to_device += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int CopyToHostAsync(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(host, src, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_host;
  ++St().counters.async_copies_to_host;
  St().counters.bytes_to_host += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int StreamCreate(const DiondOpsCall* call, void** stream) {
  if (int rc = DIOND_OPS_OK; RefuseIfLost(call, &rc)) return rc;
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  void* s = new int(static_cast<int>(st.counters.streams_created));
  st.streams.insert(s);
  ++st.counters.streams_created;
  ++st.counters.streams_live;
  *stream = s;
  return DIOND_OPS_OK;
}
void StreamDestroy(int device, void* stream) {
  {
    // What was queued runs first (cudaStreamDestroy lets queued work complete).
    EntryGuard entry_guard;
    Drain(stream);
    std::lock_guard<std::mutex> lock(Qs().mu);
    Qs().pending.erase(stream);
    Qs().failed.erase(stream);
  }
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.streams.erase(stream) == 1) {
    delete static_cast<int*>(stream);
    --st.counters.streams_live;
  }
}
int StreamSynchronize(const DiondOpsCall* call) {
  (void)call;  // the SyncPoint wrapper drains the stream and counts the sync
  return DIOND_OPS_OK;
}
int DeviceHealth(const DiondOpsCall* call) {
  int rc = DIOND_OPS_OK;
  RefuseIfLost(call, &rc);
  return rc;
}
int MemoryStats(const DiondOpsCall* call, uint64_t* in_use, uint64_t* peak) {
  if (int rc = DIOND_OPS_OK; RefuseIfLost(call, &rc)) return rc;
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  *in_use = st.in_use;
  *peak = st.peak;
  return DIOND_OPS_OK;
}

// ---- devsession: host registration (pairing checked; the memory itself is untouched) ----
int HostRegister(const DiondOpsCall* call, void* ptr, size_t bytes) {
  if (int rc = DIOND_OPS_OK; RefuseIfLost(call, &rc)) return rc;
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  ++st.counters.host_registers;
  const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
  auto next = st.host_ranges.lower_bound(a);
  const bool overlaps_next = next != st.host_ranges.end() && next->first < a + bytes;
  bool overlaps_prev = false;
  if (next != st.host_ranges.begin()) {
    auto prev = std::prev(next);
    overlaps_prev = prev->first + prev->second > a;
  }
  if (ptr == nullptr || bytes == 0 || overlaps_next || overlaps_prev) {
    ++st.counters.host_register_errors;
    return Fail(call, DIOND_OPS_INTERNAL,
                "host-test device: host_register of a null, empty or already registered range");
  }
  st.host_ranges[a] = bytes;
  st.counters.host_registered_live = static_cast<int64_t>(st.host_ranges.size());
  return DIOND_OPS_OK;
}
int HostUnregister(const DiondOpsCall* call, void* ptr) {
  State& st = St();
  std::lock_guard<std::mutex> lock(st.mu);
  ++st.counters.host_unregisters;
  if (st.host_ranges.erase(reinterpret_cast<uintptr_t>(ptr)) != 1) {
    ++st.counters.host_register_errors;
    return Fail(call, DIOND_OPS_INTERNAL,
                "host-test device: host_unregister of a pointer that is not registered");
  }
  st.counters.host_registered_live = static_cast<int64_t>(st.host_ranges.size());
  return DIOND_OPS_OK;
}

// ---- devsession / graph: stream capture (see Capture above) ----
int GraphBeginCapture(const DiondOpsCall* call) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (call->stream == nullptr) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the default stream cannot be captured");
  }
  std::lock_guard<std::mutex> lock(Qs().mu);
  if (!Capturing().emplace(call->stream, Capture{}).second) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the stream is already capturing");
  }
  std::lock_guard<std::mutex> c(St().mu);
  ++St().counters.graph_captures;
  return DIOND_OPS_OK;
}
int GraphEndCapture(const DiondOpsCall* call, void** graph) {
  *graph = nullptr;
  Capture cap;
  {
    std::lock_guard<std::mutex> lock(Qs().mu);
    auto it = Capturing().find(call->stream);
    if (it == Capturing().end()) {
      return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                  "host-test device: the stream is not capturing");
    }
    cap = std::move(it->second);
    Capturing().erase(it);
  }
  if (!cap.invalid.empty()) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the capture was invalidated: " + cap.invalid);
  }
  *graph = new Graph{std::move(cap.works)};
  std::lock_guard<std::mutex> c(St().mu);
  ++St().counters.graphs_made;
  return DIOND_OPS_OK;
}
int GraphLaunch(const DiondOpsCall* call, void* graph) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (graph == nullptr) return Fail(call, DIOND_OPS_INTERNAL, "host-test device: null graph");
  for (const Work& w : static_cast<const Graph*>(graph)->works) Enqueue(call, w.op, w.run);
  std::lock_guard<std::mutex> c(St().mu);
  ++St().counters.graph_launches;
  return DIOND_OPS_OK;
}
void GraphDestroy(int, void* graph) { delete static_cast<Graph*>(graph); }

// A sync point on a capturing stream: refused, and the capture invalidated (true, *rc set).
bool RefuseWhileCapturing(const DiondOpsCall* call, int* rc) {
  std::lock_guard<std::mutex> lock(Qs().mu);
  auto it = Capturing().find(call->stream);
  if (it == Capturing().end()) return false;
  if (it->second.invalid.empty()) {
    it->second.invalid = "a synchronous entry was called on the capturing stream";
  }
  {
    std::lock_guard<std::mutex> c(St().mu);
    ++St().counters.captures_invalidated;
  }
  *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
             "host-test device: operation not permitted when the stream is capturing");
  return true;
}

// ---- ops: the CPU backend on host memory ----
int Gemm(const DiondOpsCall* call, const DiondGemmArgs* g, DiondIn a, DiondIn b, DiondOut c) {
  DIOND_TEST_OP_BEGIN;
  GemmParams p;
  p.trans_a = g->trans_a ? Trans::kYes : Trans::kNo;
  p.trans_b = g->trans_b ? Trans::kYes : Trans::kNo;
  p.alpha = g->alpha;
  p.beta = g->beta;
  return FromStatus(call, kernels::Gemm(Cpu(), p, In(a), In(b), Out(c)));
}
int SymmetricProduct(const DiondOpsCall* call, int32_t aat, float alpha, DiondIn a, float beta,
                     DiondOut c) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::SymmetricProduct(Cpu(), aat ? GramSide::kAAt : GramSide::kAtA,
                                                    alpha, In(a), beta, Out(c)));
}
int SymmetricProductBf16(const DiondOpsCall* call, DiondIn a, int64_t block, DiondOut c) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::SymmetricProductBf16(Cpu(), In(a), block, Out(c)));
}
int ThinQr(const DiondOpsCall* call, DiondIn a, DiondOut q, DiondOut r) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::ThinQr(Cpu(), In(a), Out(q), Out(r)));
}
int CholeskyQr(const DiondOpsCall* call, DiondIn a, DiondOut q, DiondOut r) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::CholeskyQr(Cpu(), In(a), Out(q), Out(r)));
}
int RandomizedCholeskyQr(const DiondOpsCall* call, DiondIn a, DiondIn s, DiondOut q) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::RandomizedCholeskyQr(Cpu(), In(a), In(s), Out(q)));
}
int FrobeniusNorm(const DiondOpsCall* call, DiondIn a, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::FrobeniusNorm(Cpu(), In(a), Out(out)));
}
int AxisNorms(const DiondOpsCall* call, DiondIn a, int32_t axis, int32_t norm, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::AxisNorms(Cpu(), In(a), static_cast<Axis>(axis),
                                             static_cast<NormType>(norm), Out(out)));
}
int TopKByL1Norm(const DiondOpsCall* call, DiondIn a, int32_t axis, int64_t k, int64_t* indices,
                 DiondOut scores) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::TopKByL1Norm(Cpu(), In(a), static_cast<Axis>(axis), k,
                                                absl::MakeSpan(indices, static_cast<size_t>(k)),
                                                Out(scores)));
}
int IsAllZero(const DiondOpsCall* call, DiondIn a, int32_t* all_zero) {
  DIOND_TEST_OP_BEGIN;
  bool z = false;
  rc = FromStatus(call, kernels::IsAllZero(Cpu(), In(a), &z));
  *all_zero = z ? 1 : 0;
  return rc;
}
int Gather(const DiondOpsCall* call, DiondIn a, int32_t axis, const int64_t* idx, int64_t count,
           DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Gather(Cpu(), In(a), static_cast<Axis>(axis),
                                          absl::MakeConstSpan(idx, static_cast<size_t>(count)),
                                          Out(out)));
}
int Scatter(const DiondOpsCall* call, DiondIn src, int32_t axis, const int64_t* idx,
            int64_t count, float alpha, float beta, DiondOut dst) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Scatter(Cpu(), In(src), static_cast<Axis>(axis),
                                           absl::MakeConstSpan(idx, static_cast<size_t>(count)),
                                           alpha, beta, Out(dst)));
}
int Copy(const DiondOpsCall* call, DiondIn src, DiondOut dst) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Copy(Cpu(), In(src), Out(dst)));
}
int Fill(const DiondOpsCall* call, float value, DiondOut dst) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Fill(Cpu(), value, Out(dst)));
}
int Axpby(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondIn y, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Axpby(Cpu(), alpha, In(x), beta, In(y), Out(out)));
}
int AddScalar(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::AddScalar(Cpu(), alpha, In(x), beta, Out(out)));
}
int AddToDiagonal(const DiondOpsCall* call, float value, DiondOut a) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::AddToDiagonal(Cpu(), value, Out(a)));
}
int Bf16RoundedAxpby(const DiondOpsCall* call, float alpha, DiondIn x, float beta, DiondIn y,
                     DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Bf16RoundedAxpby(Cpu(), alpha, In(x), beta, In(y), Out(out)));
}
int Unary(const DiondOpsCall* call, int32_t op, DiondIn x, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Unary(Cpu(), static_cast<UnaryOp>(op), In(x), Out(out)));
}
int Binary(const DiondOpsCall* call, int32_t op, DiondIn x, DiondIn y, DiondOut out) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call,
                    kernels::Binary(Cpu(), static_cast<BinaryOp>(op), In(x), In(y), Out(out)));
}

// The fused ops run the shared per-element functions on the scalars the adapter formed.
int64_t Count(const DiondTensor* t) { return In(t).NumElements(); }

int AdamWStep(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad, DiondOut x,
              DiondOut m, DiondOut v) {
  DIOND_TEST_OP_BEGIN;
  math::AdamWScalars s{c->decay, c->lr_wd,     c->one_minus_b1, c->one_minus_b2, c->beta2,
                       c->step_size, c->sqrt_bc2, c->eps,          c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data),
        *vp = static_cast<float*>(v->data);
  for (int64_t i = 0; i < Count(x); ++i) math::AdamWElement(s, g[i], xp[i], mp[i], vp[i]);
  return DIOND_OPS_OK;
}
int LionStep(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
             DiondOut m) {
  DIOND_TEST_OP_BEGIN;
  math::LionScalars s{c->w1, c->w2, c->lr_wd, c->decay, c->lr, c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data);
  for (int64_t i = 0; i < Count(x); ++i) math::LionElement(s, g[i], xp[i], mp[i]);
  return DIOND_OPS_OK;
}

// ---- kops: the tracked steps run the per-element functions on the adapter's scalars, with the
// change summed in double in element order (the CPU backend's order on one thread); the others
// run the CPU ops themselves.
inline double Sq(float after, float before) {
  const double d = static_cast<double>(after) - static_cast<double>(before);
  return d * d;
}
int AdamWStepTracked(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad,
                     DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  math::AdamWScalars s{c->decay, c->lr_wd,     c->one_minus_b1, c->one_minus_b2, c->beta2,
                       c->step_size, c->sqrt_bc2, c->eps,          c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data),
        *vp = static_cast<float*>(v->data);
  double sq = 0.0;
  for (int64_t i = 0; i < Count(x); ++i) {
    const float before = xp[i];
    math::AdamWElement(s, g[i], xp[i], mp[i], vp[i]);
    sq += Sq(xp[i], before);
  }
  *static_cast<float*>(update_sq->data) = static_cast<float>(sq);
  return DIOND_OPS_OK;
}
int LionStepTracked(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad,
                    DiondOut x, DiondOut m, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  math::LionScalars s{c->w1, c->w2, c->lr_wd, c->decay, c->lr, c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data);
  double sq = 0.0;
  for (int64_t i = 0; i < Count(x); ++i) {
    const float before = xp[i];
    math::LionElement(s, g[i], xp[i], mp[i]);
    sq += Sq(xp[i], before);
  }
  *static_cast<float*>(update_sq->data) = static_cast<float>(sq);
  return DIOND_OPS_OK;
}
int MomentumUpdate(const DiondOpsCall* call, float mu, int32_t nesterov, DiondIn grad,
                   DiondIn m_in, DiondOut m, DiondOut u) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::MomentumUpdate(Cpu(), mu, nesterov != 0, In(grad), In(m_in),
                                                  Out(m), Out(u)));
}
int ApplyUpdate(const DiondOpsCall* call, const DiondApplyUpdateScalars* c, DiondIn update,
                DiondIn x_in, DiondOut x) {
  DIOND_TEST_OP_BEGIN;
  // The CPU op forms decay = 1 − lr_wd itself; the adapter's record must agree with it.
  if (c->decay != 1.0f - c->lr_wd) {
    return Fail(call, DIOND_OPS_INTERNAL, "host-test device: ApplyUpdate decay != 1 - lr_wd");
  }
  ApplyUpdateParams p;
  p.alpha = c->alpha;
  p.lr_wd = c->lr_wd;
  p.cautious = c->cautious != 0;
  p.round_bf16 = c->round_bf16 != 0;
  return FromStatus(call, kernels::ApplyUpdate(Cpu(), p, In(update), In(x_in), Out(x)));
}
int NormalizeNeurons(const DiondOpsCall* call, float w, DiondOut o, DiondOut v) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::NormalizeNeurons(Cpu(), w, Out(o), Out(v)));
}
int CopyWithChange(const DiondOpsCall* call, DiondIn src, DiondOut dst, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::CopyWithChange(Cpu(), In(src), Out(dst), Out(update_sq)));
}
int AllFinite(const DiondOpsCall* call, DiondIn x, int32_t* all_finite) {
  DIOND_TEST_OP_BEGIN;
  bool f = false;
  const int code = FromStatus(call, kernels::AllFinite(Cpu(), In(x), &f));
  *all_finite = f ? 1 : 0;
  return code;
}
int WidenScaleCheckFinite(const DiondOpsCall* call, DiondIn x, float scale, DiondOut out,
                          int32_t* all_finite) {
  DIOND_TEST_OP_BEGIN;
  bool f = false;
  const int code =
      FromStatus(call, kernels::WidenScaleCheckFinite(Cpu(), In(x), scale, Out(out), &f));
  *all_finite = f ? 1 : 0;
  return code;
}
int Fnv1aChecksum(const DiondOpsCall* call, DiondIn x, uint64_t* checksum) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::Fnv1aChecksum(Cpu(), In(x), checksum));
}
// asynccopy: the flag forms (queued; the flag stays in device memory).
int AllFiniteFlag(const DiondOpsCall* call, DiondIn x, DiondOut nonfinite) {
  DIOND_TEST_OP_BEGIN;
  bool f = false;
  rc = FromStatus(call, kernels::AllFinite(Cpu(), In(x), &f));
  if (rc == DIOND_OPS_OK && !f) *static_cast<float*>(nonfinite->data) = 1.0f;
  return rc;
}
int WidenScaleCheckFiniteFlag(const DiondOpsCall* call, DiondIn x, float scale, DiondOut out,
                              DiondOut nonfinite) {
  DIOND_TEST_OP_BEGIN;
  bool f = false;
  rc = FromStatus(call, kernels::WidenScaleCheckFinite(Cpu(), In(x), scale, Out(out), &f));
  if (rc == DIOND_OPS_OK && !f) *static_cast<float*>(nonfinite->data) = 1.0f;
  return rc;
}
int DecayScatterWithChange(const DiondOpsCall* call, float decay, DiondIn src, int32_t axis,
                           const int64_t* idx, int64_t count, float alpha, DiondOut x,
                           DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(call, kernels::DecayScatterWithChange(
                              Cpu(), decay, In(src), static_cast<Axis>(axis),
                              absl::MakeConstSpan(idx, static_cast<size_t>(count)), alpha,
                              Out(x), Out(update_sq)));
}

// ---- asynccopy: the table's wrappers ----
// An argument of a queued entry, kept until the entry runs: records passed by pointer (tensors,
// scalar structs) are copied, everything else (scalars, device and host pointers) kept as is.
template <typename T, typename = void>
struct Held {
  explicit Held(T x) : v(x) {}
  T get() const { return v; }
  T v;
};
template <typename T>
struct Held<const T*, std::enable_if_t<std::is_class_v<T>>> {
  explicit Held(const T* p) : v(*p) {}
  const T* get() const { return &v; }
  T v;
};

// Queued<F, Fn>::Entry: checks the stream; on the default stream runs Fn at once, on a stream
// of ours queues it (index lists of Gather / Scatter are copied by their own wrappers below).
template <typename F, F Fn>
struct Queued;
template <typename... A, int (*Fn)(const DiondOpsCall*, A...)>
struct Queued<int (*)(const DiondOpsCall*, A...), Fn> {
  static int Entry(const DiondOpsCall* call, A... a) {
    int rc = DIOND_OPS_OK;
    if (!CheckStream(call, &rc)) return rc;
    if (call->stream == nullptr) return Fn(call, a...);
    auto held = std::make_shared<std::tuple<Held<A>...>>(Held<A>(a)...);
    Enqueue(call, name, [held](const DiondOpsCall* c) {
      return std::apply([c](const auto&... h) { return Fn(c, h.get()...); }, *held);
    });
    return DIOND_OPS_OK;
  }
  inline static const char* name = "entry";  // the body's own message names the op
};

// SyncPoint<F, Fn>::Entry: the host waits for the stream (its queue runs, and a queued failure
// is returned), counts one sync, then Fn runs.
template <typename F, F Fn>
struct SyncPoint;
template <typename... A, int (*Fn)(const DiondOpsCall*, A...)>
struct SyncPoint<int (*)(const DiondOpsCall*, A...), Fn> {
  static int Entry(const DiondOpsCall* call, A... a) {
    int rc = DIOND_OPS_OK;
    if (!CheckStream(call, &rc)) return rc;
    if (RefuseWhileCapturing(call, &rc)) return rc;
    EntryGuard entry_guard;
    if (WaitForStream(call, &rc)) return rc;
    CountSync();
    return Fn(call, a...);
  }
};

// The queued host copies: as Queued, except that under capture the host range must be
// host_register'ed (pinned), as CUDA's: it cannot capture a copy of pageable memory (the runtime
// stages such a copy synchronously), so the entry is refused and the capture invalidated.
bool RefusePageableWhileCapturing(const DiondOpsCall* call, const void* host, size_t bytes,
                                  int* rc) {
  {
    std::lock_guard<std::mutex> lock(Qs().mu);
    if (Capturing().count(call->stream) == 0) return false;
  }
  bool pinned = false;
  {
    State& st = St();
    std::lock_guard<std::mutex> lock(st.mu);
    const uintptr_t a = reinterpret_cast<uintptr_t>(host);
    auto it = st.host_ranges.upper_bound(a);
    if (it != st.host_ranges.begin()) {
      --it;
      pinned = a >= it->first && a + bytes <= it->first + it->second;
    }
  }
  if (pinned) return false;
  std::lock_guard<std::mutex> lock(Qs().mu);
  auto it = Capturing().find(call->stream);
  if (it != Capturing().end() && it->second.invalid.empty()) {
    it->second.invalid = "a copy of pageable (unregistered) host memory was captured";
  }
  {
    std::lock_guard<std::mutex> c(St().mu);
    ++St().counters.captures_invalidated;
  }
  *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
             "host-test device: a copy of pageable host memory cannot be captured (register it "
             "with host_register)");
  return true;
}
int CopyFromHostAsyncQueued(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (RefusePageableWhileCapturing(call, host, bytes, &rc)) return rc;
  return Queued<decltype(&CopyFromHostAsync), &CopyFromHostAsync>::Entry(call, host, dst, bytes);
}
int CopyToHostAsyncQueued(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (RefusePageableWhileCapturing(call, host, bytes, &rc)) return rc;
  return Queued<decltype(&CopyToHostAsync), &CopyToHostAsync>::Entry(call, src, host, bytes);
}

int GatherQueued(const DiondOpsCall* call, DiondIn a, int32_t axis, const int64_t* idx,
                 int64_t count, DiondOut out) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (call->stream == nullptr) return Gather(call, a, axis, idx, count, out);
  auto indices = std::make_shared<std::vector<int64_t>>(idx, idx + count);
  const DiondTensor ta = *a, to = *out;
  Enqueue(call, "Gather",
          [=](const DiondOpsCall* c) { return Gather(c, &ta, axis, indices->data(), count, &to); });
  return DIOND_OPS_OK;
}
int ScatterQueued(const DiondOpsCall* call, DiondIn src, int32_t axis, const int64_t* idx,
                  int64_t count, float alpha, float beta, DiondOut dst) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (call->stream == nullptr) return Scatter(call, src, axis, idx, count, alpha, beta, dst);
  auto indices = std::make_shared<std::vector<int64_t>>(idx, idx + count);
  const DiondTensor ts = *src, td = *dst;
  Enqueue(call, "Scatter", [=](const DiondOpsCall* c) {
    return Scatter(c, &ts, axis, indices->data(), count, alpha, beta, &td);
  });
  return DIOND_OPS_OK;
}
int DecayScatterWithChangeQueued(const DiondOpsCall* call, float decay, DiondIn src, int32_t axis,
                                 const int64_t* idx, int64_t count, float alpha, DiondOut x,
                                 DiondOut update_sq) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (call->stream == nullptr) {
    return DecayScatterWithChange(call, decay, src, axis, idx, count, alpha, x, update_sq);
  }
  auto indices = std::make_shared<std::vector<int64_t>>(idx, idx + count);
  const DiondTensor ts = *src, tx = *x, tq = *update_sq;
  Enqueue(call, "DecayScatterWithChange", [=](const DiondOpsCall* c) {
    return DecayScatterWithChange(c, decay, &ts, axis, indices->data(), count, alpha, &tx, &tq);
  });
  return DIOND_OPS_OK;
}

// ---- graph: the fused steps with DEVICE-side scalars (*_dev). The record's address is kept
// (not its bytes) and the record is read when the queued work runs, as a GPU kernel reads it: a
// graph replays with whatever the host uploaded before the launch. The address must lie in a
// block of this backend (device memory), else the entry fails.
template <typename R>
struct DeviceRecord {
  const R* p;
};
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
template <typename R>
int ReadRecord(const DiondOpsCall* call, DeviceRecord<R> r, R* out) {
  if (r.p == nullptr || !OnDevice(r.p, sizeof(R))) {
    return Fail(call, DIOND_OPS_INTERNAL,
                "host-test device: a *_dev entry's scalars are not in device memory");
  }
  std::memcpy(out, r.p, sizeof(R));  // inside the entry's guard (strict mode)
  return DIOND_OPS_OK;
}
int AdamWStepDevBody(const DiondOpsCall* call, DeviceRecord<DiondAdamWScalars> r, DiondIn grad,
                     DiondOut x, DiondOut m, DiondOut v) {
  DIOND_TEST_OP_BEGIN;
  DiondAdamWScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return AdamWStep(call, &c, grad, x, m, v);
}
int LionStepDevBody(const DiondOpsCall* call, DeviceRecord<DiondLionScalars> r, DiondIn grad,
                    DiondOut x, DiondOut m) {
  DIOND_TEST_OP_BEGIN;
  DiondLionScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return LionStep(call, &c, grad, x, m);
}
int AdamWStepTrackedDevBody(const DiondOpsCall* call, DeviceRecord<DiondAdamWScalars> r,
                            DiondIn grad, DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  DiondAdamWScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return AdamWStepTracked(call, &c, grad, x, m, v, update_sq);
}
int LionStepTrackedDevBody(const DiondOpsCall* call, DeviceRecord<DiondLionScalars> r,
                           DiondIn grad, DiondOut x, DiondOut m, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  DiondLionScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return LionStepTracked(call, &c, grad, x, m, update_sq);
}
int ApplyUpdateDevBody(const DiondOpsCall* call, DeviceRecord<DiondApplyUpdateScalars> r,
                       DiondIn update, DiondIn x_in, DiondOut x) {
  DIOND_TEST_OP_BEGIN;
  DiondApplyUpdateScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return ApplyUpdate(call, &c, update, x_in, x);
}
void CountDeviceScalarOp() {
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.device_scalar_ops;
}
// Each *_dev entry: the record's address wrapped, then queued like any op.
#define DIOND_DEV_ENTRY(name, R, ...)                                                        \
  int name(const DiondOpsCall* call, const R* c, __VA_ARGS__)
DIOND_DEV_ENTRY(AdamWStepDev, DiondAdamWScalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut v) {
  CountDeviceScalarOp();
  return Queued<decltype(&AdamWStepDevBody), &AdamWStepDevBody>::Entry(
      call, DeviceRecord<DiondAdamWScalars>{c}, grad, x, m, v);
}
DIOND_DEV_ENTRY(LionStepDev, DiondLionScalars, DiondIn grad, DiondOut x, DiondOut m) {
  CountDeviceScalarOp();
  return Queued<decltype(&LionStepDevBody), &LionStepDevBody>::Entry(
      call, DeviceRecord<DiondLionScalars>{c}, grad, x, m);
}
DIOND_DEV_ENTRY(AdamWStepTrackedDev, DiondAdamWScalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut v, DiondOut update_sq) {
  CountDeviceScalarOp();
  return Queued<decltype(&AdamWStepTrackedDevBody), &AdamWStepTrackedDevBody>::Entry(
      call, DeviceRecord<DiondAdamWScalars>{c}, grad, x, m, v, update_sq);
}
DIOND_DEV_ENTRY(LionStepTrackedDev, DiondLionScalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut update_sq) {
  CountDeviceScalarOp();
  return Queued<decltype(&LionStepTrackedDevBody), &LionStepTrackedDevBody>::Entry(
      call, DeviceRecord<DiondLionScalars>{c}, grad, x, m, update_sq);
}
DIOND_DEV_ENTRY(ApplyUpdateDev, DiondApplyUpdateScalars, DiondIn update, DiondIn x_in,
                DiondOut x) {
  CountDeviceScalarOp();
  return Queued<decltype(&ApplyUpdateDevBody), &ApplyUpdateDevBody>::Entry(
      call, DeviceRecord<DiondApplyUpdateScalars>{c}, update, x_in, x);
}
#undef DIOND_DEV_ENTRY

#undef DIOND_TEST_OP_BEGIN

// handoff (defined at the end of this file).
int DeviceUuids(const DiondOpsCall* call, uint8_t* uuids, int32_t capacity, int32_t* count);
int IpcOpenMemHandle(const DiondOpsCall* call, const uint8_t* handle, void** ptr,
                     uint64_t* bytes);
int IpcCloseMemHandle(const DiondOpsCall* call, void* ptr);
int VmmImportFd(const DiondOpsCall* call, int32_t fd, uint64_t bytes, uint64_t granularity,
                void** ptr, void** handle);
int VmmUnmap(const DiondOpsCall* call, void* ptr, uint64_t bytes, void* handle);
int IpcOpenEvent(const DiondOpsCall* call, const uint8_t* handle, void** event);
int EventDestroy(const DiondOpsCall* call, void* event);
int StreamWaitEvent(const DiondOpsCall* call, void* event);
int EventRecord(const DiondOpsCall* call, void* event);

#define DIOND_QUEUED(fn) &Queued<decltype(&fn), &fn>::Entry
#define DIOND_SYNC_POINT(fn) &SyncPoint<decltype(&fn), &fn>::Entry
const DiondOpsApiV1 kOps = {
    DIOND_OPS_API_VERSION,
    "host-test device (TEST BACKEND)",
    &Allocate,
    &Deallocate,
    DIOND_SYNC_POINT(CopyFromHost),
    DIOND_SYNC_POINT(CopyToHost),
    &StreamCreate,
    &StreamDestroy,
    DIOND_SYNC_POINT(StreamSynchronize),
    &MemoryStats,
    DIOND_QUEUED(Gemm),
    DIOND_QUEUED(SymmetricProduct),
    DIOND_QUEUED(SymmetricProductBf16),
    DIOND_QUEUED(ThinQr),
    DIOND_SYNC_POINT(CholeskyQr),
    DIOND_SYNC_POINT(RandomizedCholeskyQr),
    DIOND_QUEUED(FrobeniusNorm),
    DIOND_QUEUED(AxisNorms),
    DIOND_SYNC_POINT(TopKByL1Norm),
    DIOND_SYNC_POINT(IsAllZero),
    &GatherQueued,
    &ScatterQueued,
    DIOND_QUEUED(Copy),
    DIOND_QUEUED(Fill),
    DIOND_QUEUED(Axpby),
    DIOND_QUEUED(AddScalar),
    DIOND_QUEUED(Unary),
    DIOND_QUEUED(Binary),
    DIOND_QUEUED(AdamWStep),
    DIOND_QUEUED(LionStep),
    DIOND_QUEUED(AddToDiagonal),
    DIOND_QUEUED(Bf16RoundedAxpby),
    DIOND_QUEUED(AdamWStepTracked),
    DIOND_QUEUED(LionStepTracked),
    DIOND_QUEUED(MomentumUpdate),
    DIOND_QUEUED(ApplyUpdate),
    DIOND_QUEUED(NormalizeNeurons),
    DIOND_QUEUED(CopyWithChange),
    DIOND_SYNC_POINT(AllFinite),
    DIOND_SYNC_POINT(WidenScaleCheckFinite),
    DIOND_SYNC_POINT(Fnv1aChecksum),
    // handoff
    &DeviceUuids,
    &IpcOpenMemHandle,
    &IpcCloseMemHandle,
    &VmmImportFd,
    &VmmUnmap,
    &IpcOpenEvent,
    &EventDestroy,
    &StreamWaitEvent,
    &EventRecord,
    // devsession
    &HostRegister,
    &HostUnregister,
    &GraphBeginCapture,
    &GraphEndCapture,
    &GraphLaunch,
    &GraphDestroy,
    // asynccopy
    &CopyFromHostAsyncQueued,
    &CopyToHostAsyncQueued,
    DIOND_QUEUED(AllFiniteFlag),
    DIOND_QUEUED(WidenScaleCheckFiniteFlag),
    // version 7
    &DecayScatterWithChangeQueued,
    // version 8 (graph)
    &AdamWStepDev,
    &LionStepDev,
    &AdamWStepTrackedDev,
    &LionStepTrackedDev,
    &ApplyUpdateDev,
    // version 9
    &DeviceHealth,
};

#undef DIOND_QUEUED
#undef DIOND_SYNC_POINT

}  // namespace

const DiondOpsApiV1* HostTestDeviceOps() { return &kOps; }

HostTestDeviceCounters GetHostTestDeviceCounters() {
  std::lock_guard<std::mutex> lock(St().mu);
  return St().counters;
}

void SetHostTestDeviceStrict(bool strict) {
  std::lock_guard<std::recursive_mutex> guard(GuardMu());
  if (!strict) {
    // Mappings made in strict mode stay mappings (freed with munmap) but are open for good.
    ProtectAll(PROT_READ | PROT_WRITE);
    std::lock_guard<std::mutex> lock(St().mu);
    St().guarded.clear();
    St().strict = false;
    any_guarded.store(false);
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
    std::lock_guard<std::mutex> lock(Lost().mu);
    Lost().why.clear();
    Lost().trigger = nullptr;
  }
  std::lock_guard<std::mutex> lock(St().mu);
  const int64_t live = St().counters.streams_live;
  St().counters = HostTestDeviceCounters{};
  St().counters.streams_live = live;
  St().counters.host_registered_live = static_cast<int64_t>(St().host_ranges.size());
  St().budget = budget_bytes;
}

void LoseHostTestDeviceContext(const std::string& why) {
  std::lock_guard<std::mutex> lock(Lost().mu);
  if (Lost().why.empty()) Lost().why = why.empty() ? "lost by the test" : why;
}

void SetHostTestDeviceLossTrigger(std::function<bool()> trigger) {
  std::lock_guard<std::mutex> lock(Lost().mu);
  Lost().trigger = std::move(trigger);
}

void QueueHostTestStreamWork(int device, StreamHandle stream, std::function<void()> work) {
  char err[8] = {0};
  const DiondOpsCall call{device, stream, err, sizeof(err)};
  if (stream == nullptr) {
    work();
    return;
  }
  Enqueue(&call, "host work", [work = std::move(work)](const DiondOpsCall*) {
    work();
    return DIOND_OPS_OK;
  });
}

// ---- handoff (issue 12): fake device UUIDs, "IPC handles" naming TEST allocations, VMM fds
// and interprocess events, with the CUDA entries' refusals ----
namespace {

constexpr char kMemMagic[8] = {'D', 'T', 'E', 'S', 'T', 'M', 'E', 'M'};
constexpr char kEventMagic[8] = {'D', 'T', 'E', 'S', 'T', 'E', 'V', 'T'};

struct Export {
  int device = 0;
  void* ptr = nullptr;
  uint64_t bytes = 0;
};
struct VmmExport {
  int device = 0;
  void* ptr = nullptr;
  uint64_t bytes = 0;
};
struct VmmImport {
  void* ptr = nullptr;
  uint64_t bytes = 0;
};
struct Event {
  uint64_t id = 0;
  int device = 0;
};
struct Handoff {
  std::mutex mu;
  uint64_t next_id = 1;
  std::unordered_map<uint64_t, Export> exports;          // IPC memory handle id -> allocation
  std::unordered_map<void*, uint64_t> opened;            // opened base -> handle id
  std::map<std::pair<uint64_t, uint64_t>, VmmExport> vmm_exports;  // (st_dev, st_ino) of the fd
  std::set<VmmImport*> vmm_imports;
  std::unordered_map<uint64_t, int> event_exports;       // event id -> exporting device
  std::set<Event*> events;
  std::unordered_map<uint64_t, int64_t> event_records;   // event id -> records
  HostTestHandoffCounters counters;
};
Handoff& Ho() {
  static Handoff* h = new Handoff;
  return *h;
}

bool BadDevice(const DiondOpsCall* call, int* rc) {
  if (call->device >= 0 && call->device < kHostTestDeviceCount) return false;
  *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
             "host-test device: no device " + std::to_string(call->device));
  return true;
}
// The allocation `ptr` of `bytes` is still live in the pool.
bool LiveAllocation(void* ptr, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(St().mu);
  auto it = St().blocks.find(ptr);
  return it != St().blocks.end() && it->second == bytes;
}
uint64_t ReadId(const uint8_t* handle, const char* magic, bool* ok) {
  *ok = std::memcmp(handle, magic, 8) == 0;
  uint64_t id = 0;
  std::memcpy(&id, handle + 8, sizeof(id));
  for (int i = 16; i < DIOND_CUDA_IPC_HANDLE_BYTES; ++i) *ok = *ok && handle[i] == 0;
  return id;
}
void WriteId(uint8_t* handle, const char* magic, uint64_t id) {
  std::memset(handle, 0, DIOND_CUDA_IPC_HANDLE_BYTES);
  std::memcpy(handle, magic, 8);
  std::memcpy(handle + 8, &id, sizeof(id));
}

int DeviceUuids(const DiondOpsCall* call, uint8_t* uuids, int32_t capacity, int32_t* count) {
  *count = kHostTestDeviceCount;
  for (int i = 0; i < kHostTestDeviceCount && i < capacity; ++i) {
    const GpuUuidBytes u = HostTestDeviceUuid(i);
    std::memcpy(uuids + i * DIOND_GPU_UUID_BYTES, u.data(), DIOND_GPU_UUID_BYTES);
  }
  (void)call;
  return DIOND_OPS_OK;
}

// Looks the CUDA IPC `kind` ("memory", "event") handle up in `exports` (h.mu held): true, with
// *rc the FAILED_PRECONDITION, when it is not a handle of this backend or names no export.
template <typename Map>
bool FindExport(const DiondOpsCall* call, const uint8_t* handle, const char* magic,
                const std::string& kind, Map& exports, typename Map::iterator* found, int* rc) {
  bool ok = false;
  const uint64_t id = ReadId(handle, magic, &ok);
  if (!ok) {
    *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
               "host-test device: not a CUDA IPC " + kind + " handle of this backend");
    return true;
  }
  *found = exports.find(id);
  if (*found == exports.end()) {
    *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
               "host-test device: unknown CUDA IPC " + kind + " handle " + std::to_string(id));
    return true;
  }
  return false;
}

int IpcOpenMemHandle(const DiondOpsCall* call, const uint8_t* handle, void** ptr,
                     uint64_t* bytes) {
  int rc = DIOND_OPS_OK;
  if (BadDevice(call, &rc)) return rc;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.exports.end();
  if (FindExport(call, handle, kMemMagic, "memory", h.exports, &it, &rc)) return rc;
  const uint64_t id = it->first;
  if (!LiveAllocation(it->second.ptr, it->second.bytes)) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the allocation of CUDA IPC memory handle " +
                    std::to_string(id) + " was freed");
  }
  if (h.opened.count(it->second.ptr) != 0) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: CUDA IPC memory handle " + std::to_string(id) +
                    " is open already in this process");
  }
  h.opened[it->second.ptr] = id;
  ++h.counters.ipc_opens;
  *ptr = it->second.ptr;
  *bytes = it->second.bytes;
  return DIOND_OPS_OK;
}

int IpcCloseMemHandle(const DiondOpsCall* call, void* ptr) {
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  if (h.opened.erase(ptr) == 0) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: not an open CUDA IPC mapping (closed already?)");
  }
  ++h.counters.ipc_closes;
  return DIOND_OPS_OK;
}

int VmmImportFd(const DiondOpsCall* call, int32_t fd, uint64_t bytes, uint64_t granularity,
                void** ptr, void** handle) {
  int rc = DIOND_OPS_OK;
  if (BadDevice(call, &rc)) return rc;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: VMM fd " + std::to_string(fd) + ": " + std::strerror(errno));
  }
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.vmm_exports.find({static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
  if (it == h.vmm_exports.end()) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the fd is not a VMM allocation exported by this backend");
  }
  if (granularity == 0 || granularity % kHostTestVmmGranularity != 0 || bytes == 0 ||
      bytes % granularity != 0) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: VMM mapping of " + std::to_string(bytes) +
                    " bytes at granularity " + std::to_string(granularity) +
                    " (the allocation's minimum granularity is " +
                    std::to_string(kHostTestVmmGranularity) + ")");
  }
  if (bytes > it->second.bytes || !LiveAllocation(it->second.ptr, it->second.bytes)) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: VMM mapping of " + std::to_string(bytes) +
                    " bytes exceeds the exported allocation (" +
                    std::to_string(it->second.bytes) + " bytes, or freed)");
  }
  auto* imp = new VmmImport{it->second.ptr, bytes};
  h.vmm_imports.insert(imp);
  ++h.counters.vmm_maps;
  *ptr = imp->ptr;
  *handle = imp;
  return DIOND_OPS_OK;
}

int VmmUnmap(const DiondOpsCall* call, void* ptr, uint64_t bytes, void* handle) {
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto* imp = static_cast<VmmImport*>(handle);
  auto it = h.vmm_imports.find(imp);
  if (it == h.vmm_imports.end()) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: not a live VMM mapping (unmapped already?)");
  }
  if (imp->ptr != ptr || imp->bytes != bytes) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: vmm_unmap of another range than was mapped");
  }
  h.vmm_imports.erase(it);
  delete imp;
  ++h.counters.vmm_unmaps;
  return DIOND_OPS_OK;
}

int IpcOpenEvent(const DiondOpsCall* call, const uint8_t* handle, void** event) {
  int rc = DIOND_OPS_OK;
  if (BadDevice(call, &rc)) return rc;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.event_exports.end();
  if (FindExport(call, handle, kEventMagic, "event", h.event_exports, &it, &rc)) return rc;
  const uint64_t id = it->first;
  if (it->second != call->device) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the event was created on device " +
                    std::to_string(it->second) + ", not device " + std::to_string(call->device));
  }
  auto* e = new Event{id, call->device};
  h.events.insert(e);
  ++h.counters.events_opened;
  *event = e;
  return DIOND_OPS_OK;
}

// The event is one this backend opened and has not destroyed.
bool LiveEvent(const DiondOpsCall* call, void* event, int* rc) {
  if (Ho().events.count(static_cast<Event*>(event)) != 0) return true;
  *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
             "host-test device: not a live event (destroyed already?)");
  return false;
}

int EventDestroy(const DiondOpsCall* call, void* event) {
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  int rc = DIOND_OPS_OK;
  if (!LiveEvent(call, event, &rc)) return rc;
  h.events.erase(static_cast<Event*>(event));
  delete static_cast<Event*>(event);
  ++h.counters.events_destroyed;
  return DIOND_OPS_OK;
}

// The event is live (LiveEvent) and was opened on the call's device.
bool LiveEventOnDevice(const DiondOpsCall* call, void* event, int* rc) {
  if (!LiveEvent(call, event, rc)) return false;
  if (static_cast<Event*>(event)->device == call->device) return true;
  *rc = Fail(call, DIOND_OPS_FAILED_PRECONDITION,
             "host-test device: the event belongs to another device");
  return false;
}

// The stream entries: a stream of ours on the event's device (host memory: nothing to order).
int StreamWaitEvent(const DiondOpsCall* call, void* event) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  if (!LiveEventOnDevice(call, event, &rc)) return rc;
  ++h.counters.stream_waits;
  return DIOND_OPS_OK;
}

int EventRecord(const DiondOpsCall* call, void* event) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  if (!LiveEventOnDevice(call, event, &rc)) return rc;
  ++h.event_records[static_cast<Event*>(event)->id];
  ++h.counters.event_records;
  return DIOND_OPS_OK;
}

// `ptr` is the base of a live allocation (its size in *bytes) and `device` one of ours.
bool ExportableBlock(int device, void* ptr, uint64_t* bytes) {
  if (device < 0 || device >= kHostTestDeviceCount) return false;
  std::lock_guard<std::mutex> lock(St().mu);
  auto it = St().blocks.find(ptr);
  if (it == St().blocks.end()) return false;
  *bytes = it->second;
  return true;
}

}  // namespace

GpuUuidBytes HostTestDeviceUuid(int index) {
  GpuUuidBytes u{};
  const char prefix[] = "diond-test-gpu";  // 14 characters, then the index
  std::memcpy(u.data(), prefix, sizeof(prefix) - 1);
  u[14] = static_cast<uint8_t>(index >> 8);
  u[15] = static_cast<uint8_t>(index);
  return u;
}

bool HostTestExportIpcMemHandle(int device, void* ptr, uint8_t* handle) {
  uint64_t bytes = 0;
  if (!ExportableBlock(device, ptr, &bytes)) return false;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  const uint64_t id = h.next_id++;
  h.exports[id] = Export{device, ptr, bytes};
  WriteId(handle, kMemMagic, id);
  return true;
}

int HostTestExportVmmFd(int device, void* ptr) {
  uint64_t bytes = 0;
  if (!ExportableBlock(device, ptr, &bytes)) return -1;
  const int fd = memfd_create("diond-test-vmm", MFD_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return -1;
  }
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  h.vmm_exports[{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)}] =
      VmmExport{device, ptr, bytes};
  return fd;
}

bool HostTestCreateIpcEvent(int device, uint8_t* handle) {
  if (device < 0 || device >= kHostTestDeviceCount) return false;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  const uint64_t id = h.next_id++;
  h.event_exports[id] = device;
  WriteId(handle, kEventMagic, id);
  return true;
}

int64_t HostTestEventRecords(const uint8_t* handle) {
  bool ok = false;
  const uint64_t id = ReadId(handle, kEventMagic, &ok);
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.event_records.find(id);
  return ok && it != h.event_records.end() ? it->second : 0;
}

HostTestHandoffCounters GetHostTestHandoffCounters() {
  std::lock_guard<std::mutex> lock(Ho().mu);
  HostTestHandoffCounters c = Ho().counters;
  c.ipc_open_now = static_cast<int64_t>(Ho().opened.size());
  c.vmm_mapped_now = static_cast<int64_t>(Ho().vmm_imports.size());
  c.events_open_now = static_cast<int64_t>(Ho().events.size());
  return c;
}

ScopedHostTestDevice::ScopedHostTestDevice(bool strict) {
  UnregisterOpsBackendForTest(DeviceType::kTest);
  status_ = RegisterPluginOps(DeviceType::kTest, HostTestDeviceOps());
  SetHostTestDeviceStrict(strict);
}

ScopedHostTestDevice::~ScopedHostTestDevice() {
  SetHostTestDeviceStrict(false);
  UnregisterOpsBackendForTest(DeviceType::kTest);
}

absl::StatusOr<std::unique_ptr<HostTestStreamContext>> HostTestStreamContext::Create(
    Device device, int num_threads) {
  std::unique_ptr<HostTestStreamContext> s(new HostTestStreamContext);
  s->device_ = device;
  absl::StatusOr<StreamHandle> stream = CreateDeviceStream(device);
  if (!stream.ok()) return stream.status();
  s->stream_ = *stream;
  ContextOptions o;
  o.device = device;
  o.stream = s->stream_;
  o.num_threads = num_threads;
  absl::StatusOr<std::unique_ptr<Context>> ctx = Context::Create(o);
  if (!ctx.ok()) return ctx.status();  // the destructor destroys the stream
  s->ctx_ = std::move(*ctx);
  return s;
}

HostTestStreamContext::~HostTestStreamContext() {
  ctx_.reset();
  if (stream_ != nullptr) DestroyDeviceStream(device_, stream_);
}

}  // namespace diond::kernels::testing
