// A world session's overlapped step (docs/DISTRIBUTED.md "Overlapped step"). Every rank takes
// the buckets in their declaration order, whatever order its trainer rings them in, so that the
// per-bucket collectives match across the ranks: per bucket, the wait for its doorbell, the read
// with its finiteness scan, under AVERAGE (and DION_COMPRESSED) one reduce-scatter of its
// gradients to their owners (blocks padded as ReduceGradients pads the whole step's, plus two
// slots: the non-finite flag and a give-up flag), then the owners stage their part of every
// group, and every rank its compressed Dion matrices (their P and R averaged inside the part),
// then the exchange of the bucket's updates. After the last bucket
// one small all-reduce of every rank's give-up and non-finite flags decides the step alike on
// every rank; then the whole step's exchange and the write-back bucket by bucket
// (FinishStepLocked), as the synchronous world step does. Under max_grad_norm the buckets are only
// read (and reduced) as they ring, and clipped and staged after the last (the coef needs them
// all).
//
// A rank that gives up (its trainer abandons the step, its wait times out or is cancelled, a
// read or a part fails) does not leave the collectives: it still joins the current bucket's
// reduce-scatter, with its give-up flag set, and every rank stops there; under REPLICATED it goes
// straight to the final all-reduce. Every rank then fails the step with nothing committed and
// the world session stays usable. A collective that fails (a peer lost, or Gloo's timeout
// because a peer waited for its doorbell longer than --peer_timeout) breaks the world session,
// as in a synchronous step.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/grad_clip.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"
#include "server/session/session_overlap.h"
#include "server/session/step_memory.h"
#include "server/session/world_exchange.h"

namespace diond::session {
namespace {

constexpr int kChunks = 16;  // the fingerprint's 4-bit chunks

// FNV-1a 64 over the bucket declaration (count, sizes, indices).
uint64_t Fingerprint(const std::vector<std::vector<size_t>>& buckets) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(buckets.size());
  for (const std::vector<size_t>& b : buckets) {
    mix(b.size());
    for (size_t i : b) mix(i);
  }
  return h;
}

}  // namespace

// The step's kind: the overlap flag, then per 4-bit chunk of the buckets' fingerprint the chunk
// and its square. Sums of small integers are exact, and all ranks agree iff every chunk's
// W·Σc² equals (Σc)².
void Session::Overlap::PutAgreement(const Session& self, const StepRun& run, float* slots) {
  std::fill(slots, slots + kAgreementSlots, 0.0f);
  if (!run.request->overlap) return;
  slots[0] = 1.0f;
  const uint64_t f = Fingerprint(self.arenas_.doorbells().buckets);
  for (int c = 0; c < kChunks; ++c) {
    const float v = static_cast<float>((f >> (4 * c)) & 0xf);
    slots[1 + c] = v;
    slots[1 + kChunks + c] = v * v;
  }
}

absl::Status Session::Overlap::CheckAgreement(const Session& self, const StepRun& run,
                                              const float* sums) {
  const float w = static_cast<float>(self.world_->plan.world_size);
  std::string why;
  if (sums[0] != 0.0f && sums[0] != w) {
    why = absl::StrCat("the overlapped step was asked on ", static_cast<int>(sums[0]), " of ",
                       self.world_->plan.world_size,
                       " ranks; every rank's trainer must ask the same (overlap on all or none)");
  } else {
    for (int c = 0; c < kChunks && why.empty(); ++c) {
      if (w * sums[1 + kChunks + c] != sums[1 + c] * sums[1 + c]) {
        why =
            "the ranks' doorbell buckets differ; every rank's trainer must declare the same "
            "buckets (the same parameters, in the same order)";
      }
    }
  }
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(run.when, ": ", why, ". Nothing was changed"));
}

