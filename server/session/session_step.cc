// Session::Step: the one step skeleton (docs/ARCHITECTURE.md §2). A local session is a world of
// one: the world's phases (session_world.cc) do nothing without a communicator.
//
// Transactions without copies of the trainer's memory. The computation reads the trainer's
// gradients and weights where they lie (shm regions under ShmRegion's SIGBUS guard); what can
// still fail after validation is that memory vanishing (the trainer shrinks its segment), so the
// phases are ordered for it:
//   validate → gradients (+ finiteness, + clip) → [world: reduce] → weights → stage every group
//   → regions intact? → write the new weights → [world: exchange] → narrow → PARAMETERS intact?
//   → commit the staged state and record the step.
// A failure before the commit drops what was staged: the optimizer state, the master weights
// and the step index stay as they were. Only the trainer's own weights may then have been
// written, and only when its PARAMETERS region broke (that memory is gone with the region).
// An overlapped step (session_overlap.cc) reads the weights first, then the gradients and the
// staging bucket by bucket as the trainer rings them, and joins here at the decision.
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/validation.h"
#include "server/session/grad_clip.h"
#include "server/session/session.h"
#include "server/session/session_device.h"
#include "server/session/session_internal.h"
#include "server/session/session_overlap.h"
#include "server/session/step_memory.h"

namespace diond::session {
namespace {

// The step number the group's update rules see: the trainer's (StepRequest::group_step), else
// the session's step index.
int64_t GroupStep(const StepRequest& request, const std::string& group) {
  auto it = request.group_step.find(group);
  return it != request.group_step.end() ? it->second : request.step_index;
}

}  // namespace

absl::StatusOr<StepResult> Session::StepLocked(const StepRequest& request,
                                               const kernels::Context& ctx, absl::Time start) {
  std::optional<StepResult> replay;
  DIOND_RETURN_IF_ERROR(ValidateStepLocked(request, &replay));
  if (replay.has_value()) return *replay;

  StepRun run;
  run.request = &request;
  // The session's own passes read and write host memory (the trainer's shm, the session's
  // buffers): they run on the step's context when it is the CPU's, else on a CPU context of the
  // session's (the update itself always runs on `ctx`).
  run.ctx = &ctx;
  if (ctx.device().type != kernels::DeviceType::kCpu) run.ctx = &arenas_.HostContext();
  // The context the update rules run on: a device session's own (the device, or a CPU context
  // over its host-addressable staging until the rules run on devices), world sessions included.
  const kernels::Context& update_ctx = memory_->UpdateContext(*this, ctx);
  run.compute = compute_;
  run.start = start;
  run.when = absl::StrCat("step ", request.step_index);
  if (world_ != nullptr) {
    run.when = absl::StrCat("world session '", Bounded(spec_.world_key), "' (rank ", world_->rank,
                            " of ", world_->plan.world_size, "), step ", request.step_index);
  }
  const double scale = request.gradient_scale == 0.0 ? 1.0 : request.gradient_scale;
  run.scale = static_cast<float>(scale);
  run.scaled = scale != 1.0;
  run.result.step_index = request.step_index;
  run.no_grad.assign(layout_.tensors.size(), false);
  for (int32_t i : request.params_without_grad) run.no_grad[static_cast<size_t>(i)] = true;
  run.any_no_grad = !request.params_without_grad.empty();
  // The reads sum and Clip::Apply scales, or, of averaged gradients, Clip::ApplyAveraged does
  // both after the reduce-scatter (grad_clip.h).
  run.clip_averaged = request.max_grad_norm > 0 && Clip::OfAverage(*this);
  run.clip = request.max_grad_norm > 0 && !run.clip_averaged;
  if (run.clip) run.grad_sq.assign(layout_.tensors.size(), 0.0);
  // After the first step: which phases may run as captured graphs (RunPhaseGraph tries them),
  // and why the others run eagerly.
  memory_->PrepareStep(*this, run);
  // Bucket by bucket as the trainer's backward produces them (session_overlap.cc).
  if (request.overlap) return Overlap::OverlappedStepLocked(*this, run, update_ctx);

  DIOND_RETURN_IF_ERROR(JoinWorldPhase(run));
  // The phases that only compute run on the daemon's compute thread (compute_thread.h); the
  // world's collectives run here, between them.
  DIOND_RETURN_IF_ERROR(
      CallOnCompute(compute_, [&] { return memory_->ReadGradients(*this, run); }));
  DIOND_RETURN_IF_ERROR(AgreeGradientsPhase(run));
  DIOND_RETURN_IF_ERROR(ReduceGradientsPhase(run));
  if (run.clip_averaged) DIOND_RETURN_IF_ERROR(Clip::ApplyAveraged(*this, run));
  if (!run.finite) {
    // A world: every rank decides alike (REPLICATED: the same gradients; AVERAGE: the flags were
    // summed with them).
    if (spec_.non_finite == NonFinitePolicy::kError) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step_index, ": gradients contain NaN or Inf (non_finite_policy=ERROR)"));
    }
    return SkipStepLocked(run);
  }
  if (absl::Status s = CallOnCompute(compute_, [&] { return memory_->ReadParameters(*this, run); });
      !s.ok()) {
    return run.comm != nullptr ? BreakWorld(run, s) : s;
  }
  if (absl::Status s = arenas_.CheckRegions(run.when); !s.ok()) {
    return run.comm != nullptr ? BreakWorld(run, s) : s;
  }
  DIOND_RETURN_IF_ERROR(
      CallOnCompute(compute_, [&] { return StageUpdatesPhase(run, update_ctx); }));
  return FinishStepLocked(run, update_ctx);
}

