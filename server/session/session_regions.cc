// Registering and releasing the trainer's memory: the request checked against the session, the
// binding itself is the arenas' (arenas.h).
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/memory/memfd_region.h"
#include "server/session/session.h"
#include "server/session/session_device.h"

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
  DIOND_RETURN_IF_ERROR(arenas_.CheckBindable(role, name, offset, size));
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<memory::ShmRegion> region, open());
  // Remote-mode data already in a host arena, or weights held, move into the trainer's memory
  // now, so nothing the daemon holds is lost.
  DIOND_ASSIGN_OR_RETURN(std::string id, arenas_.BindMapped(role, std::move(region)));
  if (device_ != nullptr) device_->RegisterForDma(*this, role, arenas_.binding(role));
  return id;
}

absl::StatusOr<std::string> Session::OpenCudaRegion(
    Role role,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::CudaRegion>>(kernels::Device)> open) {
  if (device_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id_,
                     " steps on the host (the daemon computes on the CPU): CUDA regions "
                     "need a device session; register host memory (REGION_KIND_MEMFD or "
                     "REGION_KIND_SYSTEM_SHM)"));
  }
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<memory::CudaRegion> region, open(device_->device));
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
  const Arenas::Binding& b = arenas_.binding(role);
  if (b.any()) {
    return absl::FailedPreconditionError(absl::StrCat(
        RoleName(role), " already has ", b.region_id.empty() ? "a host arena" : b.region_id,
        b.region_id.empty() ? " (uploaded with SetState / PushGradients): its data has no place "
                              "on the GPU; close the session or create a new one"
                            : "; unregister it first"));
  }
  if (device_ == nullptr || region->device().type != device_->device.type ||
      region->device().index != device_->device.index) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id_, " cannot step on a ", region->Describe(), ": ",
        device_ != nullptr ? "it is not on the session's device"
                           : "the session steps on the host (CUDA regions need a device session)"));
  }
  return arenas_.BindCuda(role, std::move(region));
}

absl::Status Session::UnregisterRegion(const std::string& region_id) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(queue_.Refuse("UnregisterRegion"));
  // The doorbell page's events go with it.
  const bool page =
      arenas_.doorbells().region != nullptr && arenas_.doorbells().region_id == region_id;
  if (arenas_.Unbind(region_id)) {
    if (page && device_ != nullptr) device_->DestroyBucketEvents();
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("session ", id_, " has no region '", Bounded(region_id), "'"));
}

void Session::DetachTrainer() {
  // The previous trainer's queued asynchronous step finishes first (its outcome is dropped:
  // the new trainer learns the step index from AttachSession).
  DrainQueuedStep();
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  arenas_.DetachTrainer(id_);
  if (device_ != nullptr) device_->DestroyBucketEvents();  // with the previous trainer's page
}

}  // namespace diond::session
