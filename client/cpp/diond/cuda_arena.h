// CUDA arenas of one session (docs/DATA_PLANE.md "CUDA regions"): both arenas in one device
// allocation of the trainer's GPU, exported to the daemon as a legacy IPC handle (cudaMalloc +
// cudaIpcGetMemHandle; REGION_KIND_CUDA_IPC) or as a VMM allocation's POSIX fd (cuMemCreate +
// cuMemExportToShareableHandle, sent over the fd channel; REGION_KIND_CUDA_VMM_FD). The layout of
// the allocation is PlanCudaArena's (cuda_region_request.h).
//
// Built only where the CUDA toolkit is found (target diond::client_cuda). It links the CUDA runtime
// only; the VMM calls are the driver's, reached through cudaGetDriverEntryPointByVersion. It has
// never run on a GPU: none was available where it was written (its GPU test is
// client/cpp/tests/cuda_arena_test.cc, label gpu, run by scripts/gpu-check.sh). A daemon on a GPU
// (--device=cuda:N) maps both kinds into its device sessions; a CPU daemon answers
// FAILED_PRECONDITION (docs/DATA_PLANE.md).
//
// Lifetime: RAII and move-only. Destruction (or Reset) unregisters the regions (best effort) and
// frees the allocation (and closes the exported fd). The Client must outlive the arena.
#ifndef DIOND_CLIENT_CPP_DIOND_CUDA_ARENA_H_
#define DIOND_CLIENT_CPP_DIOND_CUDA_ARENA_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "diond/client.h"
#include "diond/cuda_region_request.h"
#include "diond/types.h"

namespace diond::client {

class CudaArena {
 public:
  enum class Export { kLegacyIpc, kVmmFd };
  // Allocates on `device`, exports and registers both arenas. On any error nothing is left.
  static absl::StatusOr<CudaArena> Create(const Client* client, const Layout& layout, int device,
                                          Export kind);
  CudaArena(CudaArena&& other) noexcept;
  CudaArena& operator=(CudaArena&& other) noexcept;
  CudaArena(const CudaArena&) = delete;
  CudaArena& operator=(const CudaArena&) = delete;
  ~CudaArena();
  void Reset();

  // Device pointers of a tensor's values / gradient (NOT_FOUND for an unknown name).
  absl::StatusOr<void*> Param(absl::string_view name) const;
  absl::StatusOr<void*> Grad(absl::string_view name) const;
  void* base() const { return base_; }
  const CudaArenaPlan& plan() const { return plan_; }
  Export kind() const { return kind_; }
  const std::string& param_region_id() const { return param_region_id_; }
  const std::string& grad_region_id() const { return grad_region_id_; }

 private:
  CudaArena() = default;
  absl::Status Allocate();
  absl::Status Register(const Client* client);
  void MoveFrom(CudaArena& o);

  const Client* client_ = nullptr;
  Layout layout_;
  CudaArenaPlan plan_;
  Export kind_ = Export::kLegacyIpc;
  int device_ = 0;
  void* base_ = nullptr;
  unsigned long long vmm_handle_ = 0;  // CUmemGenericAllocationHandle
  int fd_ = -1;                        // the VMM export
  int64_t granularity_ = 1;
  std::string param_region_id_, grad_region_id_;
};

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_CUDA_ARENA_H_
