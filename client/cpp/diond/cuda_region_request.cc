// CudaArena's plan and requests (cuda_region_request.h).
#include "diond/cuda_region_request.h"

#include "absl/strings/str_cat.h"

namespace diond::client {
namespace {

bool PowerOfTwo(int64_t g) { return g > 0 && (g & (g - 1)) == 0; }

absl::Status CheckRange(int64_t offset, int64_t size) {
  if (offset < 0 || offset % 256 != 0 || size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("region offset ", offset, " and size ", size,
                                                   ": need a non-negative multiple of 256 and a "
                                                   "positive size"));
  }
  return absl::OkStatus();
}

absl::Status CheckUuid(absl::Span<const uint8_t> uuid) {
  if (static_cast<int64_t>(uuid.size()) != kGpuUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a GPU UUID is ", kGpuUuidBytes, " bytes, got ", uuid.size()));
  }
  return absl::OkStatus();
}

std::string Str(absl::Span<const uint8_t> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

}  // namespace

absl::StatusOr<CudaArenaPlan> PlanCudaArena(const Layout& layout, int64_t granularity) {
  if (layout.param_arena_bytes <= 0 || layout.grad_arena_bytes <= 0) {
    return absl::InvalidArgumentError("PlanCudaArena: the layout has empty arenas");
  }
  if (!PowerOfTwo(granularity)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PlanCudaArena: granularity ", granularity, " is not a power of two"));
  }
  CudaArenaPlan p;
  p.grad_offset = (layout.param_arena_bytes + 255) / 256 * 256;
  const int64_t end = p.grad_offset + layout.grad_arena_bytes;
  p.bytes = (end + granularity - 1) / granularity * granularity;
  return p;
}

absl::StatusOr<v1::RegisterRegionRequest> CudaIpcRegionRequest(const std::string& session_id,
                                                               v1::RegionRole role,
                                                               absl::Span<const uint8_t> handle,
                                                               absl::Span<const uint8_t> uuid,
                                                               int64_t offset, int64_t size) {
  if (static_cast<int64_t>(handle.size()) != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a cudaIpcMemHandle_t is ", kCudaIpcHandleBytes,
                                                   " bytes, got ", handle.size()));
  }
  if (absl::Status s = CheckUuid(uuid); !s.ok()) return s;
  if (absl::Status s = CheckRange(offset, size); !s.ok()) return s;
  v1::RegisterRegionRequest r;
  r.set_session_id(session_id);
  r.set_role(role);
  r.set_kind(v1::REGION_KIND_CUDA_IPC);
  v1::CudaIpcRegion* c = r.mutable_cuda_ipc();
  c->set_mem_handle(Str(handle));
  c->set_gpu_uuid(Str(uuid));
  c->set_offset_bytes(offset);
  c->set_size_bytes(size);
  return r;
}

absl::StatusOr<v1::RegisterRegionRequest> CudaVmmRegionRequest(
    const std::string& session_id, v1::RegionRole role, const std::string& fd_token,
    absl::Span<const uint8_t> uuid, int64_t offset, int64_t size, int64_t granularity) {
  if (fd_token.empty()) return absl::InvalidArgumentError("CUDA_VMM_FD needs the fd's token");
  if (!PowerOfTwo(granularity)) {
    return absl::InvalidArgumentError(
        absl::StrCat("granularity ", granularity, " is not a power of two"));
  }
  if (absl::Status s = CheckUuid(uuid); !s.ok()) return s;
  if (absl::Status s = CheckRange(offset, size); !s.ok()) return s;
  v1::RegisterRegionRequest r;
  r.set_session_id(session_id);
  r.set_role(role);
  r.set_kind(v1::REGION_KIND_CUDA_VMM_FD);
  v1::CudaVmmFdRegion* c = r.mutable_cuda_vmm_fd();
  c->set_gpu_uuid(Str(uuid));
  c->set_offset_bytes(offset);
  c->set_size_bytes(size);
  c->set_granularity_bytes(granularity);
  c->set_fd_token(fd_token);
  return r;
}

}  // namespace diond::client
