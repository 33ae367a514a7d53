#include "server/session/session_manager.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/comm/key_value_store.h"
#include "server/comm/world.h"
#include "server/session/layout.h"
#include "server/session/world_plan.h"

namespace diond::session {
namespace {

// Refuses, before anything is allocated, a session whose optimizer state cannot fit in this
// host's memory at all. An upper bound is enough for that: every state tensor is counted at its
// parameter's size (momentum and variance are; variance_neuron, Q and step_dev are smaller).
// Without it a huge but representable shape (e.g. [2^31, 2^20]) made CreateGroupOptimizer throw
// std::bad_alloc, which gRPC answered as an empty UNIMPLEMENTED, and a shape just below the
// address-space limit would get the daemon OOM-killed. Specs that Session::Create rejects
// anyway (bad shapes, unknown groups) pass through so that their own message wins.
absl::Status CheckStateFitsInMemory(const SessionSpec& spec) {
  if (!ComputeLayout(spec.params).ok()) return absl::OkStatus();
  std::map<std::string, optim::AlgorithmKind> algorithm;
  for (const GroupSpec& g : spec.groups) algorithm.emplace(g.name, g.config.algorithm);
  double bytes = 0;  // double: the bound itself may exceed int64
  for (const ParamSpec& p : spec.params) {
    auto it = algorithm.find(p.group);
    if (it == algorithm.end()) continue;
    double numel = 1;
    for (int64_t d : p.shape) numel *= static_cast<double>(d);
    bytes += 4.0 * numel * static_cast<double>(optim::StateNames(it->second).size());
    if (spec.fp32_master_weights && p.dtype != DType::kF32) bytes += 4.0 * numel;
  }
  const double host =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (host > 0 && bytes > host) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "session needs up to %.0f bytes of optimizer state; this host has %.0f bytes of memory",
        bytes, host));
  }
  return absl::OkStatus();
}

}  // namespace

SessionManager::SessionManager(const ManagerOptions& options, ManagerObserver observer)
    : options_(options), observer_(std::move(observer)) {}

absl::StatusOr<std::unique_ptr<SessionManager>> SessionManager::Create(
    const ManagerOptions& options, ManagerObserver observer) {
  if (options.orphan_grace < absl::ZeroDuration() ||
      options.orphan_grace_named < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--orphan_grace (", absl::FormatDuration(options.orphan_grace),
                     ") and --orphan_grace_named (",
                     absl::FormatDuration(options.orphan_grace_named), ") must be >= 0"));
  }
  if (options.checkpoint_every < 0 || options.checksum_every < 0 || options.max_session_bytes < 0 ||
      options.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError("checkpoint_every and byte limits must be >= 0");
  }
  if (options.checkpoint_every > 0 && options.state_dir.empty()) {
    return absl::InvalidArgumentError("--checkpoint_every needs --state_dir");
  }
  if (options.keep_checkpoints < 0) {
    return absl::InvalidArgumentError("--keep_checkpoints must be >= 0");
  }
  if (options.recover && options.state_dir.empty()) {
    return absl::InvalidArgumentError("--recover needs --state_dir");
  }
  if (!options.state_dir.empty() && options.checkpoints == nullptr) {
    return absl::InvalidArgumentError("--state_dir needs a checkpoint store (ManagerOptions)");
  }
  std::unique_ptr<SessionManager> m(new SessionManager(options, std::move(observer)));
  kernels::ContextOptions co;
  co.num_threads = options.compute_threads;
  co.device = options.compute_device;
  DIOND_ASSIGN_OR_RETURN(m->ctx_, kernels::Context::Create(co));
  if (const kernels::DeviceRuntime* r = kernels::FindDeviceRuntime(co.device.type); r != nullptr) {
    m->runtime_ = *r;
    if (!options.step_graphs) {
      m->runtime_.begin_capture = nullptr;
      m->runtime_.end_capture = nullptr;
      m->runtime_.launch_graph = nullptr;
      m->runtime_.destroy_graph = nullptr;
    }
  }
  if (!options.state_dir.empty()) {
    const int64_t removed = options.checkpoints->RemoveStaleTemporaries();
    if (removed > 0) {
      DIOND_LOG(INFO) << "removed " << removed << " stale temporary checkpoint director"
                      << (removed == 1 ? "y" : "ies") << " under " << options.state_dir
                      << " (left by a daemon that died while writing)";
    }
    if (options.recover) m->RecoverSessions();
  }
  // One reaper thread for idle and orphan sessions, looking at least four times per timeout, and
  // every second for the trainers gone in an overlapped step (ReapOrphanSessions).
  absl::Duration period = absl::Seconds(1);
  for (absl::Duration d :
       {options.idle_timeout, options.orphan_grace, options.orphan_grace_named}) {
    if (d > absl::ZeroDuration()) period = std::min(period, d / 4);
  }
  {
    SessionManager* self = m.get();
    m->reaper_ = std::thread([self, period] {
      while (!self->stop_.WaitForNotificationWithTimeout(period)) {
        self->ReapIdleSessions(absl::Now());
        self->ReapOrphanSessions(absl::Now());
      }
    });
  }
  return m;
}

