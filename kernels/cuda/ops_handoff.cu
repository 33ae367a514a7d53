// The handoff block of the CUDA plugin's ops table (docs/DATA_PLANE.md): device UUIDs,
// legacy CUDA IPC memory handles, VMM allocations imported from a POSIX fd, and interprocess
// events. The runtime API where it has the call; the VMM calls are driver API, reached through
// cudaGetDriverEntryPointByVersion (the non-deprecated form of cudaGetDriverEntryPoint) so that
// the plugin never links libcuda (TOOLCHAIN.md pitfall P4).
//
// Compile-checked only: no GPU has run this file (docs/DATA_PLANE.md "CUDA regions").
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda/ops_internal.h"

namespace diond::cuda {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == DIOND_CUDA_IPC_HANDLE_BYTES, "IPC memory handle");
static_assert(sizeof(cudaIpcEventHandle_t) == DIOND_CUDA_IPC_HANDLE_BYTES, "IPC event handle");
static_assert(sizeof(cudaUUID_t) == DIOND_GPU_UUID_BYTES, "UUID");

// The driver entry points of the VMM import, resolved once.
struct Driver {
  CUresult (*import)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*get_properties)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
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

const Driver& Drv() {
  static const Driver* d = [] {
    auto* r = new Driver;
    Resolve("cuMemImportFromShareableHandle", &r->import, &r->missing);
    Resolve("cuMemGetAllocationPropertiesFromHandle", &r->get_properties, &r->missing);
    Resolve("cuMemGetAllocationGranularity", &r->granularity, &r->missing);
    Resolve("cuMemAddressReserve", &r->reserve, &r->missing);
    Resolve("cuMemMap", &r->map, &r->missing);
    Resolve("cuMemSetAccess", &r->set_access, &r->missing);
    Resolve("cuMemUnmap", &r->unmap, &r->missing);
    Resolve("cuMemAddressFree", &r->address_free, &r->missing);
    Resolve("cuMemRelease", &r->release, &r->missing);
    Resolve("cuMemGetAddressRange", &r->address_range, &r->missing);
    Resolve("cuGetErrorName", &r->error_name, &r->missing);
    return r;
  }();
  return *d;
}

const char* DriverError(CUresult r) {
  const char* s = nullptr;
  if (Drv().error_name != nullptr) Drv().error_name(r, &s);
  return s != nullptr ? s : "CUDA driver error";
}

int NeedDriver(const DiondOpsCall* call, const char* op) {
  if (Drv().missing.empty()) return DIOND_OPS_OK;
  return Fail(call, DIOND_OPS_FAILED_PRECONDITION, "%s: the driver has no %s", op,
              Drv().missing.c_str());
}

}  // namespace

int OpDeviceUuids(const DiondOpsCall* call, uint8_t* uuids, int32_t capacity, int32_t* count) {
  int n = 0;
  DIOND_CU("device_uuids", cudaGetDeviceCount(&n));
  *count = n;
  for (int i = 0; i < n && i < capacity; ++i) {
    cudaDeviceProp prop;
    DIOND_CU("device_uuids", cudaGetDeviceProperties(&prop, i));
    std::memcpy(uuids + static_cast<size_t>(i) * DIOND_GPU_UUID_BYTES, prop.uuid.bytes,
                DIOND_GPU_UUID_BYTES);
  }
  return DIOND_OPS_OK;
}

int OpIpcOpenMemHandle(const DiondOpsCall* call, const uint8_t* handle, void** ptr,
                       uint64_t* bytes) {
  DIOND_RC(UseDevice(call, "ipc_open_mem_handle"));
  DIOND_RC(NeedDriver(call, "ipc_open_mem_handle"));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "ipc_open_mem_handle: cudaIpcOpenMemHandle on device %d failed: %s", call->device,
                cudaGetErrorString(e));
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = Drv().address_range(&base, &size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(p);
    return Fail(call, DIOND_OPS_INTERNAL, "ipc_open_mem_handle: cuMemGetAddressRange failed: %s",
                DriverError(r));
  }
  // The handle names an allocation's base; the size is what remains of it from there.
  *ptr = p;
  *bytes = static_cast<uint64_t>(size) - (reinterpret_cast<CUdeviceptr>(p) - base);
  return DIOND_OPS_OK;
}

int OpIpcCloseMemHandle(const DiondOpsCall* call, void* ptr) {
  DIOND_RC(UseDevice(call, "ipc_close_mem_handle"));
  DIOND_CU("ipc_close_mem_handle", cudaIpcCloseMemHandle(ptr));
  return DIOND_OPS_OK;
}

