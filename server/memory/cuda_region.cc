// CudaRegion (cuda_region.h).
#include "server/memory/cuda_region.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace diond::memory {
namespace {

std::atomic<int64_t> g_live{0};

// Legacy IPC handles open in this process. A process can open a handle only once (CUDA and the
// TEST backend refuse a second cudaIpcOpenMemHandle of it), but a trainer may carve both roles
// out of one allocation: the regions of one handle share its mapping, closed with the last.
struct IpcShare {
  kernels::Device device;
  std::string handle;
  void* ptr = nullptr;
  uint64_t bytes = 0;
  int refs = 0;
};
absl::Mutex g_ipc_mu;
std::vector<IpcShare>* g_ipc ABSL_GUARDED_BY(g_ipc_mu) = new std::vector<IpcShare>;

absl::StatusOr<kernels::IpcMapping> AcquireIpc(kernels::Device device,
                                               absl::Span<const uint8_t> handle) {
  const std::string key(reinterpret_cast<const char*>(handle.data()), handle.size());
  absl::MutexLock lock(&g_ipc_mu);
  for (IpcShare& e : *g_ipc) {
    if (e.device == device && e.handle == key) {
      ++e.refs;
      return kernels::IpcMapping{e.ptr, e.bytes};
    }
  }
  DIOND_ASSIGN_OR_RETURN(
      kernels::IpcMapping m,
      kernels::DeviceRuntimeFor(device.type).open_ipc_mem_handle(device, handle));
  g_ipc->push_back(IpcShare{device, key, m.ptr, m.bytes, 1});
  return m;
}

absl::Status ReleaseIpc(kernels::Device device, void* ptr) {
  absl::MutexLock lock(&g_ipc_mu);
  for (auto it = g_ipc->begin(); it != g_ipc->end(); ++it) {
    if (it->device == device && it->ptr == ptr) {
      if (--it->refs > 0) return absl::OkStatus();
      g_ipc->erase(it);
      return kernels::DeviceRuntimeFor(device.type).close_ipc_mem_handle(device, ptr);
    }
  }
  return absl::InternalError("releasing a CUDA IPC mapping that is not open");
}

// The daemon's index of the trainer's GPU, which must be the compute device.
absl::StatusOr<kernels::Device> DeviceOf(kernels::Device compute, const GpuUuid& trainer,
                                         absl::string_view kind) {
  if (kernels::FindDeviceRuntime(compute.type) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(kind, " needs a daemon that computes on a GPU; this one computes on the CPU"));
  }
  DIOND_ASSIGN_OR_RETURN(std::vector<kernels::GpuUuid> uuids,
                         kernels::DeviceRuntimeFor(compute.type).device_uuids());
  std::vector<GpuDevice> devices;
  for (size_t i = 0; i < uuids.size(); ++i) {
    GpuDevice d;
    d.index = static_cast<int>(i);
    std::copy(uuids[i].begin(), uuids[i].end(), d.uuid.begin());
    devices.push_back(d);
  }
  DIOND_ASSIGN_OR_RETURN(int index, MapGpuUuid(trainer, devices));
  if (index != compute.index) {
    const std::string mine = compute.index >= 0 && compute.index < static_cast<int>(devices.size())
                                 ? FormatGpuUuid(devices[compute.index].uuid)
                                 : std::string("?");
    return absl::FailedPreconditionError(absl::StrCat(
        kind, ": the trainer's GPU ", FormatGpuUuid(trainer), " is this daemon's device ", index,
        ", but the daemon computes on device ", compute.index, " (", mine,
        "); run the daemon on the trainer's GPU (the daemon never touches another device)"));
  }
  return compute;
}

absl::Status CheckRange(absl::string_view kind, int64_t offset, int64_t size, uint64_t bytes) {
  if (offset < 0 || size <= 0 || static_cast<uint64_t>(offset) > bytes ||
      static_cast<uint64_t>(size) > bytes - static_cast<uint64_t>(offset)) {
    return absl::OutOfRangeError(absl::StrCat(kind, ": region [", offset, ", +", size,
                                              ") is outside the trainer's allocation of ", bytes,
                                              " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaRegion>> CudaRegion::OpenIpc(kernels::Device compute,
                                                                const GpuUuid& trainer,
                                                                absl::Span<const uint8_t> handle,
                                                                int64_t offset, int64_t size) {
  DIOND_ASSIGN_OR_RETURN(kernels::Device device, DeviceOf(compute, trainer, "CUDA_IPC"));
  DIOND_ASSIGN_OR_RETURN(kernels::IpcMapping m, AcquireIpc(device, handle));
  if (absl::Status s = CheckRange("CUDA_IPC", offset, size, m.bytes); !s.ok()) {
    ReleaseIpc(device, m.ptr).IgnoreError();
    return s;
  }
  std::unique_ptr<CudaRegion> r(new CudaRegion);
  r->device_ = device;
  r->uuid_ = trainer;
  r->base_ = static_cast<uint8_t*>(m.ptr);
  r->offset_ = offset;
  r->size_ = size;
  ++g_live;
  return r;
}

absl::StatusOr<std::unique_ptr<CudaRegion>> CudaRegion::OpenVmm(kernels::Device compute,
                                                                const GpuUuid& trainer, int fd,
                                                                int64_t offset, int64_t size,
                                                                int64_t granularity) {
  if (granularity <= 0 || (granularity & (granularity - 1)) != 0 || offset < 0 || size <= 0 ||
      offset > INT64_MAX - size - granularity) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA_VMM_FD: offset ", offset, ", size ", size, ", granularity ", granularity,
                     ": need offset >= 0, size > 0 and a power-of-two granularity"));
  }
  DIOND_ASSIGN_OR_RETURN(kernels::Device device, DeviceOf(compute, trainer, "CUDA_VMM_FD"));
  const int64_t end = offset + size;
  const uint64_t bytes = static_cast<uint64_t>((end + granularity - 1) / granularity * granularity);
  DIOND_ASSIGN_OR_RETURN(kernels::VmmMapping m,
                         kernels::DeviceRuntimeFor(device.type)
                             .import_vmm_fd(device, fd, bytes, static_cast<uint64_t>(granularity)));
  std::unique_ptr<CudaRegion> r(new CudaRegion);
  r->device_ = device;
  r->uuid_ = trainer;
  r->base_ = static_cast<uint8_t*>(m.ptr);
  r->offset_ = offset;
  r->size_ = size;
  r->vmm_ = true;
  r->vmm_mapping_ = m;
  ++g_live;
  return r;
}

CudaRegion::~CudaRegion() {
  absl::Status s = vmm_ ? kernels::DeviceRuntimeFor(device_.type).unmap_vmm(device_, vmm_mapping_)
                        : ReleaseIpc(device_, base_);
  if (!s.ok()) DIOND_LOG(ERROR) << Describe() << ": releasing it failed: " << s;
  --g_live;
}

std::string CudaRegion::Describe() const {
  return absl::StrCat(vmm_ ? "CUDA_VMM_FD" : "CUDA_IPC", " region of ", size_, " bytes at offset ",
                      offset_, " on device ", device_.index, " (", FormatGpuUuid(uuid_), ")");
}

int64_t CudaRegion::LiveCount() { return g_live.load(); }

}  // namespace diond::memory