SessionManager::~SessionManager() {
  stop_.Notify();
  if (reaper_.joinable()) reaper_.join();
  DrainQueuedSteps();
}

std::string SessionManager::NewId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("s-%016x", rng());
}

absl::Status SessionManager::CheckBudget(int64_t bytes, absl::string_view what) {
  if (options_.max_session_bytes > 0 && bytes > options_.max_session_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("session needs ", bytes, " bytes (", what,
                                                     "); --max_session_bytes is ",
                                                     options_.max_session_bytes));
  }
  if (options_.memory_budget_bytes > 0) {
    int64_t used = 0;
    for (auto& [id, s] : sessions_) used += s->BudgetBytes();
    if (used + bytes > options_.memory_budget_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session needs ", bytes, " bytes (", what, "); ", used, " of the ",
                       options_.memory_budget_bytes,
                       "-byte memory budget (--memory_budget_bytes) are in use by ",
                       sessions_.size(), " session(s)"));
    }
  }
  return absl::OkStatus();
}

void SessionManager::AttachWorld(comm::World* world, comm::KeyValueStore* kv,
                                 absl::Duration verdict_wait) {
  absl::MutexLock lock(&mu_);
  world_ = world != nullptr ? std::make_shared<WorldLink>(world) : nullptr;
  kv_ = kv;
  verdict_wait_ = verdict_wait;
}

void SessionManager::DetachWorld() {
  absl::MutexLock lock(&mu_);
  if (world_ != nullptr) world_->Clear();
  world_detached_ = true;
}

