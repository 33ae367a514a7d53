// TEST BACKEND (host_device_backend.h): streams and their deferred work, host registration and
// stream capture.
#include <cstdio>
#include <deque>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/testing/host_device_backend.h"
#include "kernels/testing/host_device_internal.h"

namespace diond::kernels::testing {
namespace host_device {

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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
// A sync point: the host waits for the stream (its queue runs, a queued failure is returned).
int StreamSynchronize(const DiondOpsCall* call) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (RefuseWhileCapturing(call, &rc)) return rc;
  EntryGuard entry_guard;
  if (WaitForStream(call, &rc)) return rc;
  CountSync();
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

// A queued host copy under capture: the host range must be host_register'ed (pinned), as
// CUDA's: it cannot capture a copy of pageable memory (the runtime
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

}  // namespace host_device

void QueueHostTestStreamWork(int device, StreamHandle stream, std::function<void()> work) {
  char err[8] = {0};
  const DiondOpsCall call{device, stream, err, sizeof(err)};
  if (stream == nullptr) {
    work();
    return;
  }
  host_device::Enqueue(&call, "host work", [work = std::move(work)](const DiondOpsCall*) {
    work();
    return DIOND_OPS_OK;
  });
}

}  // namespace diond::kernels::testing
