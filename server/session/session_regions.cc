// A session's arenas: shm regions registered by the trainer (with ShmRegion's SIGBUS guard),
// daemon-owned host arenas in remote mode, the weights held between trainers, and the checks
// that every access to a trainer's memory is followed by.
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/memory/memfd_region.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace diond::session {

absl::StatusOr<std::string> Session::RegisterShmRegion(Role role, const std::string& name,
                                                       int64_t offset, int64_t size) {
  DIOND_RETURN_IF_ERROR(memory::ValidateShmName(name));
  return RegisterMappedRegion(role, name, offset, size,
                              [&] { return memory::ShmRegion::Open(name, offset, size, id_); });
}

absl::StatusOr<std::string> Session::RegisterMemfdRegion(Role role, fdchannel::UniqueFd fd,
                                                         int64_t offset, int64_t size) {
  if (absl::Status s = memory::CheckMemfd(fd.get()); !s.ok()) return s;
  const std::string name = memory::MemfdName(fd.get());
  return RegisterMappedRegion(role, name, offset, size, [&] {
    return memory::ShmRegion::Adopt(fd.release(), "memfd", name, offset, size, id_);
  });
}

absl::StatusOr<std::string> Session::RegisterMappedRegion(
    Role role, const std::string& name, int64_t offset, int64_t size,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::ShmRegion>>()> open) {
  const int64_t need =
      role == Role::kParameters ? layout_.param_arena_bytes : layout_.grad_arena_bytes;
  if (offset < 0 || offset % kArenaAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region offset ", offset, " must be a non-negative multiple of ", kArenaAlignment));
  }
  if (size < need) {
    return absl::InvalidArgumentError(absl::StrCat("region of ", size,
                                                   " bytes is smaller than the ", RoleName(role),
                                                   " arena (", need, " bytes)"));
  }
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse(absl::StrCat("RegisterRegion (", RoleName(role), ")")));
  Binding& b = binding(role);
  if (b.cuda != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(RoleName(role), " already has region ", b.region_id, "; unregister it first"));
  }
  if (b.region != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(RoleName(role), " already has region ", b.region_id, "; unregister it first"));
  }
  const Binding& other = binding(role == Role::kParameters ? Role::kGradients : Role::kParameters);
  if (other.region != nullptr && other.region->name() == name) {
    int64_t a0 = offset, a1 = offset + size;
    int64_t b0 = other.region->offset(), b1 = b0 + other.region->size();
    if (a0 < b1 && b0 < a1) {
      return absl::InvalidArgumentError(
          absl::StrCat("region [", a0, ", ", a1, ") of '", Bounded(name), "' overlaps the ",
                       RoleName(role == Role::kParameters ? Role::kGradients : Role::kParameters),
                       " region [", b0, ", ", b1, ")"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<memory::ShmRegion> region, open());
  // Remote-mode data already in a host arena, or parameters restored from a checkpoint, move
  // into the trainer's memory now, so nothing the daemon holds is lost. The daemon's copies are
  // dropped only once the trainer's memory took them intact (the segment may shrink meanwhile).
  const bool from_pending = role == Role::kParameters && !pending_params_.empty();
  if (from_pending) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const TensorPlacement& t = layout_.tensors[i];
      RunOnCompute(compute_, [&] {
        internal::NarrowFromF32(HostContext(), t.dtype, pending_params_[i].data(), t.numel,
                                region->data() + t.param_offset);
      });
    }
  } else if (!b.host.empty()) {
    std::memcpy(region->data(), b.host.data(), static_cast<size_t>(need));
  }
  if (absl::Status intact = region->CheckIntact(); !intact.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(RoleName(role), " ", intact.message(), "; nothing was registered"));
  }
  if (from_pending) {
    if (absl::Status s = AdoptHeldWeightsAsMaster(); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(RoleName(role), ": restoring the master weights failed: ",
                                       s.message(), "; nothing was registered"));
    }
  }
  b.host.clear();
  b.host.shrink_to_fit();
  b.region = std::move(region);
  b.data = b.region->data();
  b.region_id = absl::StrCat(role == Role::kParameters ? "params-" : "grads-", next_region_++);
  RegisterForDma(role, b);
  return b.region_id;
}

