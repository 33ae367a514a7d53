// The non-CUDA half of the C++ CudaArena (cuda_arena.h; docs/DATA_PLANE.md "CUDA regions"): how
// one device allocation holds both arenas, and the RegisterRegion requests that name it. Built
// everywhere (no CUDA types), so that its logic is tested on machines without a GPU.
#ifndef DIOND_CLIENT_CPP_DIOND_CUDA_REGION_REQUEST_H_
#define DIOND_CLIENT_CPP_DIOND_CUDA_REGION_REQUEST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "diond/types.h"
#include "diond/v1/optimizer.pb.h"

namespace diond::client {

inline constexpr int64_t kCudaIpcHandleBytes = 64;  // cudaIpcMemHandle_t
inline constexpr int64_t kGpuUuidBytes = 16;        // cudaDeviceProp::uuid

// One device allocation for both arenas: parameters at offset 0, gradients at the first multiple
// of 256 after them, the whole rounded up to `granularity` (1 for a legacy cudaMalloc
// allocation; the VMM allocation's granularity, a power of two, otherwise).
struct CudaArenaPlan {
  int64_t param_offset = 0;
  int64_t grad_offset = 0;
  int64_t bytes = 0;  // the allocation's size
};
// INVALID_ARGUMENT for an empty layout or a granularity that is not a positive power of two.
absl::StatusOr<CudaArenaPlan> PlanCudaArena(const Layout& layout, int64_t granularity);

// RegisterRegion for a legacy IPC handle of the allocation base (`handle`: 64 bytes, `uuid`:
// 16 bytes, INVALID_ARGUMENT otherwise) and the role's range in it.
absl::StatusOr<v1::RegisterRegionRequest> CudaIpcRegionRequest(const std::string& session_id,
                                                               v1::RegionRole role,
                                                               absl::Span<const uint8_t> handle,
                                                               absl::Span<const uint8_t> uuid,
                                                               int64_t offset, int64_t size);
// RegisterRegion for a VMM allocation whose exported fd went over the fd channel (`fd_token`).
absl::StatusOr<v1::RegisterRegionRequest> CudaVmmRegionRequest(
    const std::string& session_id, v1::RegionRole role, const std::string& fd_token,
    absl::Span<const uint8_t> uuid, int64_t offset, int64_t size, int64_t granularity);

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_CUDA_REGION_REQUEST_H_
