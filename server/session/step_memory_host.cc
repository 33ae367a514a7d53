// A host session's side of the step (step_memory.h): the trainer's memory read and written where
// it lies, the conversions and the master weights through the session's fp32 buffers, every pass
// an op of kernels/ops.h on the step's CPU context.
#include <vector>

#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/step_memory.h"

namespace diond::session {

const kernels::Context& Session::HostMemory::UpdateContext(Session& s,
                                                           const kernels::Context& ctx) {
  // A host session stepped with a device context (none is made so) would step on the CPU.
  return ctx.device().type != kernels::DeviceType::kCpu ? s.HostContext() : ctx;
}

absl::Status Session::HostMemory::ReadGradients(Session& s, StepRun& run) {
  const size_t n = s.layout_.tensors.size();
  run.grads.assign(n, nullptr);
  s.grad_scratch_.resize(n);  // each buffer keeps its capacity between steps
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    if (run.no_grad[i]) continue;  // never read: its bytes need not be finite
    const TensorPlacement& t = s.layout_.tensors[i];
    const uint8_t* src = s.grads_.data + t.grad_offset;
    bool ok = true;
    if (t.dtype == DType::kF32 && !run.scaled) {
      // In place, wherever the arena lies. The scan reads exactly what the update reads later;
      // a trainer writing its gradients meanwhile only changes its own session's step.
      run.grads[i] = reinterpret_cast<const float*>(src);
      if (finite) {
        DIOND_RETURN_IF_ERROR(
            kernels::AllFinite(*run.ctx, internal::HostView(t.dtype, src, t.numel), &ok));
      }
    } else {
      // Widened and scaled in the pass that scans them (a world's non-finite rank still
      // contributes every gradient to the reduce-scatter, so all are converted).
      std::vector<float>& c = s.grad_scratch_[i];
      c.resize(static_cast<size_t>(t.numel));
      DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFinite(
          *run.ctx, internal::HostView(t.dtype, src, t.numel), run.scale,
          internal::HostView(DType::kF32, c.data(), t.numel), &ok));
      run.grads[i] = c.data();
    }
    finite = finite && ok;
  }
  run.finite = finite;
  // A region found broken here fails the step before anything (a world: before any collective;
  // the other ranks' steps then fail on their collectives' timeout).
  return s.CheckRegions(run.when, Role::kGradients);
}

absl::Status Session::HostMemory::ReadParameters(Session& s, StepRun& run) {
  const size_t n = s.layout_.tensors.size();
  run.params.assign(n, nullptr);
  run.via_scratch.assign(n, false);
  s.param_scratch_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const TensorPlacement& t = s.layout_.tensors[i];
    uint8_t* arena = s.params_.data + t.param_offset;
    const bool master = s.HasMaster(i);  // (a host session: master_ holds them)
    if (!master && t.dtype == DType::kF32) {
      run.params[i] = reinterpret_cast<float*>(arena);  // in place
      continue;
    }
    // The master weights are daemon state: the step updates a copy, swapped in at the commit.
    std::vector<float>& c = s.param_scratch_[i];
    c.resize(static_cast<size_t>(t.numel));
    const bool from_master = master && s.master_valid_;
    DIOND_RETURN_IF_ERROR(
        kernels::Copy(*run.ctx,
                      from_master ? internal::HostView(DType::kF32, s.master_[i].data(), t.numel)
                                  : internal::HostView(t.dtype, arena, t.numel),
                      internal::HostView(DType::kF32, c.data(), t.numel)));
    run.params[i] = c.data();
    run.via_scratch[i] = true;
  }
  return absl::OkStatus();
}

absl::Status Session::HostMemory::Stage(Session& s, StepRun& run, const kernels::Context& ctx) {
  return s.StageGroups(run, ctx);
}

absl::Status Session::HostMemory::WriteWeights(Session& s, StepRun& run) {
  for (size_t i = 0; i < s.layout_.tensors.size(); ++i) {
    if (!run.via_scratch[i]) continue;
    const TensorPlacement& t = s.layout_.tensors[i];
    DIOND_RETURN_IF_ERROR(
        kernels::Copy(*run.ctx, internal::HostView(DType::kF32, run.params[i], t.numel),
                      internal::HostView(t.dtype, s.params_.data + t.param_offset, t.numel)));
  }
  return absl::OkStatus();
}

void Session::HostMemory::CommitMaster(Session& s, size_t i) {
  s.master_[i].swap(s.param_scratch_[i]);  // the updated copy becomes the master weights
}

}  // namespace diond::session