absl::StatusOr<std::string> Session::OpenCudaRegion(
    Role role,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::CudaRegion>>(kernels::Device)> open) {
  std::optional<kernels::Device> device = DeviceOfSession();
  if (!device.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id_,
                     " steps on the host (the daemon computes on the CPU): CUDA regions "
                     "need a device session; register host memory (REGION_KIND_MEMFD or "
                     "REGION_KIND_SYSTEM_SHM)"));
  }
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<memory::CudaRegion> region, open(*device));
  return RegisterCudaRegion(role, std::move(region));
}

absl::StatusOr<std::string> Session::RegisterCudaRegion(
    Role role, std::unique_ptr<memory::CudaRegion> region) {
  const int64_t need =
      role == Role::kParameters ? layout_.param_arena_bytes : layout_.grad_arena_bytes;
  if (region->size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(region->Describe(), " is smaller than the ",
                                                   RoleName(role), " arena (", need, " bytes)"));
  }
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse(absl::StrCat("RegisterRegion (", RoleName(role), ")")));
  Binding& b = binding(role);
  if (b.any()) {
    return absl::FailedPreconditionError(absl::StrCat(
        RoleName(role), " already has ", b.region_id.empty() ? "a host arena" : b.region_id,
        b.region_id.empty() ? " (uploaded with SetState / PushGradients): its data has no place "
                              "on the GPU; close the session or create a new one"
                            : "; unregister it first"));
  }
  const std::optional<kernels::Device> device = DeviceOfSession();
  if (!device.has_value() || region->device().type != device->type ||
      region->device().index != device->index) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id_, " cannot step on a ", region->Describe(), ": ",
        device.has_value() ? "it is not on the session's device"
                           : "the session steps on the host (CUDA regions need a device session)"));
  }
  const bool from_pending = role == Role::kParameters && !pending_params_.empty();
  b.cuda = std::move(region);
  b.region_id = absl::StrCat(role == Role::kParameters ? "params-" : "grads-", next_region_++);
  if (from_pending) {
    // Weights restored from a checkpoint (or kept from the previous trainer) go into the
    // trainer's GPU memory now, as they would into a shm region.
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      if (absl::Status s = WriteParamF32(i, pending_params_[i].data()); !s.ok()) {
        ClearBinding(b);
        return absl::Status(s.code(), absl::StrCat(RoleName(role),
                                                   ": writing the held weights "
                                                   "into the region failed: ",
                                                   s.message(), "; nothing was registered"));
      }
    }
    if (absl::Status s = AdoptHeldWeightsAsMaster(); !s.ok()) {
      ClearBinding(b);
      return absl::Status(s.code(),
                          absl::StrCat(RoleName(role), ": restoring the master weights failed: ",
                                       s.message(), "; nothing was registered"));
    }
  }
  return b.region_id;
}

absl::Status Session::UnregisterRegion(const std::string& region_id) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("UnregisterRegion"));
  for (Role r : {Role::kParameters, Role::kGradients}) {
    Binding& b = binding(r);
    if ((b.region != nullptr || b.cuda != nullptr) && b.region_id == region_id) {
      ClearBinding(b);
      if (r == Role::kParameters) master_valid_ = false;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("session ", id_, " has no region '", Bounded(region_id), "'"));
}

