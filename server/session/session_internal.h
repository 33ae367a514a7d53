// Helpers shared by the files that implement Session (session*.cc, arenas.cc): the conversions
// between a trainer's dtype and fp32, the views and copies of a step, the element count, and the
// nested types only the implementation needs (StepRun, WorldPart). Not part of the session's
// interface.
#ifndef DIOND_SERVER_SESSION_SESSION_INTERNAL_H_
#define DIOND_SERVER_SESSION_SESSION_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/tensor.h"
#include "server/comm/communicator.h"
#include "server/session/device_comm.h"
#include "server/session/session.h"
#include "server/session/types.h"

namespace diond::session::internal {

// out[0, n) ← the n elements at `src` of `dtype`, widened exactly to fp32 (kernels::Copy on
// `ctx`, a CPU context: Arenas::HostContext).
void WidenToF32(const kernels::Context& ctx, DType dtype, const uint8_t* src, int64_t n,
                float* out);
// dst ← the n fp32 values of `in`, rounded once (RNE) to `dtype` (kernels::Copy on `ctx`).
void NarrowFromF32(const kernels::Context& ctx, DType dtype, const float* in, int64_t n,
                   uint8_t* dst);
// Contiguous rank-1 views of n elements of `dtype` at p, on the CPU (the trainer's memory and
// the session's buffers are host memory), for the ops of a Step (kernels/ops.h).
kernels::ConstTensorView HostView(DType dtype, const void* p, int64_t n);
kernels::TensorView HostView(DType dtype, void* p, int64_t n);

// Rank-1 fp32 views of n values at p in the memory of `ctx`'s device (a step's tensors).
kernels::TensorView StepView(const kernels::Context& ctx, float* p, int64_t n);
kernels::ConstTensorView StepView(const kernels::Context& ctx, const float* p, int64_t n);
// n fp32 values copied host to host, or between `dctx`'s device memory and the host,
// synchronously: the destination is complete, and the source reusable, when they return.
absl::Status CopyF32(const float* src, float* dst, int64_t n);
absl::Status CopyF32ToHost(const kernels::Context& dctx, const float* tensor, float* host,
                           int64_t n);
absl::Status CopyF32ToDevice(const kernels::Context& dctx, const float* host, float* tensor,
                             int64_t n);

inline int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace diond::session::internal

namespace diond::session {

// One Step's working set (session_step.cc, session_world.cc), filled phase by phase.
struct Session::StepRun {
  const StepRequest* request = nullptr;
  // The step's context (its ops) and the compute thread that runs every pass of ops (the
  // session's compute_; never a collective, except compressed Dion's replica average inside
  // the update), null: the calling thread.
  const kernels::Context* ctx = nullptr;
  ComputeThread* compute = nullptr;
  absl::Time start;
  // What errors start with: "step N" (a world session: "world session 'k' (rank r of n), step N").
  std::string when;
  float scale = 1.0f;
  bool scaled = false;
  // The world's communicator for this step; null: a world of one (every phase of the world is
  // then a no-op).
  std::shared_ptr<comm::Communicator> comm;
  // A device session in a world: its collectives on device memory (device_comm.h), over the
  // world's device communicator (device_world_comm, NCCL; null: staged through `comm`).
  std::shared_ptr<comm::Communicator> device_world_comm;
  std::unique_ptr<StepDeviceComm> dcomm;
  std::vector<const float*> grads;  // per parameter: fp32 gradient (arena, scratch or averaged)
  std::vector<float*> params;       // per parameter: fp32 weights (arena or scratch)
  // Per parameter: params[i] is a copy (Arenas::param_scratch, another dtype or master weights;
  // a device session's staging): written into the arena after the update, and its master
  // weights' at the commit.
  std::vector<bool> via_scratch;
  // An overlapped step (session_overlap.cc): every parameter is read into its copy, so that the
  // new weights reach the arena bucket by bucket through write_weights, which FinishStepLocked
  // then calls in place of StepMemory::WriteWeights.
  bool params_via_scratch = false;
  std::function<absl::Status()> write_weights;
  bool finite = true;
  // Per parameter: no gradient in this step (StepRequest.params_without_grad; a world: agreed
  // by every rank, AgreeGradientsPhase). Such a parameter and its state are left alone, and its
  // gradient is never read (grads[i] stays null, or points at zeros for the world's average).
  std::vector<bool> no_grad;
  bool any_no_grad = false;
  // StepRequest.max_grad_norm > 0 (grad_clip.h): per parameter, its gradient's sum of squares.
  // clip: summed as the gradients are read; clip_averaged (a world under AVERAGE): the clip is
  // of the averaged gradients, summed by their owners after the reduce-scatter.
  bool clip = false;
  bool clip_averaged = false;
  std::vector<double> grad_sq;
  // World AVERAGE, host memory: this rank's reduce-scattered gradients, one block per
  // reduce-scatter (the step's, or each bucket's).
  std::vector<std::vector<float>> averaged;
  // Per group: this step's options, the owner's compact updates, what the group stages.
  std::vector<optim::StepOptions> opts;
  std::vector<optim::StepCapture> captures;
  std::vector<std::vector<float*>> group_params;
  std::vector<bool> staged;
  std::vector<bool> compressed;   // a group every rank steps (compressed Dion)
  std::vector<double> update_sq;  // squared update norm (a world: this rank's share, then the sum)
  // A world's overlapped step exchanged every update bucket by bucket (session_overlap_world.cc):
  // the step's exchange then carries only the norms and statuses.
  bool updates_exchanged = false;
  // World: this rank's failure in compute, shared with the others through the exchange.
  absl::Status compute_status;
  StepResult result;

  // Compressed Dion (a group every rank steps): `opts` averages P and R over the ranks, in the
  // step's device collectives when the rules run on the device, else on host memory.
  void AverageReplicas(bool on_device, optim::StepOptions* opts) const;
};

// A world session's part (session_world.cc): the shard plan and what each rank owns.
struct Session::Group {
  std::string name;
  std::unique_ptr<optim::GroupOptimizer> optimizer;
  std::vector<size_t> params;              // indices into layout_.tensors
  std::optional<double> lr, weight_decay;  // SetHyperparameters overrides
};

struct Session::WorldPart {
  std::shared_ptr<WorldLink> world;  // null: a world of one
  ShardPlan plan;
  uint64_t epoch = 0;
  int rank = 0;
  std::vector<std::vector<size_t>> owned;  // per rank, parameter indices in order
  std::vector<int64_t> owned_elements;     // per rank
  // Per parameter: floats of its compact update (optim::CapturedUpdateSize; Dion P/Q_new,
  // Dion2 slices), 0 = the whole parameter is exchanged.
  std::vector<int64_t> compact;
  std::vector<int64_t> owned_payload;  // per rank: floats it sends in the exchange
  // Per parameter: computed by every rank on its own gradients (Dion under DION_COMPRESSED),
  // so neither reduce-scattered nor exchanged.
  std::vector<bool> replicated;
  absl::Status broken;  // set once a step failed in the world
  absl::Duration verdict_wait;
  int64_t checksum_every = 0;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_INTERNAL_H_
