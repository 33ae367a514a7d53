// The global-norm gradient clip (grad_clip.h).
//
// The norm is summed here, in double, rather than with kernels::FrobeniusNorm: that op
// accumulates in double too but rounds each tensor's norm to f32, so the total (and the
// grad_norm the trainer logs) would carry a relative error near 1e-7 that depends on how the
// parameters are split. A host session's gradients are host memory, so one read-only pass
// suffices.
#include "server/session/grad_clip.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace diond::session {

double SumOfSquares(const float* x, int64_t n) {
  constexpr int64_t kLanes = 8;  // independent sums, so the loop vectorizes without reordering
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const double v = x[j + l];
      lane[l] += v * v;
    }
  }
  for (; j < n; ++j) {
    const double v = x[j];
    lane[j % kLanes] += v * v;
  }
  double s = 0.0;
  for (double v : lane) s += v;
  return s;
}

absl::Status Session::Clip::Validate(const Session& self, const StepRequest& request) {
  const double max = request.max_grad_norm;
  if (!std::isfinite(max) || max < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm ", max, " must be finite and >= 0 (0 = no clip)"));
  }
  if (max > 0 && (self.device_ != nullptr || self.is_world_session())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", request.step_index, ": session ", self.id_, " is a ",
        self.device_ != nullptr ? "device" : "world",
        " session: max_grad_norm is not built yet for device/world sessions (a world's global "
        "norm needs a collective); clip in the trainer or use a local host session"));
  }
  return absl::OkStatus();
}

void Session::Clip::Accumulate(const Session& self, StepRun& run, size_t i) {
  run.grad_sq[i] = SumOfSquares(run.grads[i], self.layout_.tensors[i].numel);
}

absl::Status Session::Clip::Apply(Session& self, StepRun& run) {
  double sq = 0.0;
  for (double s : run.grad_sq) sq += s;  // parameter order: the same for every read order
  const double total = std::sqrt(sq);
  run.result.grad_norm = total;
  if (!std::isfinite(total)) run.finite = false;  // the non-finite policy decides
  if (!run.finite) return absl::OkStatus();
  const double coef = run.request->max_grad_norm / (total + 1e-6);
  if (coef >= 1.0) return absl::OkStatus();  // torch multiplies by 1.0: the same values
  const float c = static_cast<float>(coef);
  for (size_t i = 0; i < run.grads.size(); ++i) {
    if (run.grads[i] == nullptr || run.no_grad[i]) continue;
    const int64_t numel = self.layout_.tensors[i].numel;
    std::vector<float>& scratch = self.arenas_.grad_scratch()[i];
    // An f32 gradient read in place stays the trainer's: the scaled copy goes to the scratch.
    if (run.grads[i] != scratch.data()) scratch.resize(static_cast<size_t>(numel));
    DIOND_RETURN_IF_ERROR(kernels::Binary(*run.ctx, kernels::BinaryOp::kMul,
                                          internal::HostView(DType::kF32, run.grads[i], numel),
                                          internal::HostView(DType::kF32, &c, 1),
                                          internal::HostView(DType::kF32, scratch.data(), numel)));
    run.grads[i] = scratch.data();
  }
  return absl::OkStatus();
}

absl::Status Session::Clip::ApplyAndStage(Session& self, StepRun& run) {
  DIOND_RETURN_IF_ERROR(CallOnCompute(self.compute_, [&] { return Apply(self, run); }));
  if (!run.finite) return absl::OkStatus();  // the step's decision follows
  const absl::Time start = absl::Now();
  absl::Status s = CallOnCompute(self.compute_, [&]() -> absl::Status {
    for (size_t gi = 0; gi < self.groups_.size(); ++gi) {
      if (!run.staged[gi]) continue;
      const Group& g = self.groups_[gi];
      std::vector<const float*> grads;
      for (size_t i : g.params) grads.push_back(run.no_grad[i] ? nullptr : run.grads[i]);
      absl::Status st = g.optimizer->StagePart(run.group_params[gi], grads);
      if (!st.ok()) {
        return absl::Status(
            st.code(), absl::StrCat(run.when, ", group '", Bounded(g.name), "': ", st.message()));
      }
    }
    return absl::OkStatus();
  });
  run.result.compute_micros += absl::ToInt64Microseconds(absl::Now() - start);
  return s;
}

}  // namespace diond::session
