// CudaArena (cuda_arena.h). Runtime API for the legacy path, driver API for VMM.
#include "diond/cuda_arena.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "diond/memfd_arena.h"

namespace diond::client {
namespace {

// The VMM calls are driver API. They are reached through the runtime's
// cudaGetDriverEntryPointByVersion rather than by linking libcuda, so that a program linking
// this library starts on a machine without a driver (where the runtime then reports "no device"
// as an error status instead of the loader refusing the program), as the daemon's CUDA plugin
// does.
struct Driver {
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;  // NOLINT(runtime/int): the driver's type
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                      unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*export_fd)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                        unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
  std::string missing;  // the first entry point not found; empty = all found
};

template <typename F>
void Resolve(const char* name, F* fn, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    if (missing->empty()) *missing = name;
    return;
  }
  *fn = reinterpret_cast<F>(p);
}

// Resolved once, after the runtime has initialized the device (cudaSetDevice).
const Driver& Drv() {
  static const Driver* d = [] {
    auto* r = new Driver;
    Resolve("cuMemGetAllocationGranularity", &r->granularity, &r->missing);
    Resolve("cuMemCreate", &r->create, &r->missing);
    Resolve("cuMemAddressReserve", &r->reserve, &r->missing);
    Resolve("cuMemMap", &r->map, &r->missing);
    Resolve("cuMemSetAccess", &r->set_access, &r->missing);
    Resolve("cuMemExportToShareableHandle", &r->export_fd, &r->missing);
    Resolve("cuMemUnmap", &r->unmap, &r->missing);
    Resolve("cuMemAddressFree", &r->address_free, &r->missing);
    Resolve("cuMemRelease", &r->release, &r->missing);
    Resolve("cuGetErrorName", &r->error_name, &r->missing);
    return r;
  }();
  return *d;
}

absl::Status Rt(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}
absl::Status Drv(const char* what, CUresult r) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  if (Drv().error_name != nullptr) Drv().error_name(r, &name);
  return absl::InternalError(absl::StrCat(what, ": ", name != nullptr ? name : "CUDA error"));
}

}  // namespace

absl::StatusOr<CudaArena> CudaArena::Create(const Client* client, const Layout& layout, int device,
                                            Export kind) {
  CudaArena a;
  a.client_ = client;
  a.layout_ = layout;
  a.device_ = device;
  a.kind_ = kind;
  if (absl::Status s = a.Allocate(); !s.ok()) return s;
  if (absl::Status s = a.Register(client); !s.ok()) return s;  // `a` frees itself
  return a;
}

