// The global-norm gradient clip (grad_clip.h).
//
// A host session's norm is summed here, in double, rather than with kernels::FrobeniusNorm: that
// op accumulates in double too but rounds each tensor's norm to f32, so the total (and the
// grad_norm the trainer logs) would carry a relative error near 1e-7 that depends on how the
// parameters are split. Its gradients are host memory, so one read-only pass suffices. A device
// session's are not: there FrobeniusNorm it is, one op per gradient and one read-back.
#include "server/session/grad_clip.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/session_device.h"

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
  if (max > 0 && self.is_world_session() &&
      self.spec_.gradient_sync == GradientSync::kDionCompressed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", request.step_index, ": session ", self.id_,
        " syncs DION_COMPRESSED: its Dion groups' gradients are never averaged, so there is no "
        "one global norm to clip by; max_grad_norm needs REPLICATED or AVERAGE"));
  }
  return absl::OkStatus();
}

bool Session::Clip::OfAverage(const Session& self) {
  return self.is_world_session() && self.spec_.gradient_sync == GradientSync::kAverage;
}

void Session::Clip::Accumulate(const Session& self, StepRun& run, size_t i) {
  run.grad_sq[i] = SumOfSquares(run.grads[i], self.layout_.tensors[i].numel);
}

std::optional<float> Session::Clip::Coef(StepRun& run) {
  double sq = 0.0;
  for (double s : run.grad_sq) sq += s;  // parameter order: the same for every read order
  const double total = std::sqrt(sq);
  run.result.grad_norm = total;
  if (!std::isfinite(total)) run.finite = false;  // the non-finite policy decides
  if (!run.finite) return std::nullopt;
  const double coef = run.request->max_grad_norm / (total + 1e-6);
  if (coef >= 1.0) return std::nullopt;  // torch multiplies by 1.0: the same values
  return static_cast<float>(coef);
}

absl::Status Session::Clip::Apply(Session& self, StepRun& run) {
  if (self.device_ != nullptr) {
    std::vector<size_t> all(self.layout_.tensors.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    DIOND_RETURN_IF_ERROR(NormsOnDevice(self, run, all));
  }
  return Scale(self, run, nullptr);
}

absl::Status Session::Clip::Scale(Session& self, StepRun& run, const std::vector<size_t>* only) {
  const std::optional<float> coef = Coef(run);
  if (!coef.has_value()) return absl::OkStatus();
  const float c = *coef;
  for (size_t k = 0; k < (only != nullptr ? only->size() : run.grads.size()); ++k) {
    const size_t i = only != nullptr ? (*only)[k] : k;
    if (run.grads[i] == nullptr || run.no_grad[i]) continue;
    const int64_t numel = self.layout_.tensors[i].numel;
    if (self.device_ != nullptr) {
      // A gradient read in place from a CUDA region stays the trainer's: scaled into the
      // staging.
      DeviceSide& d = *self.device_;
      if (numel == 0) continue;
      float* dst = d.grad(i);
      DIOND_RETURN_IF_ERROR(kernels::Scale(
          *d.ctx, c, internal::DeviceView(d.device, DType::kF32, run.grads[i], numel),
          internal::DeviceView(d.device, DType::kF32, dst, numel)));
      run.grads[i] = dst;
      continue;
    }
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

absl::Status Session::Clip::NormsOnDevice(Session& self, StepRun& run,
                                          const std::vector<size_t>& params) {
  DeviceSide& d = *self.device_;
  const kernels::Context& dc = *d.ctx;
  const size_t n = self.layout_.tensors.size();
  auto read = [&](size_t i) {
    return run.grads[i] != nullptr && !run.no_grad[i] && self.layout_.tensors[i].numel > 0;
  };
  // The norms in the flag's buffer after the flag (one per parameter), then one read-back.
  float* norms = d.nonfinite.As<float>() + 1;
  for (size_t i : params) {
    if (!read(i)) continue;
    DIOND_RETURN_IF_ERROR(kernels::FrobeniusNorm(
        dc,
        internal::DeviceView(d.device, DType::kF32, run.grads[i], self.layout_.tensors[i].numel),
        internal::DeviceView(d.device, DType::kF32, norms + i, 1)));
  }
  std::vector<float> host(n, 0.0f);
  if (n > 0) {
    const int64_t count = static_cast<int64_t>(n);
    DIOND_RETURN_IF_ERROR(kernels::CopyToHost(
        dc, internal::DeviceView(d.device, DType::kF32, static_cast<const float*>(norms), count),
        kernels::MakeView(host.data(), {count})));
  }
  run.grad_sq.assign(n, 0.0);
  for (size_t i : params) {
    if (read(i)) run.grad_sq[i] = static_cast<double>(host[i]) * static_cast<double>(host[i]);
  }
  return absl::OkStatus();
}

absl::Status Session::Clip::ApplyAveraged(Session& self, StepRun& run) {
  const WorldPart& w = *self.world_;
  const std::vector<size_t>& mine = w.owned[static_cast<size_t>(w.rank)];
  const size_t n = self.layout_.tensors.size();
  DIOND_RETURN_IF_ERROR(CallOnCompute(self.compute_, [&] {
    if (self.device_ != nullptr) return NormsOnDevice(self, run, mine);
    run.grad_sq.assign(n, 0.0);
    for (size_t i : mine) {
      if (run.grads[i] != nullptr && !run.no_grad[i]) Accumulate(self, run, i);
    }
    return absl::OkStatus();
  }));
  // A world of one owns every parameter: its own sums are the world's.
  if (run.comm == nullptr) return CallOnCompute(self.compute_, [&] { return Scale(self, run); });
  // Every rank takes part whatever its flags (the world's finiteness is already common).
  std::vector<double> all(n * static_cast<size_t>(w.plan.world_size));
  absl::Status st = run.comm->AllGatherBytes(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(run.grad_sq.data()), n * sizeof(double)),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(double)));
  if (!st.ok()) {
    return self.BreakWorld(
        run, absl::UnavailableError(absl::StrCat(
                 run.when, ": gathering the gradients' norms for max_grad_norm failed: ",
                 self.DescribeWorldFailure(st),
                 "; create the session again and resume from the last checkpoint")));
  }
  for (size_t i = 0; i < n; ++i) {
    run.grad_sq[i] = all[static_cast<size_t>(w.plan.owner[i]) * n + i];
  }
  return CallOnCompute(self.compute_, [&] { return Scale(self, run, &mine); });
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