absl::StatusOr<StepResult> Session::SkipStepLocked(StepRun& run) {
  run.result.skipped = true;
  // The weights are as they were: the trainer's stream may go on.
  DIOND_RETURN_IF_ERROR(memory_->RecordDoneEvent(*this, *run.request));
  if (run.comm != nullptr) run.result.world_bytes_sent = run.comm->TakeBytesSent();
  run.result.total_micros = absl::ToInt64Microseconds(absl::Now() - run.start);
  if (!run.result.graph_fallbacks.empty()) memory_->FallbacksReported();
  last_step_index_ = run.request->step_index;
  last_result_ = run.result;
  return run.result;
}

absl::StatusOr<StepResult> Session::FinishStepLocked(StepRun& run,
                                                     const kernels::Context& update_ctx) {
  // Everything the update read came from intact memory: nothing has been written yet.
  if (absl::Status s = arenas_.CheckRegions(run.when); !s.ok()) {
    DiscardStep(run);
    return run.comm != nullptr ? BreakWorld(run, s) : s;
  }
  RunOnCompute(compute_, [&] { WriteWeightsPhase(run); });
  if (absl::Status s = ExchangeUpdatesPhase(run, update_ctx); !s.ok()) {
    DiscardStep(run);
    return s;
  }
  // The weights of other dtypes (and the master weights' narrowed copies) into the arena; a
  // device session: every new weight back from the device staging; an overlapped step: every
  // weight, bucket by bucket (session_overlap.cc).
  if (absl::Status s = CallOnCompute(compute_,
                                     [&] {
                                       return run.write_weights ? run.write_weights()
                                                                : memory_->WriteWeights(*this, run);
                                     });
      !s.ok()) {
    DiscardStep(run);
    return s;
  }
  if (const Arenas::Binding& params = arenas_.params();
      params.region != nullptr && !params.region->CheckIntact().ok()) {
    // The trainer's weights went with its segment while they were written. The step is not
    // applied: the optimizer state, master weights and step index are as before.
    DiscardStep(run);
    const std::string region = params.region->Describe();
    DIOND_LOG(WARNING) << "session " << id_ << ": PARAMETERS " << region << " shrank while "
                       << run.when << " wrote the new weights; the step was not applied";
    absl::Status s = absl::FailedPreconditionError(absl::StrCat(
        run.when, ": the PARAMETERS ", region,
        " shrank (SIGBUS caught) while the new weights were written. The step was not applied: "
        "the optimizer state and the step index are unchanged; the weights in that region are "
        "lost with it (register a new region and restore them with SetState)"));
    return world_ != nullptr && run.comm != nullptr ? BreakWorld(run, s) : s;
  }
  // The new weights are written (queued on the session stream): the trainer's stream waits on
  // done_event before its next forward.
  if (absl::Status s = memory_->RecordDoneEvent(*this, *run.request); !s.ok()) {
    DiscardStep(run);
    return absl::Status(
        s.code(),
        absl::StrCat(
            run.when, ": recording done_event failed: ", s.message(),
            ". The step was not applied "
            "(the optimizer state and the step index are unchanged), but the new weights were "
            "written into the PARAMETERS region: restore them with SetState"));
  }
  StepResult result;
  RunOnCompute(compute_, [&] { result = CommitStepPhase(run); });
  return result;
}