absl::Status CudaArena::Allocate() {
  if (absl::Status s = Rt("cudaSetDevice", cudaSetDevice(device_)); !s.ok()) return s;
  if (kind_ == Export::kLegacyIpc) {
    auto plan = PlanCudaArena(layout_, 1);
    if (!plan.ok()) return plan.status();
    plan_ = *plan;
    return Rt("cudaMalloc", cudaMalloc(&base_, static_cast<size_t>(plan_.bytes)));
  }
  const Driver& drv = Drv();
  if (!drv.missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a VMM arena needs the CUDA driver's ", drv.missing, ", which this driver does not have"));
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  if (absl::Status s = Drv("cuMemGetAllocationGranularity",
                           drv.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
      !s.ok()) {
    return s;
  }
  granularity_ = static_cast<int64_t>(g);
  auto plan = PlanCudaArena(layout_, granularity_);
  if (!plan.ok()) return plan.status();
  plan_ = *plan;
  CUmemGenericAllocationHandle h = 0;
  if (absl::Status s =
          Drv("cuMemCreate", drv.create(&h, static_cast<size_t>(plan_.bytes), &prop, 0));
      !s.ok()) {
    return s;
  }
  vmm_handle_ = h;
  CUdeviceptr va = 0;
  if (absl::Status s =
          Drv("cuMemAddressReserve", drv.reserve(&va, static_cast<size_t>(plan_.bytes), g, 0, 0));
      !s.ok()) {
    return s;
  }
  // The driver API names device addresses as integers; this is where they become pointers.
  base_ = reinterpret_cast<void*>(va);  // NOLINT(performance-no-int-to-ptr)
  if (absl::Status s = Drv("cuMemMap", drv.map(va, static_cast<size_t>(plan_.bytes), 0, h, 0));
      !s.ok()) {
    drv.address_free(va, static_cast<size_t>(plan_.bytes));
    base_ = nullptr;
    return s;
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (absl::Status s =
          Drv("cuMemSetAccess", drv.set_access(va, static_cast<size_t>(plan_.bytes), &access, 1));
      !s.ok()) {
    return s;
  }
  int fd = -1;
  if (absl::Status s = Drv("cuMemExportToShareableHandle",
                           drv.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
      !s.ok()) {
    return s;
  }
  fd_ = fd;
  return absl::OkStatus();
}

absl::Status CudaArena::Register(const Client* client) {
  cudaDeviceProp prop;
  if (absl::Status s = Rt("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, device_));
      !s.ok()) {
    return s;
  }
  const absl::Span<const uint8_t> uuid(reinterpret_cast<const uint8_t*>(prop.uuid.bytes), 16);
  cudaIpcMemHandle_t ipc{};
  if (kind_ == Export::kLegacyIpc) {
    if (absl::Status s = Rt("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&ipc, base_)); !s.ok()) {
      return s;
    }
  }
  for (v1::RegionRole role : {v1::REGION_ROLE_PARAMETERS, v1::REGION_ROLE_GRADIENTS}) {
    const bool params = role == v1::REGION_ROLE_PARAMETERS;
    const int64_t offset = params ? plan_.param_offset : plan_.grad_offset;
    const int64_t size = params ? layout_.param_arena_bytes : layout_.grad_arena_bytes;
    absl::StatusOr<v1::RegisterRegionRequest> req;
    if (kind_ == Export::kLegacyIpc) {
      req = CudaIpcRegionRequest(
          layout_.session_id, role,
          absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(ipc.reserved), 64), uuid,
          offset, size);
    } else {
      // One token per region: the channel's tokens are single-use.
      auto token = SendFdToChannel(layout_.fd_channel_socket, fd_, kFdKindCudaVmm);
      if (!token.ok()) return token.status();
      req =
          CudaVmmRegionRequest(layout_.session_id, role, *token, uuid, offset, size, granularity_);
    }
    if (!req.ok()) return req.status();
    auto resp = client->RegisterRegion(*req);
    if (!resp.ok()) return resp.status();
    (params ? param_region_id_ : grad_region_id_) = resp->region_id();
  }
  return absl::OkStatus();
}

void CudaArena::Reset() {
  if (client_ != nullptr) {
    for (std::string* id : {&param_region_id_, &grad_region_id_}) {
      if (!id->empty()) client_->UnregisterRegion(layout_.session_id, *id).IgnoreError();
      id->clear();
    }
  }
  if (base_ != nullptr) {
    if (kind_ == Export::kLegacyIpc) {
      cudaFree(base_);
    } else {
      const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(base_);
      Drv().unmap(va, static_cast<size_t>(plan_.bytes));
      Drv().address_free(va, static_cast<size_t>(plan_.bytes));
    }
    base_ = nullptr;
  }
  if (vmm_handle_ != 0) {
    Drv().release(static_cast<CUmemGenericAllocationHandle>(vmm_handle_));
    vmm_handle_ = 0;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

void CudaArena::MoveFrom(CudaArena& o) {
  client_ = o.client_;
  layout_ = std::move(o.layout_);
  plan_ = o.plan_;
  kind_ = o.kind_;
  device_ = o.device_;
  base_ = std::exchange(o.base_, nullptr);
  vmm_handle_ = std::exchange(o.vmm_handle_, 0);
  fd_ = std::exchange(o.fd_, -1);
  granularity_ = o.granularity_;
  param_region_id_ = std::move(o.param_region_id_);
  grad_region_id_ = std::move(o.grad_region_id_);
  o.param_region_id_.clear();
  o.grad_region_id_.clear();
}

CudaArena::CudaArena(CudaArena&& other) noexcept { MoveFrom(other); }
CudaArena& CudaArena::operator=(CudaArena&& other) noexcept {
  if (this != &other) {
    Reset();
    MoveFrom(other);
  }
  return *this;
}
CudaArena::~CudaArena() { Reset(); }

absl::StatusOr<void*> CudaArena::Param(absl::string_view name) const {
  const TensorLayout* t = layout_.Find(name);
  if (t == nullptr || base_ == nullptr) {
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in this arena"));
  }
  return static_cast<uint8_t*>(base_) + plan_.param_offset + t->param_offset_bytes;
}

absl::StatusOr<void*> CudaArena::Grad(absl::string_view name) const {
  const TensorLayout* t = layout_.Find(name);
  if (t == nullptr || base_ == nullptr) {
    return absl::NotFoundError(absl::StrCat("no tensor '", name, "' in this arena"));
  }
  return static_cast<uint8_t*>(base_) + plan_.grad_offset + t->grad_offset_bytes;
}

}  // namespace diond::client
