// The world's side of a session (docs/DISTRIBUTED.md): attaching the shard plan, the world
// phases of the one step skeleton (session_step.cc) — join, reduce the gradients, exchange the
// updates and compare checksums (the exchange is WorldExchange's, world_exchange.h) — and the
// momentum synchronization before a checkpoint. For a world
// of one (no communicator) every phase does nothing.
//
// On a device daemon a world session is a device session (session_device.h): its state, the
// staged gradients and weights live on the device and the rules run on its device Context. Its
// world phases pack, exchange and unpack in device buffers (DeviceSide::WorldBufferOf) through
// the step's StepDeviceComm (device_comm.h): the world's device communicator (NCCL) when it has
// one, else the host one (Gloo) staged through host buffers inside that communicator. Only the
// scalars the host decides on cross to the host: the non-finite flags, the update norms, the
// status values, and the compact updates that are applied through the rules' host API. The
// checksums are computed on the device and compared on the host. On the staged path the numbers
// are those of a host session, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/comm/world.h"
#include "server/session/session.h"
#include "server/session/session_device.h"
#include "server/session/session_internal.h"
#include "server/session/session_overlap.h"
#include "server/session/step_memory.h"
#include "server/session/world_exchange.h"

namespace diond::session {

absl::Status Session::AttachWorld(std::shared_ptr<WorldLink> world, ShardPlan plan, uint64_t epoch,
                                  absl::Duration verdict_wait, int64_t checksum_every) {
  absl::MutexLock lock(&mu_);
  auto part = std::make_unique<WorldPart>();
  WorldPart& w = *part;
  w.rank = world != nullptr ? world->rank() : 0;
  w.world = std::move(world);
  w.verdict_wait = verdict_wait;
  w.checksum_every = checksum_every;
  w.epoch = epoch;
  w.owned.resize(static_cast<size_t>(plan.world_size));
  w.owned_elements.assign(static_cast<size_t>(plan.world_size), 0);
  w.owned_payload.assign(static_cast<size_t>(plan.world_size), 0);
  w.compact.assign(plan.owner.size(), 0);
  w.replicated.assign(plan.owner.size(), false);
  for (size_t i = 0; i < plan.owner.size(); ++i) {
    const size_t j = static_cast<size_t>(plan.owner[i]);
    const Group& g = groups_[group_of_param_[i]];
    if (spec_.gradient_sync == GradientSync::kDionCompressed && g.optimizer != nullptr &&
        g.optimizer->config().algorithm == optim::AlgorithmKind::kDion) {
      w.replicated[i] = true;  // every rank steps it (compressed sync), nobody owns it
      continue;
    }
    if (g.optimizer != nullptr) {
      w.compact[i] = optim::CapturedUpdateSize(g.optimizer->config(), layout_.tensors[i].shape);
    }
    w.owned[j].push_back(i);
    w.owned_elements[j] += layout_.tensors[i].numel;
    w.owned_payload[j] += w.compact[i] > 0 ? w.compact[i] : layout_.tensors[i].numel;
  }
  // Shard the optimizer state: each rank keeps the state of what it owns (and of what every
  // rank steps, the compressed-sync Dion matrices); the rest is freed.
  int64_t bytes = 0;
  for (Group& g : groups_) {
    if (g.optimizer == nullptr) continue;
    std::vector<bool> keep(g.params.size());
    for (size_t slot = 0; slot < g.params.size(); ++slot) {
      const size_t i = g.params[slot];
      keep[slot] = w.replicated[i] || plan.owner[i] == w.rank;
    }
    // keep has one entry per parameter by construction; what can fail is the allocation of the
    // smaller buffers (a device pool), which changes nothing of that group.
    // The pool's last allocation error is the compute thread's (thread-local): read it there.
    std::string pool;
    absl::Status released = CallOnCompute(compute_, [&] {
      absl::Status st = g.optimizer->ReleaseState(StateContext(), keep);
      if (!st.ok()) pool = DeviceAllocationError();
      return st;
    });
    if (!released.ok()) {
      return absl::Status(released.code(),
                          absl::StrCat("world session '", Bounded(spec_.world_key),
                                       "': sharding the state of group '", Bounded(g.name),
                                       "' failed: ", released.message(),
                                       pool.empty() ? "" : absl::StrCat(" (", pool, ")")));
    }
    bytes += 4 * g.optimizer->StateFloats();
  }
  bytes += master_bytes_;  // (host vectors, or a device session's device buffer)
  state_bytes_.store(bytes);
  if (device_ != nullptr && w.world != nullptr) {
    // A device session's world buffers, made now at their final sizes: an over-budget world
    // session fails here, at creation, not in the middle of a step its peers have entered.
    const int64_t extra = 2 * static_cast<int64_t>(groups_.size()) + 1;
    int64_t total = 0, block = 0;
    for (int j = 0; j < plan.world_size; ++j) {
      total += w.owned_payload[j] + extra;
      block = std::max(block, w.owned_elements[j]);
    }
    block += 1;
    const bool reduce = spec_.gradient_sync != GradientSync::kReplicated;
    using WorldBuffer = DeviceSide::WorldBuffer;
    std::vector<std::pair<WorldBuffer, int64_t>> need = {
        {WorldBuffer::kExchangeMine, w.owned_payload[w.rank] + extra},
        {WorldBuffer::kWire, std::max(total, reduce ? block * plan.world_size : 0)}};
    if (reduce) {
      need.push_back({WorldBuffer::kReduceOut, block});
      need.push_back({WorldBuffer::kDivisor, 1});
    }
    for (const auto& [which, n] : need) {
      absl::StatusOr<float*> b = device_->WorldBufferOf(*this, which, n);
      if (!b.ok()) {
        return absl::Status(
            b.status().code(),
            absl::StrCat("world session '", Bounded(spec_.world_key), "': ", b.status().message()));
      }
    }
  }
  w.plan = std::move(plan);
  world_ = std::move(part);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Session::CheckReplicas(const kernels::Context& ctx,
                                               comm::Communicator* comm, StepDeviceComm* dcomm,
                                               int64_t step, const std::vector<float*>& params) {
  const WorldPart& w = *world_;
  const size_t n = layout_.tensors.size();
  const int world_size = w.plan.world_size;
  std::vector<uint64_t> mine(n);
  DIOND_RETURN_IF_ERROR(CallOnCompute(compute_, [&]() -> absl::Status {
    for (size_t i = 0; i < n; ++i) {  // FNV-1a 64 over the fp32 bytes, where they lie
      const kernels::ConstTensorView view(
          params[i], kernels::ContiguousLayout(DType::kF32, {layout_.tensors[i].numel}),
          ctx.device());
      DIOND_RETURN_IF_ERROR(kernels::Fnv1aChecksum(ctx, view, &mine[i]));
    }
    return absl::OkStatus();
  }));
  std::vector<uint64_t> all(n * static_cast<size_t>(world_size));
  DIOND_RETURN_IF_ERROR(comm->AllGatherBytes(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(mine.data()), n * 8),
      absl::MakeSpan(reinterpret_cast<uint8_t*>(all.data()), all.size() * 8)));
  int64_t healed = 0;
  bool broadcast = false;
  for (size_t i = 0; i < n; ++i) {
    const int owner = w.plan.owner[i];
    const uint64_t want = all[static_cast<size_t>(owner) * n + i];
    std::vector<int> differ;
    for (int r = 0; r < world_size; ++r) {
      if (all[static_cast<size_t>(r) * n + i] != want) differ.push_back(r);
    }
    if (differ.empty()) continue;
    // Every rank saw the same checksums, so every rank takes part in the same broadcasts.
    DIOND_LOG(WARNING) << "world session '" << spec_.world_key << "', step " << step
                       << ": parameter '" << layout_.tensors[i].name << "' differs on rank(s) "
                       << absl::StrJoin(differ, ", ") << " from its owner (rank " << owner
                       << "); replacing it with the owner's copy";
    const int64_t numel = layout_.tensors[i].numel;
    // A device session broadcasts on the device (dcomm), a host session on the host.
    DIOND_RETURN_IF_ERROR(
        (dcomm != nullptr ? dcomm : comm)
            ->Broadcast(absl::MakeSpan(params[i], static_cast<size_t>(numel)), owner));
    broadcast = true;
    for (int r : differ) healed += r == w.rank ? 1 : 0;
  }
  // Broadcasts queued on the session's stream would otherwise be waited for, unbounded, by the
  // step's final wait.
  if (broadcast && dcomm != nullptr) DIOND_RETURN_IF_ERROR(dcomm->WaitQueued());
  return healed;
}

std::string Session::DescribeWorldFailure(const absl::Status& why) {
  const WorldPart& w = *world_;
  std::string text(why.message());
  if (w.world == nullptr) return text;
  const absl::Time deadline = absl::Now() + w.verdict_wait;
  while (true) {
    comm::MembershipView v;
    if (!w.world->With([&](comm::World& world) { v = world.membership(); })) {
      return absl::StrCat(text, " (the daemon is shutting down)");
    }
    std::vector<std::string> lost;
    for (const comm::MemberInfo& m : v.members) {
      if (!m.live) lost.push_back(absl::StrCat("rank ", m.rank, " (", m.address, ")"));
    }
    if (!lost.empty()) {
      // The coordinator's reason names the rank already ("rank 2 (10.0.0.7) lost: ...").
      return absl::StrCat(v.broken_reason.empty() ? absl::StrCat(absl::StrJoin(lost, ", "), " lost")
                                                  : v.broken_reason,
                          " [", text, "]");
    }
    if (absl::Now() >= deadline) return text;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::Status Session::BreakWorld(StepRun& run, absl::Status why) {
  (void)run;
  if (world_ == nullptr) return why;
  world_->broken = std::move(why);
  return world_->broken;
}

absl::Status Session::JoinWorldPhase(StepRun& run) {
  if (world_ == nullptr) return absl::OkStatus();
  WorldPart& w = *world_;
  if (!w.broken.ok()) return w.broken;
  if (w.world == nullptr) return absl::OkStatus();  // a world of one
  const std::string where = absl::StrCat(run.when, ": ");
  absl::StatusOr<std::shared_ptr<comm::Communicator>> c =
      absl::UnavailableError("the daemon is shutting down");
  uint64_t epoch = 0;
  std::shared_ptr<comm::Communicator> device_comm;
  w.world->With([&](comm::World& world) {
    c = world.communicator();
    device_comm = world.device_communicator();
    epoch = world.epoch();
  });
  if (!c.ok()) return absl::UnavailableError(absl::StrCat(where, c.status().message()));
  if (epoch != w.epoch) {
    w.broken = absl::UnavailableError(
        absl::StrCat(where, "the daemon world was rebuilt (generation ", w.epoch, " -> ", epoch,
                     ") since this session was created; create it again and resume from the last "
                     "checkpoint"));
    return w.broken;
  }
  run.comm = *std::move(c);
  run.comm->TakeBytesSent();  // per-step accounting starts here
  memory_->JoinWorld(*this, run, std::move(device_comm));
  return absl::OkStatus();
}

int64_t Session::TakeWorldBytes(StepRun& run) {
  int64_t bytes = run.comm->TakeBytesSent();
  if (run.device_world_comm != nullptr) bytes += run.device_world_comm->TakeBytesSent();
  return bytes;
}

absl::Status Session::AgreeGradientsPhase(StepRun& run) {
  if (run.comm == nullptr) return absl::OkStatus();
  WorldPart& w = *world_;
  const size_t n = layout_.tensors.size();
  // One count per parameter, and the non-finite flag of this rank's trainer as seen before
  // the agreement (unchanged by it: masked gradients were never scanned; an overlapped step has
  // read none yet). Then the step's kind (overlapped, and the buckets), which every rank must
  // share.
  std::vector<float> counts(n + 1 + Overlap::kAgreementSlots);
  for (size_t i = 0; i < n; ++i) counts[i] = run.no_grad[i] ? 0.0f : 1.0f;
  counts[n] = run.finite ? 0.0f : 1.0f;
  Overlap::PutAgreement(*this, run, counts.data() + n + 1);
  absl::Status st = run.comm->AllReduceSum(absl::MakeSpan(counts));
  if (!st.ok()) {
    return BreakWorld(run, absl::UnavailableError(absl::StrCat(
                               run.when, ": agreeing on the parameters without a gradient failed: ",
                               DescribeWorldFailure(st),
                               "; create the session again and resume from the last checkpoint")));
  }
  DIOND_RETURN_IF_ERROR(Overlap::CheckAgreement(*this, run, counts.data() + n + 1));
  // A non-finite gradient on any rank skips or fails the step on every rank, also when
  // REPLICATED trainers disagree (their gradients should be identical; a rank alone would leave
  // the collectives and break the world session).
  run.finite = counts[n] == 0.0f;
  const float all = static_cast<float>(w.plan.world_size);
  const bool replicated_sync = spec_.gradient_sync == GradientSync::kReplicated;
  run.any_no_grad = false;
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] != 0.0f && counts[i] != all && (replicated_sync || w.replicated[i])) {
      // Every rank sees the same counts, so every rank fails here alike, before any change.
      return absl::FailedPreconditionError(absl::StrCat(
          run.when, ": parameter '", Bounded(layout_.tensors[i].name), "' has a gradient on ",
          static_cast<int>(counts[i]), " of ", w.plan.world_size, " ranks; ",
          replicated_sync ? "under REPLICATED" : "in a compressed Dion group",
          " every rank's trainer must name the same params_without_grad. Nothing was changed"));
    }
    // Stepped when any rank has its gradient; a rank without it contributes zeros.
    run.no_grad[i] = counts[i] == 0.0f;
    run.any_no_grad = run.any_no_grad || run.no_grad[i];
  }
  return absl::OkStatus();
}