absl::Status Session::ValidateStepLocked(const StepRequest& request,
                                         std::optional<StepResult>* replay) {
  if (request.step_index == last_step_index_ && last_result_.has_value() &&
      last_result_->step_index == last_step_index_) {
    StepResult r = *last_result_;
    r.replayed = true;
    *replay = r;
    return absl::OkStatus();
  }
  // Overflow-safe: last_step_index_ is at most INT64_MAX, and no step follows INT64_MAX.
  if (last_step_index_ == std::numeric_limits<int64_t>::max()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step_index ", request.step_index, ": the session is at the last representable step"));
  }
  if (request.step_index != last_step_index_ + 1) {
    std::string why;
    if (last_step_index_ > 0 && request.step_index == last_step_index_) {
      why = absl::StrCat(" (step ", last_step_index_,
                         " was applied, but its answer is not recorded: the session was restored "
                         "from a checkpoint without it)");
    } else if (last_step_index_ > 0 && last_result_.has_value()) {
      why = absl::StrCat(" (or ", last_step_index_, " to replay the last answer)");
    }
    if (!queue_.last_failure().empty()) {
      absl::StrAppend(&why, "; the last asynchronous step failed (", queue_.last_failure(), ")");
    }
    return absl::FailedPreconditionError(absl::StrCat("step_index ", request.step_index,
                                                      " is out of order: expected ",
                                                      last_step_index_ + 1, why));
  }
  const double scale = request.gradient_scale == 0.0 ? 1.0 : request.gradient_scale;
  if (!std::isfinite(scale) || scale < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient_scale ", request.gradient_scale, " must be finite and >= 0"));
  }
  DIOND_RETURN_IF_ERROR(Clip::Validate(*this, request));
  auto known = [&](const std::string& group) {
    for (const Group& g : groups_) {
      if (g.name == group) return true;
    }
    return false;
  };
  for (const auto& [group, lr] : request.lr_override) {
    if (!known(group)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lr_override names unknown group '", Bounded(group), "'"));
    }
    DIOND_RETURN_IF_ERROR(optim::CheckStepKnob(absl::StrCat("lr_override['", Bounded(group), "']"),
                                               lr, optim::kMaxLr));
  }
  for (const auto& [group, n] : request.group_step) {
    if (!known(group)) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_step names unknown group '", Bounded(group), "'"));
    }
    if (n < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_step['", Bounded(group), "'] = ", n, " must be >= 1"));
    }
  }
  if (!request.params_without_grad.empty()) {
    std::vector<bool> seen(layout_.tensors.size(), false);
    for (int32_t i : request.params_without_grad) {
      if (i < 0 || static_cast<size_t>(i) >= seen.size()) {
        return absl::InvalidArgumentError(absl::StrCat("params_without_grad: index ", i,
                                                       " is not a parameter of the session (",
                                                       seen.size(), " parameters)"));
      }
      if (seen[static_cast<size_t>(i)]) {
        return absl::InvalidArgumentError(absl::StrCat("params_without_grad: index ", i, " ('",
                                                       Bounded(layout_.tensors[i].name),
                                                       "') is named twice"));
      }
      seen[static_cast<size_t>(i)] = true;
    }
  }
  const Arenas::Binding& params = arenas_.params();
  const Arenas::Binding& grads = arenas_.grads();
  if ((params.cuda != nullptr || grads.cuda != nullptr) && device_ == nullptr) {
    // RegisterCudaRegion binds CUDA regions to device sessions only; never stepped from the host.
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", request.step_index, ": the session's ",
        (params.cuda != nullptr ? params : grads).cuda->Describe(),
        " is device memory, and this session steps on the host (docs/DATA_PLANE.md \"CUDA "
        "regions\")"));
  }
  if (!arenas_.HoldsParameters()) {
    return absl::FailedPreconditionError(
        "no parameters: register a PARAMETERS region (or upload them with SetState) before Step");
  }
  if (!grads.any()) {
    return absl::FailedPreconditionError(
        "no gradients: register a GRADIENTS region (or PushGradients) before Step");
  }
  if (request.overlap) DIOND_RETURN_IF_ERROR(Overlap::ValidateOverlapLocked(*this, request));
  if (params.cuda == nullptr) DIOND_RETURN_IF_ERROR(arenas_.EnsureHostArena(Role::kParameters));
  DIOND_RETURN_IF_ERROR(memory_->PrepareEvents(*this, request));
  // The trainer may have truncated its segments: a cheap look first (fstat); after each pass
  // over its memory, whether the SIGBUS guard caught a fault.
  return arenas_.CheckRegions(absl::StrCat("step ", request.step_index));
}