int OpVmmImportFd(const DiondOpsCall* call, int32_t fd, uint64_t bytes, uint64_t granularity,
                  void** ptr, void** handle) {
  DIOND_RC(UseDevice(call, "vmm_import_fd"));
  DIOND_RC(NeedDriver(call, "vmm_import_fd"));
  const Driver& d = Drv();
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d.import(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "vmm_import_fd: cuMemImportFromShareableHandle(fd %d) failed: %s", fd,
                DriverError(r));
  }
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  size_t minimum = 0;
  r = d.get_properties(&prop, h);
  if (r == CUDA_SUCCESS) r = d.granularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) {
    d.release(h);
    return Fail(call, DIOND_OPS_INTERNAL, "vmm_import_fd: the allocation's granularity: %s",
                DriverError(r));
  }
  if (minimum == 0 || granularity == 0 || granularity % minimum != 0 || bytes == 0 ||
      bytes % granularity != 0) {
    d.release(h);
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "vmm_import_fd: a mapping of %llu bytes at granularity %llu; the allocation's "
                "minimum granularity is %llu",
                static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(granularity),
                static_cast<unsigned long long>(minimum));
  }
  CUdeviceptr va = 0;
  r = d.reserve(&va, bytes, granularity, 0, 0);
  if (r != CUDA_SUCCESS) {
    d.release(h);
    return Fail(call, DIOND_OPS_RESOURCE_EXHAUSTED, "vmm_import_fd: cuMemAddressReserve: %s",
                DriverError(r));
  }
  r = d.map(va, bytes, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    d.address_free(va, bytes);
    d.release(h);
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "vmm_import_fd: cuMemMap of %llu bytes failed (larger than the allocation?): %s",
                static_cast<unsigned long long>(bytes), DriverError(r));
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = call->device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(va, bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.unmap(va, bytes);
    d.address_free(va, bytes);
    d.release(h);
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "vmm_import_fd: cuMemSetAccess for device %d failed: %s", call->device,
                DriverError(r));
  }
  *ptr = reinterpret_cast<void*>(va);
  *handle = reinterpret_cast<void*>(static_cast<uintptr_t>(h));
  return DIOND_OPS_OK;
}

int OpVmmUnmap(const DiondOpsCall* call, void* ptr, uint64_t bytes, void* handle) {
  DIOND_RC(UseDevice(call, "vmm_unmap"));
  DIOND_RC(NeedDriver(call, "vmm_unmap"));
  const Driver& d = Drv();
  const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(ptr);
  CUresult r = d.unmap(va, bytes);
  const CUresult r2 = d.address_free(va, bytes);
  const CUresult r3 =
      d.release(static_cast<CUmemGenericAllocationHandle>(reinterpret_cast<uintptr_t>(handle)));
  if (r == CUDA_SUCCESS) r = r2;
  if (r == CUDA_SUCCESS) r = r3;
  if (r != CUDA_SUCCESS) {
    return Fail(call, DIOND_OPS_INTERNAL, "vmm_unmap: %s", DriverError(r));
  }
  return DIOND_OPS_OK;
}

int OpIpcOpenEvent(const DiondOpsCall* call, const uint8_t* handle, void** event) {
  DIOND_RC(UseDevice(call, "ipc_open_event"));
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  cudaEvent_t e = nullptr;
  const cudaError_t rc = cudaIpcOpenEventHandle(&e, h);
  if (rc != cudaSuccess) {
    return Fail(call, DIOND_OPS_FAILED_PRECONDITION,
                "ipc_open_event: cudaIpcOpenEventHandle on device %d failed: %s", call->device,
                cudaGetErrorString(rc));
  }
  *event = e;
  return DIOND_OPS_OK;
}

int OpEventDestroy(const DiondOpsCall* call, void* event) {
  DIOND_RC(UseDevice(call, "event_destroy"));
  DIOND_CU("event_destroy", cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return DIOND_OPS_OK;
}

int OpStreamWaitEvent(const DiondOpsCall* call, void* event) {
  DIOND_RC(UseDevice(call, "stream_wait_event"));
  DIOND_CU("stream_wait_event",
           cudaStreamWaitEvent(StreamOf(call), static_cast<cudaEvent_t>(event), 0));
  return DIOND_OPS_OK;
}

int OpEventRecord(const DiondOpsCall* call, void* event) {
  DIOND_RC(UseDevice(call, "event_record"));
  DIOND_CU("event_record", cudaEventRecord(static_cast<cudaEvent_t>(event), StreamOf(call)));
  return DIOND_OPS_OK;
}

}  // namespace diond::cuda
