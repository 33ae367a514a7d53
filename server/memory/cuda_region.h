// The daemon side of CUDA regions (docs/DATA_PLANE.md "CUDA regions"): trainer GPU
// memory opened in the daemon's process through the device runtime's imports
// (kernels/device_runtime.h), on the device the trainer's UUID maps to.
//
// A CudaRegion owns what it opened: a legacy IPC mapping (closed with cudaIpcCloseMemHandle) or
// a VMM mapping (unmapped and released), undone by the destructor. It never touches a device
// other than the one the trainer's UUID maps to, and it refuses (FAILED_PRECONDITION, both
// UUIDs) a GPU the daemon cannot see or one that is not the daemon's compute device.
//
// Thread-safety: not thread-safe; Session serializes its use.
#ifndef DIOND_SERVER_MEMORY_CUDA_REGION_H_
#define DIOND_SERVER_MEMORY_CUDA_REGION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/device_runtime.h"
#include "server/memory/gpu_uuid.h"

namespace diond::memory {

class CudaRegion {
 public:
  // Maps `trainer` (its GPU's UUID) to a device of `compute`'s type through the plugin's UUID
  // list (MapGpuUuid), which must be `compute` itself; opens the legacy IPC memory `handle`
  // there and checks [offset, offset + size) against the allocation it names (OUT_OF_RANGE
  // with the numbers; the handle is closed again). Regions of one handle (a trainer's PARAMETERS
  // and GRADIENTS carved out of one allocation) share its one mapping in this process (a handle
  // opens once per process), closed with the last of them.
  static absl::StatusOr<std::unique_ptr<CudaRegion>> OpenIpc(kernels::Device compute,
                                                             const GpuUuid& trainer,
                                                             absl::Span<const uint8_t> handle,
                                                             int64_t offset, int64_t size);
  // The same for a VMM allocation exported as `fd` (the caller keeps it): the mapping covers
  // [0, offset + size) rounded up to `granularity` (a power of two the plugin checks against
  // the allocation's minimum granularity).
  static absl::StatusOr<std::unique_ptr<CudaRegion>> OpenVmm(kernels::Device compute,
                                                             const GpuUuid& trainer, int fd,
                                                             int64_t offset, int64_t size,
                                                             int64_t granularity);
  ~CudaRegion();
  CudaRegion(const CudaRegion&) = delete;
  CudaRegion& operator=(const CudaRegion&) = delete;

  // The region's first byte, device memory of device().
  uint8_t* data() const { return base_ + offset_; }
  kernels::Device device() const { return device_; }
  int64_t offset() const { return offset_; }
  int64_t size() const { return size_; }
  bool vmm() const { return vmm_; }
  // "CUDA_IPC region of 4096 bytes at offset 0 on device 0 (GPU-...)".
  std::string Describe() const;

  // CudaRegions alive in this process (tests count leaks with it).
  static int64_t LiveCount();

 private:
  CudaRegion() = default;
  kernels::Device device_;
  GpuUuid uuid_{};
  uint8_t* base_ = nullptr;
  int64_t offset_ = 0, size_ = 0;
  bool vmm_ = false;
  kernels::VmmMapping vmm_mapping_;
};

}  // namespace diond::memory

#endif  // DIOND_SERVER_MEMORY_CUDA_REGION_H_
