// The global-norm gradient clip of a step (StepRequest.max_grad_norm; docs/DATA_PLANE.md
// "Gradient clip"), torch.nn.utils.clip_grad_norm_'s semantics: total = √(Σ over the parameters
// with a gradient of Σg²), coef = max_grad_norm / (total + 1e-6), and every gradient multiplied
// by (float)coef when coef < 1 (torch clamps it to 1 and multiplies always: the same values).
//
// Internal to the session's implementation: included only by server/session/*.cc, every call
// under the session's mutex on the step's thread (the passes on the compute thread). Host and
// device sessions, local or world. A world clips the gradients its ranks step on: REPLICATED,
// every rank's own (the same on every rank); AVERAGE, the average, whose norm needs one
// all-gather of each owner's per-parameter sums (ApplyAveraged). A device session sums each
// gradient's kernels::FrobeniusNorm, which rounds it to f32 (a relative error near 1e-7 in
// grad_norm, as torch's clip_grad_norm_ of CUDA tensors has), and scales on the device.
#ifndef DIOND_SERVER_SESSION_GRAD_CLIP_H_
#define DIOND_SERVER_SESSION_GRAD_CLIP_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace diond::session {

// Σx² of n floats, accumulated in double in a fixed order (8 lanes, then the lanes in order),
// so that a tensor's sum does not depend on when or with what else it was read.
double SumOfSquares(const float* x, int64_t n);

struct Session::Clip {
  // INVALID_ARGUMENT for a max_grad_norm that is not finite or < 0; FAILED_PRECONDITION for a
  // clip under DION_COMPRESSED. Nothing changes.
  static absl::Status Validate(const Session& self, const StepRequest& request);
  // Parameter i's gradient, just read into run.grads[i], summed into run.grad_sq[i].
  static void Accumulate(const Session& self, StepRun& run, size_t i);
  // Once every gradient is read (on the compute thread): a device session's norms
  // (NormsOnDevice; a host session's reads summed them), then Scale.
  static absl::Status Apply(Session& self, StepRun& run);
  // From run.grad_sq: run.result.grad_norm, in parameter order whatever order the reads came
  // in; a non-finite total clears run.finite; else, when the coef is < 1, every gradient read
  // (`only`: these) is multiplied by it into the session's fp32 scratch (a device session's:
  // its staging; never into the trainer's memory) and run.grads points there.
  static absl::Status Scale(Session& self, StepRun& run, const std::vector<size_t>* only = nullptr);
  // run.grad_sq ← 0, then for `params` with a gradient read, its square of norm: each normed on
  // the device, the norms read back in one copy (a sync point).
  static absl::Status NormsOnDevice(Session& self, StepRun& run, const std::vector<size_t>& params);
  // From run.grad_sq: run.result.grad_norm, run.finite cleared by a non-finite total; the coef
  // to multiply by, or none (not finite, or no clip needed: torch's factor 1 changes nothing).
  static std::optional<float> Coef(StepRun& run);
  // The end of an overlapped step's reads under a clip: Apply, then (all finite) every group
  // staged with every gradient as one part (GroupOptimizer::StagePart: the same bits as parts).
  static absl::Status ApplyAndStage(Session& self, StepRun& run);
  // Whether a clip of this session's steps is of the averaged gradients (run.clip_averaged).
  static bool OfAverage(const Session& self);
  // A world under AVERAGE, after the reduce-scatter (the step's thread): each owner's sums of
  // its averaged gradients all-gathered (each parameter's sum is its owner's, so every rank
  // totals the same doubles in parameter order), then Apply's rule on the owned gradients. A
  // failed collective breaks the world session.
  static absl::Status ApplyAveraged(Session& self, StepRun& run);
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_GRAD_CLIP_H_