absl::StatusOr<ShardPlan> SessionManager::AgreeOnPlan(const SessionSpec& spec, uint64_t* epoch) {
  const std::string& key = spec.world_key;
  DIOND_RETURN_IF_ERROR(ValidateWorldKey(key));
  std::shared_ptr<WorldLink> world;
  comm::KeyValueStore* kv;
  {
    absl::MutexLock lock(&mu_);
    if (world_detached_) return absl::UnavailableError("the daemon is shutting down");
    world = world_;
    kv = kv_;
  }
  *epoch = 0;
  if (world == nullptr) return ComputeShardPlan(spec, 1);  // a world of one
  const std::string where = absl::StrCat("world session '", Bounded(key), "' (rank ", world->rank(),
                                         " of ", world->size(), "): ");
  DIOND_ASSIGN_OR_RETURN(*epoch, WaitForWorld(*world, options_.world_session_timeout, where));
  int64_t use = 0;
  {
    // Counted per generation: after a rebuild (a restarted rank starts from nothing) every rank
    // counts from 1 again.
    absl::MutexLock lock(&mu_);
    use = ++world_key_uses_[absl::StrCat(*epoch, "/", key)];
  }
  DIOND_ASSIGN_OR_RETURN(ShardPlan plan, ComputeShardPlan(spec, world->size()));
  if (kv == nullptr) return absl::InternalError(absl::StrCat(where, "no rendezvous store"));
  DIOND_RETURN_IF_ERROR(
      AgreeOnShardPlan(plan, *world, *kv, *epoch, key, use, options_.world_session_timeout, where));
  return plan;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::CreateSession(SessionSpec spec,
                                                                       const ProcessId& creator) {
  DIOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, CreateSessionWithId(NewId(), std::move(spec)));
  TrackProcess(s->id(), creator, /*binds=*/true);
  return s;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::CreateSessionWithId(std::string id,
                                                                             SessionSpec spec) {
  if (!spec.session_name.empty()) {
    DIOND_RETURN_IF_ERROR(ValidateSessionName(spec.session_name));
    absl::MutexLock lock(&mu_);
    auto it = names_.find(spec.session_name);
    if (it != names_.end()) {
      return absl::AlreadyExistsError(
          absl::StrCat("session_name '", spec.session_name, "' is held by live session ",
                       it->second, "; re-attach to it (AttachSession) or close it first"));
    }
  }
  DIOND_RETURN_IF_ERROR(CheckStateFitsInMemory(spec));
  if (spec.world_key.empty() && spec.gradient_sync != GradientSync::kReplicated) {
    return absl::InvalidArgumentError(absl::StrCat("gradient_sync ",
                                                   GradientSyncName(spec.gradient_sync),
                                                   " needs a world session (world_key)"));
  }
  // A device session's staging is the first thing Session::Create allocates from the device
  // pool, and its size follows from the layout: checked against the limits before it exists.
  // The state and the rest are checked below with what was really allocated.
  if (ctx_ != nullptr && ctx_->device().type != kernels::DeviceType::kCpu) {
    if (absl::StatusOr<Layout> layout = ComputeLayout(spec.params); layout.ok()) {
      absl::MutexLock lock(&mu_);
      DIOND_RETURN_IF_ERROR(CheckBudget(Session::DeviceStagingBytesFor(*layout),
                                        "a device session's staging alone, before its state; "
                                        "nothing was allocated"));
    }
  }
  // Validate and size the session before taking the lock (optimizer state is allocated here).
  // The state goes where the steps run: ctx_ is on the daemon's compute device.
  DIOND_ASSIGN_OR_RETURN(
      std::unique_ptr<Session> s,
      Session::Create(std::move(id), std::move(spec), ctx_.get(), &runtime_, &compute_));
  if (s->is_world_session()) {
    uint64_t epoch = 0;
    DIOND_ASSIGN_OR_RETURN(ShardPlan plan, AgreeOnPlan(s->spec(), &epoch));
    std::shared_ptr<WorldLink> world;
    absl::Duration verdict_wait;
    {
      absl::MutexLock lock(&mu_);
      world = world_;
      verdict_wait = verdict_wait_;
    }
    const int rank = world != nullptr ? world->rank() : 0;
    DIOND_LOG(INFO) << "world session '" << s->spec().world_key << "' is session " << s->id()
                    << " (" << GradientSyncName(s->spec().gradient_sync) << "): plan "
                    << ShardPlanHashHex(plan.hash) << "; rank " << rank << " owns "
                    << plan.Owned(rank).size() << " of " << plan.owner.size() << " parameters";
    DIOND_RETURN_IF_ERROR(
        s->AttachWorld(world, std::move(plan), epoch, verdict_wait, options_.checksum_every));
  }
  std::shared_ptr<Session> shared(std::move(s));
  int64_t count;
  {
    absl::MutexLock lock(&mu_);
    DIOND_RETURN_IF_ERROR(CheckBudget(
        shared->BudgetBytes(),
        shared->is_device_session()
            ? absl::StrCat(
                  "device pool ", shared->DeviceBytes(), " as allocated: staging ",
                  shared->DeviceStagingBytes(),
                  shared->DeviceWorldBytes() > 0
                      ? absl::StrCat(", world exchange buffers ", shared->DeviceWorldBytes())
                      : std::string(),
                  ", the rest state; host ", shared->BudgetBytes() - shared->DeviceBytes(),
                  "; all released again")
            : "optimizer state"));
    const std::string& name = shared->spec().session_name;
    if (!name.empty() && names_.count(name)) {  // created meanwhile by another call
      return absl::AlreadyExistsError(
          absl::StrCat("session_name '", name, "' is held by live session ", names_[name]));
    }
    if (sessions_.count(shared->id())) {
      return absl::AlreadyExistsError(absl::StrCat("session ", shared->id(), " exists"));
    }
    sessions_[shared->id()] = shared;
    if (!name.empty()) names_[name] = shared->id();
    count = static_cast<int64_t>(sessions_.size());
  }
  DIOND_LOG(INFO) << "session " << shared->id()
                  << (shared->spec().session_name.empty()
                          ? std::string()
                          : absl::StrCat(" ('", shared->spec().session_name, "')"))
                  << " created for '" << shared->spec().client_name
                  << "': " << shared->layout().tensors.size() << " parameters, "
                  << shared->StateBytes() << " bytes of state";
  if (observer_.on_sessions_changed) observer_.on_sessions_changed(count);
  return shared;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Get(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown session '", Bounded(id), "'"));
  }
  return it->second;
}

absl::Status SessionManager::Close(const std::string& id, bool by_client) {
  ScopedLogContext log_context(id);
  // A queued asynchronous step finishes first (outside mu_: its bookkeeping looks the session
  // up); no Step is accepted after.
  if (auto s = Get(id); s.ok()) {
    if (int64_t step = (*s)->DrainQueuedStep(/*closing=*/true); step != 0) {
      DIOND_LOG(INFO) << "session " << id << ": the asynchronous step " << step
                      << " finished before the session was closed";
    }
  }
  int64_t count;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown session '", Bounded(id), "'"));
    }
    const std::string& name = it->second->spec().session_name;
    if (!name.empty()) names_.erase(name);
    sessions_.erase(it);
    trainers_.erase(id);
    count = static_cast<int64_t>(sessions_.size());
  }
  if (by_client && options_.checkpoints != nullptr) options_.checkpoints->MarkClosed(id);
  DIOND_LOG(INFO) << "session " << id << " closed";
  if (observer_.on_sessions_changed) observer_.on_sessions_changed(count);
  return absl::OkStatus();
}

