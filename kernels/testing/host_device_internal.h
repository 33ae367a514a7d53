// TEST BACKEND (host_device_backend.h): what its files share. One file per concern:
//   host_device_memory.cc   the pool, strict mode's guarded mappings, a lost context;
//   host_device_streams.cc  streams, their deferred work, host registration, stream capture;
//   host_device_handoff.cc  device UUIDs, IPC memory handles, VMM fds, interprocess events;
//   host_device_ops.cc      the ops (forwarded to the CPU backend) and the C table;
//   host_device_backend.cc  the test fixtures.
// Internal to kernels/testing.
#ifndef DIOND_KERNELS_TESTING_HOST_DEVICE_INTERNAL_H_
#define DIOND_KERNELS_TESTING_HOST_DEVICE_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "kernels/cuda/plugin_api.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::kernels::testing::host_device {

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
State& St();

// The entry guard of strict mode: the first (outermost) entry of the backend makes every guarded
// mapping readable and writable, the last exit makes them PROT_NONE again. One entry at a time
// (a recursive mutex: an entry may call another one through the CPU ops only, never back into
// this table, but a nested guard costs nothing). Lenient-mode entries take no lock.
class EntryGuard {
 public:
  EntryGuard();
  ~EntryGuard();
  EntryGuard(const EntryGuard&) = delete;
  EntryGuard& operator=(const EntryGuard&) = delete;

 private:
  bool held_ = false;
};

// Writes `msg` to call->err; returns `code`.
int Fail(const DiondOpsCall* call, int code, const std::string& msg);
// DIOND_OPS_OK, or the status's code with its message.
int FromStatus(const DiondOpsCall* call, const absl::Status& s);
// Once the context is lost (LoseHostTestDeviceContext): the CUDA plugin's refusal in *rc, and
// true. `ask`: an op entry, which asks the loss trigger first.
bool RefuseIfLost(const DiondOpsCall* call, int* rc, bool ask = false);
// Whether [p, p + bytes) lies in one live block of the pool (device memory).
bool OnDevice(const void* p, size_t bytes);

// Every op entry: the context must not be lost (the trigger is asked here), and the stream must
// be one of ours (or null: the default stream). Counts the op.
bool CheckStream(const DiondOpsCall* call, int* rc);
void CountSync();
// Queues `run` on call->stream (or appends it to the stream's capture).
void Enqueue(const DiondOpsCall* call, const char* op, std::function<int(const DiondOpsCall*)> run);
// Runs every stream's queue (the caller holds an EntryGuard).
void DrainAll();
// Drains the call's stream and takes its kept failure, if any (then *rc is set and true).
bool WaitForStream(const DiondOpsCall* call, int* rc);
// A sync point on a capturing stream: refused, and the capture invalidated (true, *rc set).
bool RefuseWhileCapturing(const DiondOpsCall* call, int* rc);
// A queued host copy under capture of memory that is not host_register'ed: refused, and the
// capture invalidated (true, *rc set).
bool RefusePageableWhileCapturing(const DiondOpsCall* call, const void* host, size_t bytes,
                                  int* rc);

// The entries of kernels/ops.def's DIOND_ENTRY rows, by their `Name`.
#define DIOND_ENTRY(name, Name, ret, c_params) ret Name c_params;
#include "kernels/ops.def"

}  // namespace diond::kernels::testing::host_device

#endif  // DIOND_KERNELS_TESTING_HOST_DEVICE_INTERNAL_H_
