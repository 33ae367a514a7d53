// The trainer's arenas of one session and their master weights (docs/ARCHITECTURE.md §2).
//
// Each role (PARAMETERS, GRADIENTS) is bound to a registered shm / memfd region (Step computes on
// it in place), to trainer GPU memory (a device session's CUDA region, never dereferenced on the
// host), or in remote mode to a host buffer made on first use. Weights with no PARAMETERS arena
// to live in (restored, or kept from a previous trainer) are held as fp32 until one is bound.
// Master weights (fp32, for non-f32 parameters) are host vectors, or one device buffer.
//
// A region shrunk by its trainer makes every access harmless (ShmRegion's SIGBUS guard);
// CheckRegions turns that into FAILED_PRECONDITION after each pass over it.
//
// Not thread-safe: its session holds it under the session's mutex.
#ifndef DIOND_SERVER_SESSION_ARENAS_H_
#define DIOND_SERVER_SESSION_ARENAS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/context.h"
#include "server/memory/cuda_region.h"
#include "server/memory/doorbell.h"
#include "server/memory/shm_region.h"
#include "server/session/compute_thread.h"
#include "server/session/types.h"

namespace diond::session {

enum class Role { kParameters, kGradients };
absl::string_view RoleName(Role r);

class Arenas {
 public:
  struct Binding {
    std::unique_ptr<memory::ShmRegion> region;
    // Trainer GPU memory; `data` stays null: no host path may read it.
    std::unique_ptr<memory::CudaRegion> cuda;
    std::vector<uint8_t> host;  // remote mode
    uint8_t* data = nullptr;
    std::string region_id;
    // A device session's host registration of the region for DMA; its deleter unregisters, so
    // it is reset before the region is unmapped (Clear).
    std::shared_ptr<void> dma;
    // Host-addressable memory (a shm / memfd region or a host arena) is bound.
    bool bound() const { return data != nullptr; }
    // Any memory is bound (host, or a CUDA region).
    bool any() const { return data != nullptr || cuda != nullptr; }
    void Clear() {
      dma.reset();
      *this = Binding();
    }
  };

  // `layout` outlives the arenas; `compute` runs their conversions (null: the calling thread);
  // `host_threads`: the threads of their CPU context (0: the default).
  void Init(const Layout* layout, ComputeThread* compute, int host_threads);
  // A device session's context: CUDA regions and master weights are copied through it.
  void SetDeviceContext(const kernels::Context* dctx) { device_ctx_ = dctx; }
  // A CPU context for the conversions (made at the first call), and for a step's host passes.
  const kernels::Context& HostContext();

  Binding& binding(Role r) { return r == Role::kParameters ? params_ : grads_; }
  const Binding& binding(Role r) const { return r == Role::kParameters ? params_ : grads_; }
  Binding& params() { return params_; }
  Binding& grads() { return grads_; }
  const Binding& params() const { return params_; }
  const Binding& grads() const { return grads_; }
  // An overlapped step's doorbell page (docs/DATA_PLANE.md "Overlapped step") and its buckets
  // (parameter indices, each in exactly one); `bells` is set while `region` is.
  struct DoorbellPage {
    std::unique_ptr<memory::ShmRegion> region;
    std::optional<memory::Doorbells> bells;
    std::vector<std::vector<size_t>> buckets;
    std::string region_id;
  };
  const DoorbellPage& doorbells() const { return doorbells_; }
  // Binds a doorbell page attached by the caller (replacing none: FAILED_PRECONDITION when one is
  // bound). Returns its id.
  absl::StatusOr<std::string> BindDoorbells(std::unique_ptr<memory::ShmRegion> region,
                                            memory::Doorbells bells,
                                            std::vector<std::vector<size_t>> buckets);

  // Weights are held: a PARAMETERS binding, or weights waiting for one.
  bool HoldsParameters() const { return params_.any() || !held_.empty(); }
  bool holding() const { return !held_.empty(); }