absl::Status Session::ReduceGradientsPhase(StepRun& run) {
  if (run.comm == nullptr || spec_.gradient_sync == GradientSync::kReplicated) {
    return absl::OkStatus();
  }
  // AVERAGE: reduce-scatter the local gradients to their owners, in blocks of the largest
  // owner's gradients plus one slot for each rank's non-finite flag, in the step's memory.
  int64_t block = 0;
  for (int64_t e : world_->owned_elements) block = std::max(block, e);
  std::vector<float> summed;
  DIOND_RETURN_IF_ERROR(memory_->ReduceGradients(*this, run, world_->owned, block + 1,
                                                 {run.finite ? 0.0f : 1.0f}, &summed));
  run.finite = summed[0] == 0.0f;
  return absl::OkStatus();
}

absl::Status Session::ReduceFailed(StepRun& run, const absl::Status& why) {
  return BreakWorld(run,
                    absl::UnavailableError(absl::StrCat(
                        run.when, ": gradient reduce-scatter failed: ", DescribeWorldFailure(why),
                        "; create the session again and resume from the last checkpoint")));
}

absl::Status Session::ExchangeUpdatesPhase(StepRun& run, const kernels::Context& ctx) {
  if (world_ == nullptr) return absl::OkStatus();
  if (run.comm != nullptr) DIOND_RETURN_IF_ERROR(WorldExchange(*this, run, ctx).Run());
  if (!run.compute_status.ok()) {
    // Some groups may have been applied on some ranks: the replicas can no longer be trusted.
    return BreakWorld(run, absl::Status(run.compute_status.code(),
                                        absl::StrCat(run.when, ": ", run.compute_status.message(),
                                                     "; the world session must be created again")));
  }
  return absl::OkStatus();
}