absl::Status Session::EnsureHostArena(Role r) {
  Binding& b = binding(r);
  if (b.cuda != nullptr) {
    // No host path touches device memory: the trainer reads and writes its CUDA arena itself.
    return absl::FailedPreconditionError(absl::StrCat(
        "the ", RoleName(r), " arena is a ", b.cuda->Describe(),
        ": the trainer reads and writes it on its GPU; the streamed path (PushGradients, "
        "PullParameters, SetState of the parameters) is for host arenas"));
  }
  if (b.bound()) return absl::OkStatus();
  const int64_t bytes =
      r == Role::kParameters ? layout_.param_arena_bytes : layout_.grad_arena_bytes;
  b.host.assign(static_cast<size_t>(bytes), 0);
  b.data = b.host.data();
  if (r == Role::kParameters && !pending_params_.empty()) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const TensorPlacement& t = layout_.tensors[i];
      RunOnCompute(compute_, [&] {
        internal::NarrowFromF32(HostContext(), t.dtype, pending_params_[i].data(), t.numel,
                                b.data + t.param_offset);
      });
    }
    if (absl::Status s = AdoptHeldWeightsAsMaster(); !s.ok()) {
      b.host.clear();  // nothing is bound
      b.data = nullptr;
      return absl::Status(s.code(),
                          absl::StrCat("restoring the master weights failed: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::AdoptHeldWeightsAsMaster() {
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (HasMaster(i)) DIOND_RETURN_IF_ERROR(WriteMaster(i, pending_params_[i].data()));
  }
  master_valid_ = !has_master_.empty();
  pending_params_.clear();
  return absl::OkStatus();
}

absl::Status Session::ReadParamF32(size_t i, float* out) {
  const TensorPlacement& t = layout_.tensors[i];
  if (HasMaster(i) && master_valid_) return ReadMaster(i, out);
  if (!pending_params_.empty()) {
    std::memcpy(out, pending_params_[i].data(), static_cast<size_t>(t.numel) * 4);
    return absl::OkStatus();
  }
  if (params_.cuda != nullptr) {
    std::vector<uint8_t> bytes;
    DIOND_RETURN_IF_ERROR(CudaParamToHost(i, &bytes));
    RunOnCompute(compute_,
                 [&] { internal::WidenToF32(HostContext(), t.dtype, bytes.data(), t.numel, out); });
    return absl::OkStatus();
  }
  RunOnCompute(compute_, [&] {
    internal::WidenToF32(HostContext(), t.dtype, params_.data + t.param_offset, t.numel, out);
  });
  return absl::OkStatus();
}

absl::Status Session::WriteParamF32(size_t i, const float* in) {
  const TensorPlacement& t = layout_.tensors[i];
  if (params_.cuda != nullptr) {
    std::vector<uint8_t> bytes(static_cast<size_t>(t.size_bytes));
    RunOnCompute(compute_, [&] {
      internal::NarrowFromF32(HostContext(), t.dtype, in, t.numel, bytes.data());
    });
    DIOND_RETURN_IF_ERROR(CudaParamFromHost(i, bytes));
  } else {
    RunOnCompute(compute_, [&] {
      internal::NarrowFromF32(HostContext(), t.dtype, in, t.numel, params_.data + t.param_offset);
    });
  }
  if (HasMaster(i)) DIOND_RETURN_IF_ERROR(WriteMaster(i, in));
  return absl::OkStatus();
}

absl::Status Session::CheckRegions(const std::string& when, std::optional<Role> only) {
  for (Role r : {Role::kParameters, Role::kGradients}) {
    if (only.has_value() && *only != r) continue;
    const Binding& b = binding(r);
    if (b.region == nullptr) continue;
    if (absl::Status s = b.region->CheckIntact(); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(when, ": the ", RoleName(r), " ", s.message(), "; nothing was changed"));
    }
  }
  return absl::OkStatus();
}

void Session::DetachTrainer() {
  // The previous trainer's queued asynchronous step finishes first (its outcome is dropped:
  // the new trainer learns the step index from AttachSession).
  DrainQueuedStep();
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  if (params_.region != nullptr || params_.cuda != nullptr) {
    // The weights the daemon holds now (master weights where kept) wait for the new trainer's
    // PARAMETERS region (a CUDA region's read back through the device session's copies).
    std::vector<std::vector<float>> keep(layout_.tensors.size());
    absl::Status read;
    for (size_t i = 0; i < layout_.tensors.size() && read.ok(); ++i) {
      keep[i].resize(static_cast<size_t>(layout_.tensors[i].numel));
      read = ReadParamF32(i, keep[i].data());
    }
    ClearBinding(params_);
    if (read.ok()) {
      pending_params_ = std::move(keep);
    } else {
      DIOND_LOG(WARNING) << "session " << id_ << ": the previous trainer's weights could not be "
                         << "read back (" << read.message() << "); the new trainer restores "
                         << "them (SetState or a checkpoint)";
    }
  }
  if (grads_.region != nullptr || grads_.cuda != nullptr) ClearBinding(grads_);
}

}  // namespace diond::session
