// The overlapped step (docs/DATA_PLANE.md "Overlapped step"): an asynchronous Step whose queued
// thread stages the update bucket by bucket, as the trainer's doorbells say each bucket's
// gradients are written, while its backward still produces the others.
//
// The transaction is the synchronous step's, whole: every parameter is read first (into the
// session's copies), then each rung bucket's gradients are read with their finiteness scan and,
// while all are finite, that bucket's part of every group is staged (GroupOptimizer::StagePart:
// equal to one Stage, bit for bit). Nothing is written before the last bucket: then the decision
// (skip or fail on a non-finite value anywhere), and FinishStepLocked as a synchronous step runs
// it, except that the weights reach the arena bucket by bucket (WriteBucketsPhase) in the
// reverse of the order the gradients came (the order the next forward needs them), each
// bucket's weights doorbell rung after its own write and before the commit. A failure rings -N
// on every word, those already at N included.
//
// The passes that touch memory are the session's StepMemory's (step_memory.h): a device session's
// (session_overlap_device.cc) also orders its stream with the buckets' events.
//
// The wait for a doorbell runs without the session's mutex, so that a close, a new trainer or
// the daemon's stop can cancel it (cancel_waits_). Meanwhile the step owns the session as any
// queued step does: every call that would touch its regions or state is refused or waits.
#include "server/session/session_overlap.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "server/memory/memfd_region.h"
#include "server/session/grad_clip.h"
#include "server/session/session.h"
#include "server/session/session_device.h"
#include "server/session/session_internal.h"
#include "server/session/step_memory.h"

namespace diond::session {
absl::StatusOr<std::string> Session::RegisterShmDoorbells(
    const std::string& name, int64_t offset, int64_t size,
    const std::vector<DoorbellBucket>& buckets) {
  DIOND_RETURN_IF_ERROR(memory::ValidateShmName(name));
  return Overlap::RegisterDoorbells(*this, name, offset, size, buckets, [&] {
    return memory::ShmRegion::Open(name, offset, size, id_);
  });
}

absl::StatusOr<std::string> Session::RegisterMemfdDoorbells(
    fdchannel::UniqueFd fd, int64_t offset, int64_t size,
    const std::vector<DoorbellBucket>& buckets) {
  if (absl::Status s = memory::CheckMemfd(fd.get()); !s.ok()) return s;
  const std::string name = memory::MemfdName(fd.get());
  return Overlap::RegisterDoorbells(*this, name, offset, size, buckets, [&] {
    return memory::ShmRegion::Adopt(fd.release(), "memfd", name, offset, size, id_);
  });
}

absl::StatusOr<std::string> Session::Overlap::RegisterDoorbells(
    Session& self, const std::string& name, int64_t offset, int64_t size,
    const std::vector<DoorbellBucket>& buckets,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::ShmRegion>>()> open) {
  if (offset < 0 || offset % kArenaAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("DOORBELLS: region offset ", offset,
                                                   " must be a non-negative multiple of ",
                                                   kArenaAlignment));
  }
  DIOND_ASSIGN_OR_RETURN(std::vector<std::vector<size_t>> parts, CheckBuckets(self, buckets));
  DIOND_RETURN_IF_ERROR(CheckBucketEvents(self, buckets));
  absl::MutexLock lock(&self.mu_);
  self.last_used_ = absl::Now();
  DIOND_RETURN_IF_ERROR(self.queue_.Refuse("RegisterRegion (DOORBELLS)"));
  if (self.arenas_.doorbells().region != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("DOORBELLS already has region ",
                                                      self.arenas_.doorbells().region_id,
                                                      "; unregister it first"));
  }
  // The daemon writes into the page: never over the trainer's arenas.
  for (Role r : {Role::kParameters, Role::kGradients}) {
    const memory::ShmRegion* other = self.arenas_.binding(r).region.get();
    if (other != nullptr && other->name() == name && offset < other->offset() + other->size() &&
        other->offset() < offset + size) {
      return absl::InvalidArgumentError(absl::StrCat("DOORBELLS: region [", offset, ", ",
                                                     offset + size, ") overlaps the ", RoleName(r),
                                                     " ", other->Describe()));
    }
  }
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<memory::ShmRegion> region, open());
  DIOND_ASSIGN_OR_RETURN(memory::Doorbells bells, memory::Doorbells::Attach(region.get()));
  if (static_cast<size_t>(bells.buckets()) != parts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("DOORBELLS: the request declares ", parts.size(),
                                                   " buckets; the page's header ",
                                                   bells.buckets()));
  }
  // Opened last: nothing that follows can fail (the page is free, checked above).
  DIOND_RETURN_IF_ERROR(OpenBucketEvents(self, buckets));
  return self.arenas_.BindDoorbells(std::move(region), bells, std::move(parts));
}