absl::Status Session::SynchronizeForCheckpoint() {
  absl::MutexLock lock(&mu_);
  if (world_ == nullptr || world_->world == nullptr ||
      spec_.gradient_sync != GradientSync::kDionCompressed) {
    return absl::OkStatus();
  }
  WorldPart& w = *world_;
  if (!w.broken.ok()) return w.broken;
  absl::StatusOr<std::shared_ptr<comm::Communicator>> c =
      absl::UnavailableError("the daemon is shutting down");
  w.world->With([&](comm::World& world) { c = world.communicator(); });
  if (!c.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "world session '", spec_.world_key, "': momentum synchronization: ", c.status().message()));
  }
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (!w.replicated[i]) continue;
    Group& g = groups_[group_of_param_[i]];
    std::vector<float> m(static_cast<size_t>(layout_.tensors[i].numel));
    DIOND_RETURN_IF_ERROR(CallOnCompute(compute_, [&] {
      return g.optimizer->GetState(StateContext(), slot_in_group_[i], optim::kStateMomentum,
                                   absl::MakeSpan(m));
    }));
    absl::Status st = (*c)->AllReduceAverage(absl::MakeSpan(m));
    if (!st.ok()) {
      w.broken = absl::UnavailableError(
          absl::StrCat("world session '", Bounded(spec_.world_key),
                       "': momentum synchronization failed: ", st.message()));
      return w.broken;
    }
    DIOND_RETURN_IF_ERROR(CallOnCompute(compute_, [&] {
      return g.optimizer->SetState(StateContext(), slot_in_group_[i], optim::kStateMomentum, m);
    }));
  }
  (*c)->TakeBytesSent();
  return absl::OkStatus();
}

}  // namespace diond::session
