// TEST BACKEND — NOT A PRODUCT FEATURE. A "device" whose memory is host memory, behind the same
// plugin C ABI as the CUDA backend (kernels/cuda/plugin_api.h, DiondOpsApiV1), for
// DeviceType::kTest.
//
// It lets CI run, without a GPU, everything of the device path that is not CUDA itself: the
// adapter (kernels/plugin/plugin_backend.h) and its TensorView ↔ DiondTensor conversion, the
// explicit host ↔ device copies, a stream object per session (ops must name a stream this
// backend created), and a pool with accounting and a budget, whose exhaustion is
// RESOURCE_EXHAUSTED naming the numbers. The ops run on the CPU backend (the arithmetic is the
// CPU's, bit for bit), or, for AdamW / Lion / cautious decay, through the per-element functions
// of kernels/elementwise_math.h with the scalars the adapter sent (so the scalar transport is
// checked too).
//
// STRICT MODE (SetHostTestDeviceStrict(true)): every allocation made while it is on is a
// page-aligned anonymous mapping of its own that is PROT_NONE except while one of this backend's
// entry points runs (each op entry, copy_from_host / copy_to_host and stream_synchronize makes the
// live mappings readable and writable on entry and PROT_NONE again on exit; one entry at a time,
// under a process-wide recursive mutex). So host code that reads or writes "device" memory outside
// an op or an explicit copy faults at once (SIGSEGV) instead of silently working, as it would on
// a GPU. Tests that prove that code above the kernels touches device memory only through the ops
// API turn it on; the default is the lenient mode (plain host memory), which the other tests use.
//
// DEFERRED STREAM WORK (asynccopy): an entry issued on a stream this backend created that only
// writes device memory (every op but the sync points below, and the asynchronous copies) is not
// run by the call but queued on its stream; the queue runs in issue order when the host waits
// for the stream: stream_synchronize, copy_from_host / copy_to_host, and the entries that hand a
// value to the host (top_k_by_l1_norm, is_all_zero, cholesky_qr, randomized_cholesky_qr,
// all_finite, widen_scale_check_finite, fnv1a_checksum), each of which counts one sync; freeing
// device memory and destroying a stream also run what is queued first. So a host read of a
// copy_to_host_async destination, or a host write of a copy_from_host_async source, before the
// wait shows at once (stale bytes, a changed copy), as it would on a GPU. Entries on the default
// (null) stream run at once. A queued entry's failure is returned by the next wait.
//
// STREAM CAPTURE (graph_*): while a stream captures, its queued entries are appended to the
// capture instead (nothing runs), a sync point on it fails and invalidates the capture, and so
// does a queued host copy whose host range is not host_register'ed (CUDA cannot capture a copy
// of pageable memory). A launch queues the captured closures again; a replayed copy counts as a
// copy.
//
// Counters make the device traffic observable to tests (copies, bytes, syncs, streams).
#ifndef DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_
#define DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "kernels/cuda/plugin_api.h"