absl::StatusOr<std::vector<std::vector<size_t>>> Session::Overlap::CheckBuckets(
    const Session& self, const std::vector<DoorbellBucket>& buckets) {
  const size_t n = self.layout_.tensors.size();
  std::vector<size_t> bucket_of(n, buckets.size());  // buckets.size(): none yet
  std::vector<std::vector<size_t>> out(buckets.size());
  for (size_t k = 0; k < buckets.size(); ++k) {
    if (buckets[k].params.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DOORBELLS: buckets[", k, "] is empty; every bucket holds at least one parameter"));
    }
    for (int32_t p : buckets[k].params) {
      if (p < 0 || static_cast<size_t>(p) >= n) {
        return absl::InvalidArgumentError(absl::StrCat("DOORBELLS: buckets[", k, "] names index ",
                                                       p, ", not a parameter of the session (", n,
                                                       " parameters)"));
      }
      const size_t i = static_cast<size_t>(p);
      if (bucket_of[i] != buckets.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("DOORBELLS: parameter ", i, " ('", Bounded(self.layout_.tensors[i].name),
                         "') is in buckets[", bucket_of[i], "] and buckets[", k,
                         "]; each parameter is in exactly one bucket"));
      }
      bucket_of[i] = k;
      out[k].push_back(i);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (bucket_of[i] == buckets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("DOORBELLS: parameter ", i, " ('", Bounded(self.layout_.tensors[i].name),
                       "') is in no bucket; each parameter is in exactly one bucket"));
    }
  }
  return out;
}

absl::Status Session::Overlap::ValidateOverlapLocked(Session& self, const StepRequest& request) {
  const std::string when = absl::StrCat("step ", request.step_index, ": overlap");
  if (!request.asynchronous) {
    return absl::InvalidArgumentError(
        absl::StrCat(when,
                     " needs asynchronous = true (the queued step waits for the buckets' doorbells "
                     "while the trainer's backward runs)"));
  }
  if (!request.ready_event.empty() || !request.done_event.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        when, " takes its events from the doorbell page's buckets, not ready_event / done_event"));
  }
  const Arenas::DoorbellPage& page = self.arenas_.doorbells();
  if (page.region == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        when,
        " needs a doorbell page: register a REGION_ROLE_DOORBELLS region with the buckets "
        "first"));
  }
  if (absl::Status s = page.region->CheckIntact(); !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(when, ": the DOORBELLS ", s.message(), "; nothing was changed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Session::Overlap::OverlappedStepLocked(
    Session& self, StepRun& run, const kernels::Context& update_ctx) {
  const memory::Doorbells bells = *self.arenas_.doorbells().bells;
  const int64_t step = run.request->step_index;
  std::vector<int> order;  // the buckets as they were rung
  absl::StatusOr<StepResult> r = self.world_ != nullptr
                                     ? WorldPhases(self, run, update_ctx, &order)
                                     : OverlappedPhases(self, run, update_ctx, &order);
  if (!r.ok()) {
    // Nothing was committed; the trainer's waits learn it now rather than at their deadline.
    // (Buckets rung N by a write-back that failed later flip to -N.)
    bells.FailWeights(step);
    return r;
  }
  // A skipped step's weights are as they were: the next forward may go on, every bucket at once.
  if (r->skipped) {
    for (int k = 0; k < bells.buckets(); ++k) bells.RingWeights(k, step);
  }
  return r;
}

absl::StatusOr<StepResult> Session::Overlap::OverlappedPhases(Session& self, StepRun& run,
                                                              const kernels::Context& update_ctx,
                                                              std::vector<int>* order) {
  DIOND_RETURN_IF_ERROR(BeginOverlapPhase(self, run, update_ctx));
  const size_t buckets = self.arenas_.doorbells().buckets.size();
  std::vector<bool> taken(buckets, false);
  for (size_t done = 0; done < buckets; ++done) {
    absl::StatusOr<int> k = WaitForBucketPhase(self, run, taken);
    absl::Status s = k.status();
    if (k.ok()) {
      taken[static_cast<size_t>(*k)] = true;
      order->push_back(*k);
      s = StageBucketPhase(self, run, static_cast<size_t>(*k));
    }
    if (!s.ok()) {
      self.DiscardStep(run);
      return s;
    }
  }
  // Under a clip the buckets were only read: the coef needed them all (grad_clip.h).
  if (absl::Status s = run.clip ? Clip::ApplyAndStage(self, run) : absl::OkStatus(); !s.ok()) {
    self.DiscardStep(run);
    return s;
  }
  if (!run.finite) {
    self.DiscardStep(run);
    if (self.spec_.non_finite == NonFinitePolicy::kError) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", run.request->step_index,
                       ": gradients contain NaN or Inf (non_finite_policy=ERROR)"));
    }
    // The weights are as they were: every bucket's done event, then (the caller) its word.
    DIOND_RETURN_IF_ERROR(self.memory_->RecordBucketsDone(self));
    return self.SkipStepLocked(run);
  }
  run.write_weights = [&self, &run, order] { return WriteBucketsPhase(self, run, *order); };
  return self.FinishStepLocked(run, update_ctx);
}