absl::StatusOr<StepResult> Session::Overlap::WorldPhases(Session& self, StepRun& run,
                                                         const kernels::Context& update_ctx,
                                                         std::vector<int>* order) {
  DIOND_RETURN_IF_ERROR(self.JoinWorldPhase(run));
  // This rank's trainer's gradients are read, not those the agreement adds (zeros under AVERAGE).
  const std::vector<bool> local_no_grad = run.no_grad;
  DIOND_RETURN_IF_ERROR(self.AgreeGradientsPhase(run));
  const std::vector<std::vector<size_t>>& buckets = self.arenas_.doorbells().buckets;
  // (Under DION_COMPRESSED the groups other than Dion are averaged as under AVERAGE.)
  const bool reduce = run.comm != nullptr && self.spec_.gradient_sync != GradientSync::kReplicated;
  absl::Status mine = BeginOverlapPhase(self, run, update_ctx);  // this rank's first failure
  // Under a clip the buckets are only read (and reduced): the coef needs them all.
  const bool clip = run.clip || run.clip_averaged;
  // Each bucket's updates are exchanged once staged, until a rank has nothing to send (a
  // non-finite value) or under a clip (then the step's exchange, after the decision).
  bool exchanging = run.comm != nullptr && !clip;
  bool stopped = false;  // some rank gave up (every rank knows it alike, but on REPLICATED
                         // without a per-bucket collective: then each rank knows its own)
  for (size_t k = 0; k < buckets.size() && !stopped; ++k) {
    std::vector<bool> taken(buckets.size(), true);
    taken[k] = false;  // the declaration's order, on every rank
    if (mine.ok()) mine = WaitForBucketPhase(self, run, taken).status();
    if (mine.ok()) {
      std::vector<size_t> given;
      for (size_t i : buckets[k]) {
        if (!local_no_grad[i]) given.push_back(i);
      }
      mine = CallOnCompute(self.compute_,
                           [&] { return self.memory_->ReadGradientsOf(self, run, k, given); });
    }
    if (reduce) {
      bool gave_up = false;
      if (absl::Status s = ReduceBucketPhase(self, run, k, !mine.ok(), &gave_up); !s.ok()) {
        self.DiscardStep(run);
        return s;
      }
      stopped = gave_up;
    } else if (!exchanging) {
      stopped = !mine.ok();
    }
    if (stopped) break;
    order->push_back(static_cast<int>(k));
    // A non-finite value: decided after the last bucket; nothing more is staged.
    if (mine.ok() && run.finite && !clip) {
      mine = StagePartsPhase(self, run, OwnedOf(self, buckets[k]));
    }
    if (exchanging) {
      bool gave_up = false;
      if (absl::Status s = ExchangeBucketPhase(self, run, update_ctx, k, &mine, &gave_up);
          !s.ok()) {
        self.DiscardStep(run);
        return s;
      }
      stopped = gave_up;
      exchanging = run.finite;
    }
  }
  run.updates_exchanged = exchanging && !stopped;
  if (clip && !stopped && mine.ok()) mine = ClipAndStagePhase(self, run);
  return DecideWorldPhase(self, run, update_ctx, mine, *order);
}

std::vector<size_t> Session::Overlap::OwnedOf(const Session& self,
                                              const std::vector<size_t>& params) {
  const WorldPart& w = *self.world_;
  std::vector<size_t> owned;
  for (size_t i : params) {
    if (w.replicated[i] || w.plan.owner[i] == w.rank) owned.push_back(i);
  }
  return owned;
}

