// TEST BACKEND (host_device_backend.h): the GPU half of a hand-off emulated: fake device
// UUIDs, "IPC handles" naming TEST allocations, VMM fds and interprocess events, with the CUDA
// entries' refusals.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "kernels/testing/host_device_backend.h"
#include "kernels/testing/host_device_internal.h"

namespace diond::kernels::testing {
namespace host_device {
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
  std::unordered_map<uint64_t, Export> exports;  // IPC memory handle id -> allocation
  std::unordered_map<void*, uint64_t> opened;    // opened base -> handle id
  std::map<std::pair<uint64_t, uint64_t>, VmmExport> vmm_exports;  // (st_dev, st_ino) of the fd
  std::set<VmmImport*> vmm_imports;
  std::unordered_map<uint64_t, int> event_exports;  // event id -> exporting device
  std::set<Event*> events;
  std::unordered_map<uint64_t, int64_t> event_records;  // event id -> records
  std::unordered_map<uint64_t, int64_t> event_waits;    // event id -> stream waits on it
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

}  // namespace

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

int IpcOpenMemHandle(const DiondOpsCall* call, const uint8_t* handle, void** ptr, uint64_t* bytes) {
  int rc = DIOND_OPS_OK;
  if (BadDevice(call, &rc)) return rc;
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.exports.end();
  if (FindExport(call, handle, kMemMagic, "memory", h.exports, &it, &rc)) return rc;
  const uint64_t id = it->first;
  if (!LiveAllocation(it->second.ptr, it->second.bytes)) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "host-test device: the allocation of CUDA IPC memory handle " + std::to_string(id) +
                    " was freed");
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
  auto it =
      h.vmm_exports.find({static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
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
                    " bytes exceeds the exported allocation (" + std::to_string(it->second.bytes) +
                    " bytes, or freed)");
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
                "host-test device: the event was created on device " + std::to_string(it->second) +
                    ", not device " + std::to_string(call->device));
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
  ++h.event_waits[static_cast<Event*>(event)->id];
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

}  // namespace host_device

using host_device::Export;
using host_device::ExportableBlock;
using host_device::Handoff;
using host_device::Ho;
using host_device::kEventMagic;
using host_device::kMemMagic;
using host_device::ReadId;
using host_device::VmmExport;
using host_device::WriteId;

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

namespace {

int64_t EventCount(const uint8_t* handle, std::unordered_map<uint64_t, int64_t> Handoff::*counts) {
  bool ok = false;
  const uint64_t id = ReadId(handle, kEventMagic, &ok);
  Handoff& h = Ho();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = (h.*counts).find(id);
  return ok && it != (h.*counts).end() ? it->second : 0;
}

}  // namespace

int64_t HostTestEventRecords(const uint8_t* handle) {
  return EventCount(handle, &Handoff::event_records);
}

int64_t HostTestEventWaits(const uint8_t* handle) {
  return EventCount(handle, &Handoff::event_waits);
}

HostTestHandoffCounters GetHostTestHandoffCounters() {
  std::lock_guard<std::mutex> lock(Ho().mu);
  HostTestHandoffCounters c = Ho().counters;
  c.ipc_open_now = static_cast<int64_t>(Ho().opened.size());
  c.vmm_mapped_now = static_cast<int64_t>(Ho().vmm_imports.size());
  c.events_open_now = static_cast<int64_t>(Ho().events.size());
  return c;
}

}  // namespace diond::kernels::testing