namespace diond::kernels::testing {

const DiondOpsApiV1* HostTestDeviceOps();

struct HostTestDeviceCounters {
  int64_t copies_to_device = 0, copies_to_host = 0;
  int64_t bytes_to_device = 0, bytes_to_host = 0;
  // The host's waits for a stream: stream_synchronize calls and the sync-point entries above
  // (the synchronous copies among them).
  int64_t syncs = 0;
  // asynccopy: of the copies above, those queued by copy_from_host_async / copy_to_host_async;
  // and the entries queued on a stream (run later) rather than run by the call.
  int64_t async_copies_to_device = 0, async_copies_to_host = 0;
  int64_t deferred = 0;
  int64_t streams_created = 0, streams_live = 0;
  int64_t ops = 0;                    // op entries run
  int64_t ops_on_default_stream = 0;  // op entries called with a null stream
  // devsession: host_register / host_unregister calls, the ranges registered now, and the
  // pairing errors (an unregister of a pointer not registered, a register of one already
  // registered, or a range overlapping a registered one), each also refused with INTERNAL.
  int64_t host_registers = 0, host_unregisters = 0, host_registered_live = 0;
  int64_t host_register_errors = 0;
  // graph: stream captures begun / ended into a graph / invalidated by a sync point, graph
  // launches, and the *_dev entries (device-side scalars) queued.
  int64_t graph_captures = 0, graphs_made = 0, captures_invalidated = 0, graph_launches = 0;
  int64_t device_scalar_ops = 0;
};
HostTestDeviceCounters GetHostTestDeviceCounters();
// Strict mode on or off (see above). It applies to allocations made while it is on; turning it
// off opens the existing strict mappings for good. Thread-safe.
void SetHostTestDeviceStrict(bool strict);
bool HostTestDeviceStrict();
// Resets the counters (not the pool) and sets the pool budget (0: unlimited); a lost context
// (below) is usable again. (host_registered_live and streams_live are kept: they describe what
// exists.)
void ResetHostTestDevice(uint64_t budget_bytes);

// ---- a lost context: the stand-in for a sticky CUDA error (an illegal address in a kernel),
// after which the CUDA plugin refuses every entry. From LoseHostTestDeviceContext on (until
// ResetHostTestDevice), every entry that takes a call, and every queued work when its stream
// runs, fails with FAILED_PRECONDITION "host-test device N: the device context is lost (<why>,
// an unrecoverable error); ...", and device_health reports it. SetHostTestDeviceLossTrigger:
// `trigger` is asked at every op entry (outside the backend's locks) and loses the context the
// first time it answers true; that entry fails, as the launch that faulted would.
void LoseHostTestDeviceContext(const std::string& why);
void SetHostTestDeviceLossTrigger(std::function<bool()> trigger);

// Queues `work` on `stream` (one of this backend's): it runs when the stream's queue reaches it
// (the next wait of the stream), in order with the entries queued there, as a CUDA host function
// or a kernel waiting on a peer would; a null stream runs it now. For tests of what waits on a
// stream (e.g. a collective that never completes).
void QueueHostTestStreamWork(int device, StreamHandle stream, std::function<void()> work);

// ---- handoff: the GPU half emulated. The TEST backend has kHostTestDeviceCount
// devices with fake UUIDs; the functions below play the trainer's side (what it would export
// with cudaIpcGetMemHandle, cuMemExportToShareableHandle, cudaIpcGetEventHandle), and the table's
// entries open what they made, refusing bad, unknown, freed, closed and foreign ones as the CUDA
// entries would (FAILED_PRECONDITION). ----
inline constexpr int kHostTestDeviceCount = 2;
inline constexpr uint64_t kHostTestVmmGranularity = 64 << 10;  // the "minimum granularity"
using GpuUuidBytes = std::array<uint8_t, DIOND_GPU_UUID_BYTES>;
// "diond-test-gpu" + the index (2 bytes, big-endian).
GpuUuidBytes HostTestDeviceUuid(int index);
// A handle (DIOND_CUDA_IPC_HANDLE_BYTES written to `handle`) naming the TEST allocation that
// starts at `ptr`; false for a pointer that is not one, or a bad device.
bool HostTestExportIpcMemHandle(int device, void* ptr, uint8_t* handle);
// A new fd (the caller closes it) standing for the TEST allocation at `ptr`, as an exported VMM
// allocation; -1 for a pointer that is not one.
int HostTestExportVmmFd(int device, void* ptr);
// An interprocess event created on `device`; its handle written to `handle`.
bool HostTestCreateIpcEvent(int device, uint8_t* handle);
// How often the event of `handle` was recorded (event_record), and waited on (stream_wait_event).
int64_t HostTestEventRecords(const uint8_t* handle);
int64_t HostTestEventWaits(const uint8_t* handle);
struct HostTestHandoffCounters {
  int64_t ipc_opens = 0, ipc_closes = 0, vmm_maps = 0, vmm_unmaps = 0;
  int64_t events_opened = 0, events_destroyed = 0, stream_waits = 0, event_records = 0;
  int64_t ipc_open_now = 0, vmm_mapped_now = 0, events_open_now = 0;  // live right now
};
HostTestHandoffCounters GetHostTestHandoffCounters();

// ---- fixtures: the set-up every test of the TEST backend repeats ----
// Registers this backend as DeviceType::kTest (replacing any earlier registration) and sets
// strict mode as asked; the destructor turns strict mode off and unregisters the backend. One
// at a time per process. status(): the registration's result (check it in SetUp).
class ScopedHostTestDevice {
 public:
  explicit ScopedHostTestDevice(bool strict = true);
  ~ScopedHostTestDevice();
  ScopedHostTestDevice(const ScopedHostTestDevice&) = delete;
  ScopedHostTestDevice& operator=(const ScopedHostTestDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// A stream of the TEST device `device` and a Context on it (`num_threads` threads), as a device
// session holds them; destroyed Context first, then the stream. Needs the backend registered.
class HostTestStreamContext {
 public:
  static absl::StatusOr<std::unique_ptr<HostTestStreamContext>> Create(Device device,
                                                                       int num_threads = 1);
  ~HostTestStreamContext();
  HostTestStreamContext(const HostTestStreamContext&) = delete;
  HostTestStreamContext& operator=(const HostTestStreamContext&) = delete;
  Context& ctx() const { return *ctx_; }
  StreamHandle stream() const { return stream_; }

 private:
  HostTestStreamContext() = default;
  Device device_;
  StreamHandle stream_ = nullptr;
  std::unique_ptr<Context> ctx_;
};

}  // namespace diond::kernels::testing

#endif  // DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_