  // ---- binding and releasing trainer memory ----
  // INVALID_ARGUMENT when [offset, offset + size) of segment `name` overlaps the other role's
  // region; FAILED_PRECONDITION when `role` is bound to a region already.
  absl::Status CheckBindable(Role role, const std::string& name, int64_t offset,
                             int64_t size) const;
  // Binds a mapped region. Data the daemon holds for the role (a host arena, held weights)
  // moves into it first and is dropped only once the region took it intact. Returns its id.
  absl::StatusOr<std::string> BindMapped(Role role, std::unique_ptr<memory::ShmRegion> region);
  // Binds trainer GPU memory (the caller checked the role is free and the device matches);
  // held weights are written into it. Returns its id.
  absl::StatusOr<std::string> BindCuda(Role role, std::unique_ptr<memory::CudaRegion> region);
  // False when no region has that id.
  bool Unbind(const std::string& region_id);
  // A new trainer takes over: its predecessor's regions are dropped and the current weights held
  // for the next PARAMETERS binding. Host arenas stay.
  void DetachTrainer(const std::string& session_id);
  // The daemon's own arena for `r` (remote mode), made if missing; FAILED_PRECONDITION for a
  // CUDA binding. Held weights move into a new PARAMETERS arena.
  absl::Status EnsureHostArena(Role r);
  // FAILED_PRECONDITION "<when>: the <ROLE> shm region ... shrank ...; nothing was changed" when
  // a bound region (of role `only`, or of either) is shorter than mapped or faulted.
  absl::Status CheckRegions(const std::string& when, std::optional<Role> only = std::nullopt) const;
  // Weights from a checkpoint: held, and written into the PARAMETERS binding at once if there is
  // one (the status of the first failed write; the weights then stay held).
  absl::Status Hold(std::vector<std::vector<float>> weights);
  std::vector<float>& held(size_t i) { return held_[i]; }

  // ---- parameters as fp32 ----
  // Parameter i as fp32: master weights, held weights, or widened from the arena.
  absl::Status ReadParamF32(size_t i, float* out);
  // Parameter i narrowed into the arena (a CUDA region through explicit copies), and its master
  // weights.
  absl::Status WriteParamF32(size_t i, const float* in);
  // A CUDA PARAMETERS region: parameter i's trainer-dtype bytes, copied out / in.
  absl::Status CudaParamToHost(size_t i, std::vector<uint8_t>* bytes) const;
  absl::Status CudaParamFromHost(size_t i, const std::vector<uint8_t>& bytes);

  // ---- master weights ----
  // fp32 master weights for every non-f32 parameter of `params`; returns their bytes.
  int64_t InitMaster(const std::vector<ParamSpec>& params);
  // A device session: the master weights move into one device buffer of `dctx` (set by
  // SetDeviceContext); RESOURCE_EXHAUSTED with `pool_error`'s numbers when they do not fit.
  absl::Status MoveMasterToDevice(absl::FunctionRef<std::string()> pool_error);
  bool HasMaster(size_t i) const { return i < has_master_.size() && has_master_[i] != 0; }
  // The master weights hold the current weights (not before the first step or binding).
  bool master_valid() const { return master_valid_; }
  // A step committed: the updated copies became the master weights.
  void MasterCommitted() { master_valid_ = !has_master_.empty(); }
  absl::Status ReadMaster(size_t i, float* out) const;
  absl::Status WriteMaster(size_t i, const float* in);
  // A host session's master weights of parameter i; a device session's, on its device.
  const std::vector<float>& host_master(size_t i) const { return master_[i]; }
  float* DeviceMaster(size_t i) const;
  // A host session's commit: the step's updated copy (param_scratch) becomes the master weights.
  void SwapInHostMaster(size_t i) { master_[i].swap(param_scratch_[i]); }

  // Step's fp32 buffers for what cannot be used in place (other dtypes, scaled gradients, the
  // next master weights), kept between steps: fresh ones cost more in page faults than the
  // conversions themselves.
  std::vector<std::vector<float>>& grad_scratch() { return grad_scratch_; }
  std::vector<std::vector<float>>& param_scratch() { return param_scratch_; }
  // The daemon-owned host arenas and the step's fp32 buffers.
  int64_t HostBytes() const;

 private:
  // The held weights become the master weights (the new arena holds them too) and are released.
  // On error the weights stay held for the next attempt.
  absl::Status AdoptHeldWeightsAsMaster();
  std::string NextRegionId(Role r);

  const Layout* layout_ = nullptr;
  ComputeThread* compute_ = nullptr;
  int host_threads_ = 0;
  std::unique_ptr<kernels::Context> host_ctx_;
  const kernels::Context* device_ctx_ = nullptr;
  Binding params_;
  Binding grads_;
  DoorbellPage doorbells_;
  int64_t next_region_ = 1;
  // Host vectors, or (device_master_) the device buffer `device_master_buf_`, offsets per
  // parameter (-1: none).
  std::vector<std::vector<float>> master_;
  std::vector<char> has_master_;
  bool device_master_ = false;
  kernels::Buffer device_master_buf_;
  std::vector<int64_t> device_master_offset_;
  bool master_valid_ = false;
  std::vector<std::vector<float>> grad_scratch_;
  std::vector<std::vector<float>> param_scratch_;
  std::vector<std::vector<float>> held_;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_ARENAS_H_
