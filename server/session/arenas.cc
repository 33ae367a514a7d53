#include "server/session/arenas.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/session_internal.h"

namespace diond::session {

absl::string_view RoleName(Role r) { return r == Role::kParameters ? "PARAMETERS" : "GRADIENTS"; }

void Arenas::Init(const Layout* layout, ComputeThread* compute, int host_threads) {
  layout_ = layout;
  compute_ = compute;
  host_threads_ = host_threads;
}

const kernels::Context& Arenas::HostContext() {
  if (host_ctx_ == nullptr) host_ctx_ = kernels::Context::CpuDefault(host_threads_);
  return *host_ctx_;
}

std::string Arenas::NextRegionId(Role r) {
  return absl::StrCat(r == Role::kParameters ? "params-" : "grads-", next_region_++);
}

absl::Status Arenas::CheckBindable(Role role, const std::string& name, int64_t offset,
                                   int64_t size) const {
  const Binding& b = binding(role);
  if (b.cuda != nullptr || b.region != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(RoleName(role), " already has region ", b.region_id, "; unregister it first"));
  }
  const Role other_role = role == Role::kParameters ? Role::kGradients : Role::kParameters;
  const Binding& other = binding(other_role);
  if (other.region != nullptr && other.region->name() == name) {
    int64_t a0 = offset, a1 = offset + size;
    int64_t b0 = other.region->offset(), b1 = b0 + other.region->size();
    if (a0 < b1 && b0 < a1) {
      return absl::InvalidArgumentError(
          absl::StrCat("region [", a0, ", ", a1, ") of '", Bounded(name), "' overlaps the ",
                       RoleName(other_role), " region [", b0, ", ", b1, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Arenas::BindMapped(Role role,
                                               std::unique_ptr<memory::ShmRegion> region) {
  Binding& b = binding(role);
  const int64_t need =
      role == Role::kParameters ? layout_->param_arena_bytes : layout_->grad_arena_bytes;
  // The daemon's copies are dropped only once the trainer's memory took them intact (the segment
  // may shrink meanwhile).
  const bool from_held = role == Role::kParameters && !held_.empty();
  if (from_held) {
    for (size_t i = 0; i < layout_->tensors.size(); ++i) {
      const TensorPlacement& t = layout_->tensors[i];
      RunOnCompute(compute_, [&] {
        internal::NarrowFromF32(HostContext(), t.dtype, held_[i].data(), t.numel,
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
  if (from_held) {
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
  b.region_id = NextRegionId(role);
  return b.region_id;
}

absl::StatusOr<std::string> Arenas::BindCuda(Role role,
                                             std::unique_ptr<memory::CudaRegion> region) {
  Binding& b = binding(role);
  const bool from_held = role == Role::kParameters && !held_.empty();
  b.cuda = std::move(region);
  b.region_id = NextRegionId(role);
  if (from_held) {
    // Held weights go into the trainer's GPU memory now, as they would into a shm region.
    for (size_t i = 0; i < layout_->tensors.size(); ++i) {
      if (absl::Status s = WriteParamF32(i, held_[i].data()); !s.ok()) {
        b.Clear();
        return absl::Status(s.code(), absl::StrCat(RoleName(role),
                                                   ": writing the held weights "
                                                   "into the region failed: ",
                                                   s.message(), "; nothing was registered"));
      }
    }
    if (absl::Status s = AdoptHeldWeightsAsMaster(); !s.ok()) {
      b.Clear();
      return absl::Status(s.code(),
                          absl::StrCat(RoleName(role), ": restoring the master weights failed: ",
                                       s.message(), "; nothing was registered"));
    }
  }
  return b.region_id;
}

absl::StatusOr<std::string> Arenas::BindDoorbells(std::unique_ptr<memory::ShmRegion> region,
                                                  memory::Doorbells bells,
                                                  std::vector<std::vector<size_t>> buckets) {
  if (doorbells_.region != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "DOORBELLS already has region ", doorbells_.region_id, "; unregister it first"));
  }
  doorbells_.region = std::move(region);
  doorbells_.bells = bells;
  doorbells_.buckets = std::move(buckets);
  doorbells_.region_id = absl::StrCat("doorbells-", next_region_++);
  return doorbells_.region_id;
}

bool Arenas::Unbind(const std::string& region_id) {
  if (doorbells_.region != nullptr && doorbells_.region_id == region_id) {
    doorbells_ = DoorbellPage();
    return true;
  }
  for (Role r : {Role::kParameters, Role::kGradients}) {
    Binding& b = binding(r);
    if ((b.region != nullptr || b.cuda != nullptr) && b.region_id == region_id) {
      b.Clear();
      if (r == Role::kParameters) master_valid_ = false;
      return true;
    }
  }
  return false;
}

void Arenas::DetachTrainer(const std::string& session_id) {
  if (params_.region != nullptr || params_.cuda != nullptr) {
    // The weights the daemon holds now (master weights where kept) wait for the new trainer's
    // PARAMETERS region (a CUDA region's read back through the device session's copies).
    std::vector<std::vector<float>> keep(layout_->tensors.size());
    absl::Status read;
    for (size_t i = 0; i < layout_->tensors.size() && read.ok(); ++i) {
      keep[i].resize(static_cast<size_t>(layout_->tensors[i].numel));
      read = ReadParamF32(i, keep[i].data());
    }
    params_.Clear();
    if (read.ok()) {
      held_ = std::move(keep);
    } else {
      DIOND_LOG(WARNING) << "session " << session_id
                         << ": the previous trainer's weights could not be "
                         << "read back (" << read.message() << "); the new trainer restores "
                         << "them (SetState or a checkpoint)";
    }
  }
  if (grads_.region != nullptr || grads_.cuda != nullptr) grads_.Clear();
  doorbells_ = DoorbellPage();
}

absl::Status Arenas::EnsureHostArena(Role r) {
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
      r == Role::kParameters ? layout_->param_arena_bytes : layout_->grad_arena_bytes;
  b.host.assign(static_cast<size_t>(bytes), 0);
  b.data = b.host.data();
  if (r == Role::kParameters && !held_.empty()) {
    for (size_t i = 0; i < layout_->tensors.size(); ++i) {
      const TensorPlacement& t = layout_->tensors[i];
      RunOnCompute(compute_, [&] {
        internal::NarrowFromF32(HostContext(), t.dtype, held_[i].data(), t.numel,
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

absl::Status Arenas::CheckRegions(const std::string& when, std::optional<Role> only) const {
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

absl::Status Arenas::Hold(std::vector<std::vector<float>> weights) {
  held_ = std::move(weights);
  if (!params_.any()) return absl::OkStatus();
  for (size_t i = 0; i < layout_->tensors.size(); ++i) {
    DIOND_RETURN_IF_ERROR(WriteParamF32(i, held_[i].data()));
  }
  held_.clear();
  master_valid_ = !has_master_.empty();
  return absl::OkStatus();
}

absl::Status Arenas::AdoptHeldWeightsAsMaster() {
  for (size_t i = 0; i < layout_->tensors.size(); ++i) {
    if (HasMaster(i)) DIOND_RETURN_IF_ERROR(WriteMaster(i, held_[i].data()));
  }
  master_valid_ = !has_master_.empty();
  held_.clear();
  return absl::OkStatus();
}

absl::Status Arenas::ReadParamF32(size_t i, float* out) {
  const TensorPlacement& t = layout_->tensors[i];
  if (HasMaster(i) && master_valid_) return ReadMaster(i, out);
  if (!held_.empty()) {
    std::memcpy(out, held_[i].data(), static_cast<size_t>(t.numel) * 4);
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

absl::Status Arenas::WriteParamF32(size_t i, const float* in) {
  const TensorPlacement& t = layout_->tensors[i];
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

absl::Status Arenas::CudaParamToHost(size_t i, std::vector<uint8_t>* bytes) const {
  const TensorPlacement& t = layout_->tensors[i];
  if (device_ctx_ == nullptr || params_.cuda == nullptr) {
    return absl::InternalError("CudaParamToHost without a device session's CUDA region");
  }
  bytes->resize(static_cast<size_t>(t.size_bytes));
  if (bytes->empty()) return absl::OkStatus();
  return kernels::CopyBytesToHost(*device_ctx_, params_.cuda->data() + t.param_offset,
                                  bytes->data(), bytes->size());
}

absl::Status Arenas::CudaParamFromHost(size_t i, const std::vector<uint8_t>& bytes) {
  const TensorPlacement& t = layout_->tensors[i];
  if (device_ctx_ == nullptr || params_.cuda == nullptr ||
      bytes.size() != static_cast<size_t>(t.size_bytes)) {
    return absl::InternalError("CudaParamFromHost without a device session's CUDA region");
  }
  if (bytes.empty()) return absl::OkStatus();
  return kernels::CopyBytesFromHost(*device_ctx_, bytes.data(),
                                    params_.cuda->data() + t.param_offset, bytes.size());
}

int64_t Arenas::InitMaster(const std::vector<ParamSpec>& params) {
  int64_t bytes = 0;
  master_.resize(params.size());
  has_master_.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].dtype == DType::kF32) continue;
    has_master_[i] = 1;
    master_[i].resize(static_cast<size_t>(layout_->tensors[i].numel));
    bytes += 4 * layout_->tensors[i].numel;
  }
  return bytes;
}

absl::Status Arenas::MoveMasterToDevice(absl::FunctionRef<std::string()> pool_error) {
  int64_t total = 0;
  device_master_offset_.assign(layout_->tensors.size(), -1);
  for (size_t i = 0; i < layout_->tensors.size(); ++i) {
    if (!HasMaster(i)) continue;
    device_master_offset_[i] = total;
    total += layout_->tensors[i].numel;
  }
  if (total == 0) return absl::OkStatus();
  auto buf = device_ctx_->Allocate(DType::kF32, {total});
  if (!buf.ok()) {
    const std::string pool = pool_error();
    return absl::Status(buf.status().code(),
                        absl::StrCat("the session's master weights (", 4 * total,
                                     " bytes) do not fit on the device: ", buf.status().message(),
                                     pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
  }
  device_master_buf_ = std::move(*buf);
  // The host vectors are not used by a device session.
  for (std::vector<float>& m : master_) std::vector<float>().swap(m);
  device_master_ = true;
  return absl::OkStatus();
}

float* Arenas::DeviceMaster(size_t i) const {
  return const_cast<float*>(device_master_buf_.As<float>()) + device_master_offset_[i];
}

absl::Status Arenas::ReadMaster(size_t i, float* out) const {
  const size_t bytes = static_cast<size_t>(layout_->tensors[i].numel) * 4;
  if (device_master_) {
    if (bytes == 0) return absl::OkStatus();
    return kernels::CopyBytesToHost(*device_ctx_, DeviceMaster(i), out, bytes);
  }
  std::memcpy(out, master_[i].data(), bytes);
  return absl::OkStatus();
}

absl::Status Arenas::WriteMaster(size_t i, const float* in) {
  const size_t bytes = static_cast<size_t>(layout_->tensors[i].numel) * 4;
  if (device_master_) {
    if (bytes == 0) return absl::OkStatus();
    return kernels::CopyBytesFromHost(*device_ctx_, in, DeviceMaster(i), bytes);
  }
  std::memcpy(master_[i].data(), in, bytes);
  return absl::OkStatus();
}

int64_t Arenas::HostBytes() const {
  int64_t bytes = static_cast<int64_t>(params_.host.size() + grads_.host.size());
  for (const auto* scratch : {&grad_scratch_, &param_scratch_}) {
    for (const std::vector<float>& v : *scratch) bytes += 4 * static_cast<int64_t>(v.capacity());
  }
  return bytes;
}

}  // namespace diond::session