std::vector<SessionInfo> SessionManager::List() {
  std::vector<std::shared_ptr<Session>> all;
  {
    absl::MutexLock lock(&mu_);
    all.reserve(sessions_.size());
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  std::vector<SessionInfo> out;
  out.reserve(all.size());
  for (auto& s : all) out.push_back(s->Info());
  return out;
}

absl::StatusOr<StepResult> SessionManager::Step(const std::string& id, const StepRequest& request) {
  ScopedLogContext log_context(id, request.step_index);
  // A lost device context (a sticky error) refuses every device step up front, before the
  // session is touched; a step that failed is asked about too, so the loss is noticed (and
  // reported by the hook: health, metrics) by the step that ran into it.
  const auto& device_health = options_.device_health;
  const bool on_device =
      device_health && ctx_ != nullptr && ctx_->device().type != kernels::DeviceType::kCpu;
  if (on_device) {
    if (absl::Status h = device_health(ctx_->device()); !h.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("step refused: ", h.message(),
                       " (the daemon's health is NOT_SERVING; "
                       "restart it and restore the sessions from their checkpoints)"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Get(id));
  // An asynchronous step's bookkeeping runs on its own thread once it succeeded (the session
  // is then still reachable here: Close drains it before dropping the session).
  // The overlapped step's wait for each bucket is the daemon's (--overlap_bucket_timeout).
  StepRequest overlapped = request.overlap ? request : StepRequest{};
  overlapped.overlap_bucket_wait = options_.overlap_bucket_timeout;
  absl::StatusOr<StepResult> stepped =
      s->Step(request.overlap ? overlapped : request, *ctx_, [this, id](const StepResult& done) {
        ScopedLogContext async_log_context(id, done.step_index);
        AfterStep(id, done);
      });
  if (!stepped.ok()) {
    if (on_device) (void)device_health(ctx_->device());
    return stepped.status();
  }
  StepResult r = *std::move(stepped);
  CheckComputeThreads();
  if (r.queued) return r;
  AfterStep(id, r);
  return r;
}

void SessionManager::CheckComputeThreads() {
  const int threads = kernels::CpuParallelCallerThreads();
  if (threads <= 1 || warned_compute_threads_.exchange(true)) return;
  DIOND_LOG(WARNING) << threads << " threads of this process have run multi-threaded CPU ops; "
                     << "every session's compute should run on the one compute thread "
                     << "(libgomp then keeps one pool; with more, its idle workers sleep after "
                     << "~100 spins and every parallel region waits for a futex wake-up: "
                     << "slower steps). This is a bug of the daemon: please report it";
}

void SessionManager::AfterStep(const std::string& id, const StepResult& r) {
  if (!r.replayed) {
    if (auto s = Get(id); s.ok()) (*s)->RecordStepTime(absl::Now());
  }
  if (observer_.on_step) observer_.on_step(id, r);
  if (!r.replayed && !r.skipped && options_.checkpoint_every > 0 &&
      r.step_index % options_.checkpoint_every == 0) {
    auto saved = SaveCheckpoint(id, "");
    if (!saved.ok()) {
      // The step itself succeeded and is recorded; a failed automatic checkpoint is reported,
      // not turned into a failed step.
      DIOND_LOG(ERROR) << "session " << id << ": automatic checkpoint at step " << r.step_index
                       << " failed: " << saved.status();
    }
  }
}

absl::StatusOr<std::pair<std::string, int64_t>> SessionManager::SaveCheckpoint(
    const std::string& id, const std::string& root) {
  // Empty = --state_dir; relative = beneath --state_dir (no symlink out of it).
  if (root.empty() && options_.state_dir.empty()) {
    return absl::FailedPreconditionError(
        "no checkpoint directory: pass one or start the daemon with --state_dir");
  }
  ScopedLogContext log_context(id);
  DIOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Get(id));
  // From here on a failure is the checkpoint's, not the request's: it is counted.
  auto failed = [&](const absl::Status& why) {
    if (observer_.on_checkpoint_failed) observer_.on_checkpoint_failed(id, why);
    return why;
  };
  if (options_.checkpoints == nullptr) {
    return failed(absl::FailedPreconditionError("this daemon has no checkpoint store"));
  }
  int64_t step = 0;
  auto written = options_.checkpoints->Save(root, id, options_.keep_checkpoints,
                                            [&]() -> absl::StatusOr<SessionSnapshot> {
                                              // DION_COMPRESSED world sessions average the
                                              // decoupled momenta first (a collective).
                                              DIOND_RETURN_IF_ERROR(s->SynchronizeForCheckpoint());
                                              absl::StatusOr<SessionSnapshot> snap = s->Snapshot();
                                              if (snap.ok()) step = snap->last_step_index;
                                              return snap;
                                            });
  if (!written.ok()) return failed(written.status());
  auto& saved = *written;
  s->RecordCheckpoint(step, saved.first, absl::Now());
  DIOND_LOG(INFO) << "session " << id << ": checkpoint of step " << step << " written to "
                  << saved.first << " (" << saved.second << " bytes)";
  if (observer_.on_checkpoint) observer_.on_checkpoint(id, saved.first, saved.second);
  return saved;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::RestoreSnapshot(
    const std::string& id, const SessionSnapshot& snap, const std::string& path) {
  auto created = CreateSessionWithId(id, snap.spec);
  if (!created.ok()) {
    if (absl::IsInvalidArgument(created.status())) {
      return absl::DataLossError(
          absl::StrCat(path, "/manifest.json: spec is invalid: ", created.status().message()));
    }
    return created.status();
  }
  absl::Status s = (*created)->Restore(snap);
  if (!s.ok()) {
    Close((*created)->id(), /*by_client=*/false).IgnoreError();  // no half-made session lingers
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  (*created)->RecordCheckpoint(snap.last_step_index, path, absl::Now());
  DIOND_LOG(INFO) << "session " << (*created)->id() << " restored from " << path << " at step "
                  << snap.last_step_index;
  return *created;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::LoadCheckpoint(
    const std::string& path, const std::vector<std::string>& shard_paths, const Caller& caller) {
  if (options_.checkpoints == nullptr) {
    return absl::FailedPreconditionError("this daemon has no checkpoint store");
  }
  // Relative: beneath --state_dir, never the daemon's working directory.
  DIOND_ASSIGN_OR_RETURN(SessionSnapshot snap, options_.checkpoints->Read(path));
  if (!caller.admin && !snap.spec.owner.empty() && snap.spec.owner != caller.principal) {
    return absl::PermissionDeniedError(
        absl::StrCat("checkpoint ", path, " belongs to another principal"));
  }
  if (snap.spec.owner.empty()) snap.spec.owner = caller.principal;
  if (!shard_paths.empty()) {
    DIOND_RETURN_IF_ERROR(options_.checkpoints->AddShards(path, shard_paths, &snap));
  }
  auto restored = RestoreSnapshot(NewId(), snap, path);
  if (!restored.ok() && absl::IsDataLoss(restored.status()) && !snap.spec.world_key.empty() &&
      absl::StrContains(restored.status().message(), "lacks tensor")) {
    return absl::DataLossError(absl::StrCat(
        restored.status().message(),
        "; a world session restored into a world of another size needs the other old ranks' "
        "checkpoints of the same step in shard_paths"));
  }
  if (restored.ok()) TrackProcess((*restored)->id(), caller.process, /*binds=*/true);
  return restored;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(
    const std::string& name, const std::string& principal, const std::vector<ParamSpec>& expect,
    bool admin, const ProcessId& process) {
  DIOND_RETURN_IF_ERROR(ValidateSessionName(name));
  std::shared_ptr<Session> s;
  {
    absl::MutexLock lock(&mu_);
    auto it = names_.find(name);
    if (it == names_.end()) {
      return absl::NotFoundError(absl::StrCat("no live session is named '", name, "'"));
    }
    s = sessions_.at(it->second);
  }
  // The hook of the authentication layer: it fills owners and principals in.
  if (!admin && !s->spec().owner.empty() && s->spec().owner != principal) {
    return absl::PermissionDeniedError(
        absl::StrCat("session '", name, "' belongs to another principal"));
  }
  if (!expect.empty()) {
    const std::vector<ParamSpec>& have = s->spec().params;
    auto text = [](const ParamSpec& p) {
      return absl::StrCat("'", p.name.substr(0, 64), "' [", absl::StrJoin(p.shape, ","), "] ",
                          p.dtype == DType::kF32    ? "f32"
                          : p.dtype == DType::kBf16 ? "bf16"
                                                    : "f16",
                          " in group '", p.group.substr(0, 64), "'");
    };
    if (expect.size() != have.size()) {
      return absl::FailedPreconditionError(absl::StrCat("session '", name, "' has ", have.size(),
                                                        " parameters; the trainer declares ",
                                                        expect.size()));
    }
    for (size_t i = 0; i < have.size(); ++i) {
      const ParamSpec& a = have[i];
      const ParamSpec& b = expect[i];
      if (a.name != b.name || a.shape != b.shape || a.dtype != b.dtype || a.group != b.group) {
        return absl::FailedPreconditionError(
            absl::StrCat("session '", name, "' does not match the trainer's model: parameter ", i,
                         " is ", text(a), " in the session, ", text(b), " in the trainer"));
      }
    }
  }
  s->DetachTrainer();
  TrackProcess(s->id(), process, /*binds=*/true);
  DIOND_LOG(INFO) << "session " << s->id() << " ('" << name << "') re-attached at step "
                  << s->last_step_index()
                  << (process.known() ? absl::StrCat(" by process ", process.pid) : std::string());
  return s;
}

int64_t SessionManager::RecoverSessions() {
  int64_t restored = 0;
  for (const std::string& id : options_.checkpoints->RecoverableSessions()) {
    for (const std::string& path : options_.checkpoints->CheckpointsNewestFirst(id)) {
      auto snap = options_.checkpoints->Read(path);
      if (!snap.ok()) {
        DIOND_LOG(ERROR) << "--recover: " << snap.status() << "; trying an older checkpoint";
        continue;
      }
      if (snap->session_id != id) {
        DIOND_LOG(ERROR) << "--recover: " << path << " was written for session " << snap->session_id
                         << ", not " << id << "; skipped";
        break;
      }
      if (!snap->spec.world_key.empty()) {
        DIOND_LOG(WARNING) << "--recover: " << path << " is a world session ('"
                           << snap->spec.world_key
                           << "'); world sessions are restored with LoadCheckpoint on every rank";
        break;
      }
      auto s = RestoreSnapshot(id, *snap, path);
      if (!s.ok()) {
        DIOND_LOG(ERROR) << "--recover: " << s.status();
        break;
      }
      ++restored;
      break;
    }
  }
  DIOND_LOG(INFO) << "--recover: restored " << restored << " session(s) from "
                  << options_.state_dir;
  return restored;
}

}  // namespace diond::session