absl::Status Session::StageUpdatesPhase(StepRun& run, const kernels::Context& ctx) {
  const absl::Time compute_start = absl::Now();
  // Every group's Stage, as a captured graph where the session can (session_graph.cc).
  absl::Status s = memory_->Stage(*this, run, ctx);
  run.result.compute_micros = absl::ToInt64Microseconds(absl::Now() - compute_start);
  if (s.ok()) return s;
  if (world_ == nullptr) {
    DiscardStep(run);
    return s;
  }
  // A world: reported to the other ranks through the exchange's status values.
  run.compute_status = s;
  if (run.comm == nullptr) {  // a world of one
    DiscardStep(run);
    return BreakWorld(run, absl::Status(run.compute_status.code(),
                                        absl::StrCat(run.when, ": ", run.compute_status.message(),
                                                     "; the world session must be created "
                                                     "again")));
  }
  return absl::OkStatus();
}

void Session::StepRun::AverageReplicas(bool on_device, optim::StepOptions* opts) const {
  comm::Communicator* c = comm.get();
  StepDeviceComm* d = dcomm.get();
  // On the device, a bounded wait follows the queued all-reduce (Dion reads P back next).
  opts->replica_average = [c, d, on_device](absl::Span<float> v) {
    return on_device ? d->ReplicaAverage(v) : c->AllReduceAverage(v);
  };
  opts->replica_average_on_device = on_device;
}

void Session::InitGroupRuns(StepRun& run) {
  const StepRequest& request = *run.request;
  const size_t groups = groups_.size();
  run.opts.assign(groups, {});
  run.captures.assign(groups, {});
  run.group_params.assign(groups, {});
  run.staged.assign(groups, false);
  run.compressed.assign(groups, false);
  run.update_sq.assign(groups, 0.0);
  for (size_t gi = 0; gi < groups; ++gi) {
    const Group& g = groups_[gi];
    auto it = request.lr_override.find(g.name);
    run.opts[gi].lr = it != request.lr_override.end() ? std::optional<double>(it->second) : g.lr;
    run.opts[gi].weight_decay = g.weight_decay;
    run.opts[gi].step = GroupStep(request, g.name);  // the reference's group step (cqr warm-up)
  }
}