absl::Status Session::Overlap::BeginOverlapPhase(Session& self, StepRun& run,
                                                 const kernels::Context& update_ctx) {
  self.memory_->BeginBuckets(self, run);
  // The weights first: the trainer does not write them during its backward. Into the
  // session's copies, even fp32 ones: the rules write a group's new weights at once, and the
  // arena takes them bucket by bucket (WriteBucketsPhase).
  run.params_via_scratch = true;
  DIOND_RETURN_IF_ERROR(
      CallOnCompute(self.compute_, [&] { return self.memory_->ReadParameters(self, run); }));
  DIOND_RETURN_IF_ERROR(self.arenas_.CheckRegions(run.when));
  self.InitGroupRuns(run);
  for (size_t gi = 0; gi < self.groups_.size(); ++gi) {
    Group& g = self.groups_[gi];
    if (g.optimizer == nullptr) continue;
    bool any = false;
    for (size_t i : g.params) {
      run.group_params[gi].push_back(run.params[i]);
      // A world: each rank stages what it owns, and every rank compressed Dion (StageGroups).
      const WorldPart* w = self.world_.get();
      const bool mine = w == nullptr || w->replicated[i] || w->plan.owner[i] == w->rank;
      any = any || (mine && !run.no_grad[i]);
      run.compressed[gi] = run.compressed[gi] || (w != nullptr && w->replicated[i]);
    }
    if (!any) continue;  // as Stage: a group without any gradient stages nothing
    // Never in place (opts.in_place false): a later bucket can still fail the step.
    optim::StepOptions opts = run.opts[gi];
    if (run.comm != nullptr) {
      opts.capture = &run.captures[gi];  // the owners' compact updates
      // Every rank stages the buckets in the same order (WorldPhases), so each part's averages
      // of P and R meet the others' parts.
      if (run.compressed[gi]) {
        run.AverageReplicas(run.dcomm != nullptr && &update_ctx == self.device_->ctx.get(), &opts);
      }
    }
    absl::Status s = CallOnCompute(self.compute_,
                                   [&] { return g.optimizer->BeginStagedStep(update_ctx, opts); });
    if (!s.ok()) {
      self.DiscardStep(run);
      return absl::Status(s.code(),
                          absl::StrCat(run.when, ", group '", Bounded(g.name), "': ", s.message()));
    }
    run.staged[gi] = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Session::Overlap::WaitForBucketPhase(Session& self, StepRun& run,
                                                         const std::vector<bool>& taken) {
  const memory::Doorbells bells = *self.arenas_.doorbells().bells;
  const int64_t generation = self.queued_cancel_gen_;
  // --overlap_bucket_timeout: far longer than any backward, so only a trainer that stopped meets
  // it (a closed session cancels the wait at once).
  const absl::Time deadline = absl::Now() + run.request->overlap_bucket_wait;
  // Without the mutex: the calls that would touch what the step reads are refused while it is
  // queued, and DrainQueuedStep must be able to cancel the wait.
  self.in_doorbell_wait_ = true;
  self.mu_.Unlock();
  absl::StatusOr<int> k = bells.WaitAnyGradients(taken, run.request->step_index, deadline, [&] {
    return self.cancel_waits_.load() != generation;
  });
  self.mu_.Lock();
  self.in_doorbell_wait_ = false;
  if (k.ok()) return k;
  return absl::Status(k.status().code(),
                      absl::StrCat(run.when, ": ", k.status().message(),
                                   "; nothing was committed (the weights doorbells say -",
                                   run.request->step_index, ")"));
}

absl::Status Session::Overlap::WriteBucketsPhase(Session& self, StepRun& run,
                                                 const std::vector<int>& order) {
  const Arenas::DoorbellPage& page = self.arenas_.doorbells();
  const memory::Doorbells bells = *page.bells;
  const memory::ShmRegion* params = self.arenas_.params().region.get();
  // The order the next forward needs them: the reverse of backward's.
  for (auto k = order.rbegin(); k != order.rend(); ++k) {
    const size_t b = static_cast<size_t>(*k);
    DIOND_RETURN_IF_ERROR(self.memory_->WriteWeightsOf(self, run, b, page.buckets[b]));
    if (params != nullptr && !params->CheckIntact().ok()) return absl::OkStatus();
    bells.RingWeights(*k, run.request->step_index);
  }
  return absl::OkStatus();
}

absl::Status Session::Overlap::StageBucketPhase(Session& self, StepRun& run, size_t k) {
  const std::vector<size_t>& params = self.arenas_.doorbells().buckets[k];
  DIOND_RETURN_IF_ERROR(CallOnCompute(
      self.compute_, [&] { return self.memory_->ReadGradientsOf(self, run, k, params); }));
  // A non-finite value decides the step (skip or fail) once every bucket is in: nothing more
  // is staged.
  if (!run.finite) return absl::OkStatus();
  if (run.clip) return absl::OkStatus();  // staged after the last bucket (Clip::ApplyAndStage)
  return StagePartsPhase(self, run, params);
}

absl::Status Session::Overlap::StagePartsPhase(Session& self, StepRun& run,
                                               const std::vector<size_t>& params) {
  // Per group: these gradients in the group's order, null for its other parameters.
  std::vector<std::vector<const float*>> part(self.groups_.size());
  for (size_t i : params) {
    const size_t gi = self.group_of_param_[i];
    if (run.no_grad[i] || run.grads[i] == nullptr || !run.staged[gi]) continue;
    if (part[gi].empty()) part[gi].assign(self.groups_[gi].params.size(), nullptr);
    part[gi][self.slot_in_group_[i]] = run.grads[i];
  }
  const absl::Time start = absl::Now();
  absl::Status s = CallOnCompute(self.compute_, [&]() -> absl::Status {
    for (size_t gi = 0; gi < part.size(); ++gi) {
      if (part[gi].empty()) continue;
      absl::Status st = self.groups_[gi].optimizer->StagePart(run.group_params[gi], part[gi]);
      if (!st.ok()) {
        return absl::Status(st.code(),
                            absl::StrCat(run.when, ", group '", Bounded(self.groups_[gi].name),
                                         "': ", st.message()));
      }
    }
    return absl::OkStatus();
  });
  run.result.compute_micros += absl::ToInt64Microseconds(absl::Now() - start);
  return s;
}

}  // namespace diond::session