absl::Status Session::Overlap::ClipAndStagePhase(Session& self, StepRun& run) {
  // Of the averaged gradients, a collective every rank joins here alike; else each rank's own.
  DIOND_RETURN_IF_ERROR(run.clip_averaged
                            ? Clip::ApplyAveraged(self, run)
                            : CallOnCompute(self.compute_, [&] { return Clip::Apply(self, run); }));
  if (!run.finite) return absl::OkStatus();  // the step's decision follows
  std::vector<size_t> all(self.layout_.tensors.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return StagePartsPhase(self, run, OwnedOf(self, all));
}

absl::Status Session::Overlap::ReduceBucketPhase(Session& self, StepRun& run, size_t k,
                                                 bool give_up, bool* gave_up) {
  const WorldPart& w = *self.world_;
  const std::vector<size_t>& bucket = self.arenas_.doorbells().buckets[k];
  // Block j: rank j's parameters of the bucket, in the bucket's order, then the two flags.
  std::vector<std::vector<size_t>> of(static_cast<size_t>(w.plan.world_size));
  std::vector<int64_t> elements(of.size(), 0);
  for (size_t i : bucket) {
    if (w.replicated[i]) continue;  // compressed Dion: each rank steps its own gradient
    const size_t j = static_cast<size_t>(w.plan.owner[i]);
    of[j].push_back(i);
    elements[j] += self.layout_.tensors[i].numel;
    // A rank that gives up sends zeros: what it read may be gone (a shrunk region).
    if (give_up) run.grads[i] = nullptr;
  }
  const int64_t block = *std::max_element(elements.begin(), elements.end()) + 2;
  std::vector<float> summed;
  DIOND_RETURN_IF_ERROR(self.memory_->ReduceGradients(
      self, run, of, block, {run.finite ? 0.0f : 1.0f, give_up ? 1.0f : 0.0f}, &summed));
  *gave_up = summed[1] != 0.0f;
  if (!*gave_up) run.finite = run.finite && summed[0] == 0.0f;
  return absl::OkStatus();
}

absl::Status Session::Overlap::ExchangeBucketPhase(Session& self, StepRun& run,
                                                   const kernels::Context& update_ctx, size_t k,
                                                   absl::Status* mine, bool* gave_up) {
  const WorldPart& w = *self.world_;
  const std::vector<size_t>& bucket = self.arenas_.doorbells().buckets[k];
  const size_t world_size = static_cast<size_t>(w.plan.world_size);
  const size_t me = static_cast<size_t>(w.rank);
  auto size_of = [&](size_t i) {
    return w.compact[i] > 0 ? w.compact[i] : self.layout_.tensors[i].numel;
  };
  auto broken = [&](const absl::Status& st) {
    return self.BreakWorld(
        run, absl::UnavailableError(
                 absl::StrCat(run.when, ": exchange of bucket ", k,
                              "'s updates failed: ", self.DescribeWorldFailure(st),
                              "; create the session again and resume from the last checkpoint")));
  };
  // Compressed Dion is computed on every rank: nothing to send.
  std::vector<size_t> sent;
  for (size_t i : bucket) {
    if (!w.replicated[i]) sent.push_back(i);
  }
  // Block j: rank j's parameters of the bucket in the bucket's order, then its flag; in the
  // step's memory (a device session's: its device, over its device collectives).
  std::vector<int64_t> counts(world_size, 1), begin(world_size, 0);
  for (size_t i : sent) counts[static_cast<size_t>(w.plan.owner[i])] += size_of(i);
  for (size_t j = 1; j < world_size; ++j) begin[j] = begin[j - 1] + counts[j - 1];
  const int64_t total = begin.back() + counts.back();
  absl::StatusOr<std::unique_ptr<ExchangeWire>> made =
      self.memory_->MakeExchangeWire(self, run, counts[me], total);
  if (!made.ok()) return broken(made.status());
  ExchangeWire& wire = **made;
  constexpr float kSent = 0.0f, kGaveUp = 1.0f, kNothing = 2.0f;
  float flag = !mine->ok() ? kGaveUp : !run.finite ? kNothing : kSent;
  if (flag == kSent) {
    int64_t at = 0;
    absl::Status s;
    for (size_t i : sent) {
      if (w.plan.owner[i] != w.rank) continue;
      const size_t gi = self.group_of_param_[i];
      const size_t slot = self.slot_in_group_[i];
      if (run.no_grad[i]) {
        // Not stepped on any rank: its slot is sent but never read.
      } else if (w.compact[i] > 0) {
        const std::vector<std::vector<float>>& payload = run.captures[gi].payload;
        s = payload.size() > slot && static_cast<int64_t>(payload[slot].size()) == w.compact[i]
                ? wire.PutHost(payload[slot].data(), at, w.compact[i])
                : absl::InternalError(absl::StrCat("no compact update captured for '",
                                                   Bounded(self.layout_.tensors[i].name), "'"));
      } else {
        s = CallOnCompute(self.compute_, [&] {
          return self.groups_[gi].optimizer->CopyStagedParam(slot, wire.mine() + at);
        });
      }
      if (!s.ok()) break;
      at += size_of(i);
    }
    if (!s.ok()) {
      *mine = absl::Status(
          s.code(), absl::StrCat(run.when, ": sending bucket ", k, "'s updates: ", s.message()));
      flag = kGaveUp;
    }
  }
  absl::Status st = wire.PutHost(&flag, counts[me] - 1, 1);
  if (st.ok()) {
    st = wire.comm().AllGatherV(absl::MakeConstSpan(wire.mine(), static_cast<size_t>(counts[me])),
                                counts, absl::MakeSpan(wire.all(), static_cast<size_t>(total)));
  }
  bool nothing = false;
  for (size_t j = 0; j < world_size && st.ok(); ++j) {
    absl::StatusOr<absl::Span<const float>> f = wire.GetHost(begin[j] + counts[j] - 1, 1);
    st = f.status();
    if (!st.ok()) break;
    *gave_up = *gave_up || (*f)[0] == kGaveUp;
    nothing = nothing || (*f)[0] == kNothing;
  }
  if (st.ok()) st = wire.Settled();
  if (!st.ok()) return broken(st);
  if (*gave_up) return absl::OkStatus();
  if (nothing) {  // a rank met a non-finite value: the step is skipped or failed on every rank
    run.finite = false;
    return absl::OkStatus();
  }
  // The others' updates into this rank's copies (the arena takes them after the decision).
  for (size_t j = 0; j < world_size && mine->ok(); ++j) {
    if (j == me) continue;
    int64_t at = begin[j];
    for (size_t i : sent) {
      if (static_cast<size_t>(w.plan.owner[i]) != j) continue;
      const TensorPlacement& t = self.layout_.tensors[i];
      absl::Status s;
      if (run.no_grad[i]) {
      } else if (w.compact[i] > 0) {
        // Through the rules' own code: the owner's bits (WorldExchange does the same).
        absl::StatusOr<absl::Span<const float>> payload = wire.GetHost(at, w.compact[i]);
        s = payload.status();
        if (s.ok()) {
          const size_t gi = self.group_of_param_[i];
          s = CallOnCompute(self.compute_, [&] {
            return optim::ApplyCapturedUpdate(update_ctx, self.groups_[gi].optimizer->config(),
                                              t.shape, run.opts[gi], *payload, run.params[i]);
          });
        }
      } else {
        s = wire.GetStep(at, run.params[i], t.numel);
      }
      if (!s.ok()) {
        *mine = absl::Status(s.code(),
                             absl::StrCat(run.when, ": applying the update of '", Bounded(t.name),
                                          "' from rank ", j, ": ", s.message()));
        break;
      }
      at += size_of(i);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Session::Overlap::DecideWorldPhase(Session& self, StepRun& run,
                                                              const kernels::Context& update_ctx,
                                                              const absl::Status& mine,
                                                              const std::vector<int>& order) {
  const int world_size = self.world_->plan.world_size;
  // Per rank: gave up, non-finite; every rank decides on the same sums.
  std::vector<float> flags(2 * static_cast<size_t>(world_size), 0.0f);
  const size_t me = static_cast<size_t>(self.world_->rank);
  flags[me] = mine.ok() ? 0.0f : 1.0f;
  flags[static_cast<size_t>(world_size) + me] = run.finite ? 0.0f : 1.0f;
  if (run.comm != nullptr) {
    if (absl::Status st = run.comm->AllReduceSum(absl::MakeSpan(flags)); !st.ok()) {
      self.DiscardStep(run);
      return self.BreakWorld(
          run, absl::UnavailableError(
                   absl::StrCat(run.when, ": agreeing on the overlapped step's outcome failed: ",
                                self.DescribeWorldFailure(st),
                                "; create the session again and resume from the last checkpoint")));
    }
  }
  std::vector<int> gave_up;
  bool finite = true;
  for (int j = 0; j < world_size; ++j) {
    if (flags[static_cast<size_t>(j)] != 0.0f) gave_up.push_back(j);
    finite = finite && flags[static_cast<size_t>(world_size) + static_cast<size_t>(j)] == 0.0f;
  }
  if (!gave_up.empty()) {
    self.DiscardStep(run);
    if (!mine.ok()) return mine;
    return absl::AbortedError(absl::StrCat(
        run.when, ": the overlapped step was given up on rank(s) ", absl::StrJoin(gave_up, ", "),
        " (see their answers); nothing was committed (the weights doorbells say -",
        run.request->step_index, "): retry step ", run.request->step_index));
  }
  if (!finite) {
    self.DiscardStep(run);
    if (self.spec_.non_finite == NonFinitePolicy::kError) {
      return absl::InvalidArgumentError(
          absl::StrCat(run.when, ": gradients contain NaN or Inf (non_finite_policy=ERROR)"));
    }
    // The weights are as they were: every bucket's done event, then (the caller) its word.
    DIOND_RETURN_IF_ERROR(self.memory_->RecordBucketsDone(self));
    return self.SkipStepLocked(run);
  }
  run.write_weights = [&self, &run, &order] { return WriteBucketsPhase(self, run, order); };
  return self.FinishStepLocked(run, update_ctx);
}

}  // namespace diond::session