absl::Status Session::StageGroups(StepRun& run, const kernels::Context& ctx) {
  const StepRequest& request = *run.request;
  const size_t groups = groups_.size();
  InitGroupRuns(run);
  for (size_t gi = 0; gi < groups; ++gi) {
    Group& g = groups_[gi];
    if (g.optimizer == nullptr) continue;
    std::vector<const float*> gg;
    bool any = false;
    for (size_t i : g.params) {
      // A world: each rank updates what it owns (the others get no gradient, which leaves them
      // and their state alone); compressed Dion: every rank steps every matrix on its own
      // gradients.
      // A parameter without a gradient in this step gets none either (torch.optim's rule).
      const bool mine =
          (world_ == nullptr || world_->replicated[i] || world_->plan.owner[i] == world_->rank) &&
          !run.no_grad[i];
      run.group_params[gi].push_back(run.params[i]);
      gg.push_back(mine ? run.grads[i] : nullptr);
      any = any || mine;
      run.compressed[gi] = run.compressed[gi] || (world_ != nullptr && world_->replicated[i]);
    }
    if (!any) continue;
    optim::StepOptions opts = run.opts[gi];
    // AdamW and Lion step the trainer's memory and their state in place (each byte once) only
    // where nothing after Stage can fail: a local session whose arenas cannot shrink (sealed
    // memfd regions, the daemon's own memory). A POSIX shm region can still shrink under the
    // step, and a world's exchange can fail, so there they step staged copies and a failed
    // step leaves the state unchanged (ARCHITECTURE.md §2).
    const Arenas::Binding& p = arenas_.params();
    const Arenas::Binding& gr = arenas_.grads();
    opts.in_place = world_ == nullptr && (p.region == nullptr || !p.region->can_shrink()) &&
                    (gr.region == nullptr || !gr.region->can_shrink());
    if (run.comm != nullptr) {
      opts.capture = &run.captures[gi];
      // A device session whose rules run on the device averages P and R where they are.
      if (run.compressed[gi]) {
        run.AverageReplicas(run.dcomm != nullptr && &ctx == device_->ctx.get(), &opts);
      }
    }
    absl::Status s = g.optimizer->Stage(ctx, run.group_params[gi], gg, opts);
    if (s.ok()) {
      run.staged[gi] = true;
      continue;
    }
    if (world_ == nullptr) {
      return absl::Status(s.code(), absl::StrCat("step ", request.step_index, ", group '",
                                                 Bounded(g.name), "': ", s.message()));
    }
    return absl::Status(
        absl::IsUnavailable(s) ? absl::StatusCode::kUnavailable : s.code(),
        absl::StrCat("step ", request.step_index, ", group '", Bounded(g.name), "': ",
                     absl::IsUnavailable(s) ? DescribeWorldFailure(s) : std::string(s.message())));
  }
  return absl::OkStatus();
}

void Session::WriteWeightsPhase(StepRun& run) {
  // A local device session wrote its new weights into the staging with its update
  // (DeviceSide::Stage), unless the update was staged in parts (an overlapped step).
  if (memory_->StageWritesWeights(*this) && !run.request->overlap) return;
  const absl::Time start = absl::Now();
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!run.staged[gi]) continue;
    optim::GroupOptimizer& opt = *groups_[gi].optimizer;
    opt.WriteStagedParams(run.group_params[gi]);
    // A world: this rank's share of the squared norm (a group every rank steps is counted on
    // rank 0 only).
    if (!run.compressed[gi] || world_->rank == 0) {
      run.update_sq[gi] = opt.staged_update_norm() * opt.staged_update_norm();
    }
  }
  // compute_micros: the optimizers' whole step (stage, weights, state), as GroupOptimizer::Step.
  run.result.compute_micros += absl::ToInt64Microseconds(absl::Now() - start);
}

StepResult Session::CommitStepPhase(StepRun& run) {
  const absl::Time commit_start = absl::Now();
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (run.staged[gi]) groups_[gi].optimizer->CommitStagedState();
  }
  run.result.compute_micros += absl::ToInt64Microseconds(absl::Now() - commit_start);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (!run.via_scratch[i] || !arenas_.HasMaster(i)) continue;
    memory_->CommitMaster(*this, i);
  }
  arenas_.MasterCommitted();
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    if (g.optimizer == nullptr) continue;
    // (A local group with no gradient at all in this step staged nothing: it changed nothing.)
    run.result.update_norms[g.name] = world_ != nullptr ? std::sqrt(run.update_sq[gi])
                                      : run.staged[gi]  ? g.optimizer->last_update_norm()
                                                        : 0.0;
  }
  run.result.total_micros = absl::ToInt64Microseconds(absl::Now() - run.start);
  if (!run.result.graph_fallbacks.empty()) memory_->FallbacksReported();
  last_step_index_ = run.result.step_index;
  last_result_ = run.result;
  return run.result;
}

void Session::DiscardStep(StepRun& run) {
  for (size_t gi = 0; gi < run.staged.size(); ++gi) {
    if (!run.staged[gi]) continue;
    groups_[gi].optimizer->DiscardStagedStep();
    run.staged[gi] = false;
  }
}

}  // namespace diond::session
