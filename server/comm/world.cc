#include "server/comm/world.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/comm/gloo_communicator.h"

namespace diond::comm {

World::World(const WorldOptions& options, MembershipService* membership, KeyValueStore* kv)
    : options_(options),
      membership_(membership),
      kv_(kv),
      incarnation_(NewIncarnation()),
      proof_(NewProof()) {
  status_ = absl::UnavailableError("the world is forming: waiting for every rank to join");
}

absl::StatusOr<std::unique_ptr<World>> World::Join(const WorldOptions& options,
                                                   MembershipService* membership,
                                                   KeyValueStore* kv) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is outside [0, ", options.world_size, ")"));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.peer_timeout < 2 * options.heartbeat_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer_timeout (", absl::FormatDuration(options.peer_timeout),
                     ") must be at least twice heartbeat_interval (",
                     absl::FormatDuration(options.heartbeat_interval), ")"));
  }
  std::unique_ptr<World> w(new World(options, membership, kv));
  auto view = w->JoinWithRetry(/*rebuild=*/false, options.join_timeout);
  if (!view.ok()) return view.status();
  w->UpdateView(*view);
  w->heartbeat_ = std::thread([p = w.get()] { p->HeartbeatLoop(); });
  w->builder_ = std::thread([p = w.get()] { p->BuildLoop(); });
  return w;
}

World::~World() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (builder_.joinable()) builder_.join();
  std::shared_ptr<Communicator> c, d;
  {
    absl::MutexLock lock(&mu_);
    c = std::move(comm_);
    d = std::move(device_comm_);
  }
  if (c) c->Abort(absl::UnavailableError("the world is shutting down"));
  if (d) d->Abort(absl::UnavailableError("the world is shutting down"));
}

absl::StatusOr<MembershipView> World::JoinWithRetry(bool rebuild, absl::Duration bound) {
  JoinArgs a{options_.rank, options_.world_size, options_.address, incarnation_, rebuild, proof_};
  const absl::Time deadline = absl::Now() + bound;
  absl::Status last;
  bool logged = false;
  while (true) {
    auto v = membership_->Join(a);
    if (v.ok()) return v;
    last = v.status();
    // A mismatch or a bad rank never heals; an unreachable coordinator or a rank still held by
    // a lost predecessor may.
    if (!absl::IsUnavailable(last) && !absl::IsAlreadyExists(last) &&
        !absl::IsDeadlineExceeded(last)) {
      return last;
    }
    if (absl::Now() >= deadline) break;
    if (!logged) {
      DIOND_LOG(INFO) << "world: rank " << options_.rank << " waiting to join: " << last.message();
      logged = true;
    }
    absl::SleepFor(std::min(options_.heartbeat_interval, absl::Milliseconds(500)));
  }
  return absl::UnavailableError(absl::StrCat("rank ", options_.rank,
                                             " could not join the world within ",
                                             absl::FormatDuration(bound), ": ", last.message()));
}

void World::UpdateView(const MembershipView& v) {
  int before, after;
  {
    absl::MutexLock lock(&mu_);
    before = view_.generation == 0 ? -1 : view_.live_count();
    view_ = v;
    after = v.live_count();
  }
  if (before != after && options_.on_peers) options_.on_peers(after);
}

void World::Break(uint64_t generation, const absl::Status& why) {
  std::vector<std::function<void(uint64_t, const absl::Status&)>> callbacks;
  std::shared_ptr<Communicator> dead, dead_device;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr || comm_generation_ != generation) {
      if (comm_ == nullptr) status_ = why;
      return;
    }
    dead = std::move(comm_);
    dead_device = std::move(device_comm_);
    status_ = why;
    callbacks = broken_callbacks_;
  }
  dead->Abort(why);
  if (dead_device) dead_device->Abort(why);
  DIOND_LOG(WARNING) << "world: generation " << generation << " broken: " << why.message();
  if (options_.on_broken) options_.on_broken(generation, why);
  for (auto& cb : callbacks) cb(generation, why);
}

void World::HeartbeatLoop() {
  absl::Time last_ok = absl::Now();
  absl::Time stalled_since = absl::InfiniteFuture();  // broken with no new generation
  uint64_t stalled_generation = 0;
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.heartbeat_interval)) {
    mu_.Unlock();
    auto r = membership_->Heartbeat(options_.rank, incarnation_, proof_);
    if (absl::IsNotFound(r.status())) {
      // Declared lost (or a restarted coordinator): join again as the same process.
      r = membership_->Join(JoinArgs{options_.rank, options_.world_size, options_.address,
                                     incarnation_, false, proof_});
    }
    const absl::Time now = absl::Now();
    uint64_t current = 0;
    {
      absl::MutexLock l(&mu_);
      current = comm_ ? comm_generation_ : 0;
    }
    if (r.ok()) {
      last_ok = now;
      UpdateView(*r);
      if (current != 0 && r->generation != current) {
        Break(current, absl::UnavailableError(absl::StrCat(
                           "world generation ", current, " ended: ",
                           r->broken_reason.empty() ? "membership changed" : r->broken_reason)));
      }
    } else if (now - last_ok > options_.peer_timeout) {
      Break(current, absl::UnavailableError(absl::StrCat(
                         "the coordinator (rank 0) has been unreachable for ",
                         absl::FormatDuration(now - last_ok), ": ", r.status().message())));
    }
    // A collective failed (the communicator aborted itself) although the membership did not
    // change, or a build failed: wait a peer_timeout for the coordinator's verdict, then ask for
    // a new generation so that everybody rebuilds.
    std::shared_ptr<Communicator> c;
    uint64_t view_generation = 0, failed = 0, built = 0;
    {
      absl::MutexLock l(&mu_);
      c = comm_;
      // A device collective that failed breaks the generation too; Poll asks the backend (NCCL's
      // asynchronous error: collectives queued on a session's stream report nothing else).
      if (c && device_comm_ && c->status().ok()) {
        if (absl::Status d = device_comm_->Poll(); !d.ok()) c->Abort(d);
      }
      view_generation = view_.generation;
      failed = failed_generation_;
      built = comm_generation_;
    }
    if (c && !c->status().ok()) Break(built, c->status());
    const bool usable = c && c->status().ok();
    const bool stalled =
        r.ok() && (failed == view_generation || (!usable && built == view_generation));
    if (!stalled) {
      stalled_since = absl::InfiniteFuture();
    } else if (stalled_generation != view_generation || stalled_since == absl::InfiniteFuture()) {
      stalled_generation = view_generation;
      stalled_since = now;
    } else if (now - stalled_since > options_.peer_timeout) {
      DIOND_LOG(INFO) << "world: generation " << view_generation
                      << " cannot be used and no rank was lost; asking for a rebuild";
      auto v = JoinWithRetry(/*rebuild=*/true, options_.peer_timeout);
      if (v.ok()) UpdateView(*v);
      stalled_since = absl::InfiniteFuture();
    }
    mu_.Lock();
  }
}

void World::BuildLoop() {
  while (true) {
    MembershipView v;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (view_.complete && view_.generation != comm_generation_ &&
                         view_.generation != failed_generation_);
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      v = view_;
    }
    GlooOptions go;
    go.rank = options_.rank;
    go.size = options_.world_size;
    go.hostname = options_.address;
    go.prefix = absl::StrCat(GenerationPrefix(v.coordinator_incarnation, v.generation), "gloo/");
    go.timeout = options_.peer_timeout;
    go.observer = options_.collective_observer;
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::unique_ptr<Communicator>> c = GlooCommunicator::Create(kv_, go);
    std::unique_ptr<Communicator> device;
    if (c.ok() && options_.device_communicator_factory) {
      absl::StatusOr<std::unique_ptr<Communicator>> d = options_.device_communicator_factory(
          kv_, absl::StrCat(GenerationPrefix(v.coordinator_incarnation, v.generation), "dev/"),
          options_.rank, options_.world_size, options_.peer_timeout, options_.collective_observer);
      if (d.ok()) {
        device = std::move(*d);
      } else {
        (*c)->Abort(d.status());
        c = absl::Status(d.status().code(),
                         absl::StrCat("device communicator: ", d.status().message()));
      }
    }
    std::shared_ptr<Communicator> installed, installed_device;
    {
      absl::MutexLock lock(&mu_);
      if (!c.ok()) {
        failed_generation_ = v.generation;
        status_ = c.status();
      } else if (view_.generation == v.generation && !stop_) {
        comm_ = std::shared_ptr<Communicator>(std::move(*c));
        device_comm_ = std::shared_ptr<Communicator>(std::move(device));
        comm_generation_ = v.generation;
        status_ = absl::OkStatus();
        installed = comm_;
        installed_device = device_comm_;
      } else {
        comm_generation_ = v.generation;  // superseded while connecting; never reuse its prefix
      }
    }
    if (!c.ok()) {
      DIOND_LOG(WARNING) << "world: building generation " << v.generation
                         << " failed: " << c.status().message();
    } else if (installed) {
      DIOND_LOG(INFO) << "world: rank " << options_.rank << " of " << options_.world_size
                      << " ready, generation " << v.generation << " (gloo"
                      << (installed_device ? absl::StrCat(" and ", installed_device->backend())
                                           : std::string())
                      << " connected in " << absl::FormatDuration(absl::Now() - t0) << ")";
      if (options_.on_ready) options_.on_ready(v.generation);
    }
  }
}

absl::Status World::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::StatusOr<std::shared_ptr<Communicator>> World::communicator() const {
  absl::MutexLock lock(&mu_);
  if (comm_ == nullptr) return status_;
  return comm_;
}

std::shared_ptr<Communicator> World::device_communicator() const {
  absl::MutexLock lock(&mu_);
  return comm_ != nullptr ? device_comm_ : nullptr;
}

uint64_t World::epoch() const {
  absl::MutexLock lock(&mu_);
  return comm_ ? comm_generation_ : 0;
}

absl::Status World::WaitReady(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto up = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return comm_ != nullptr || stop_; };
  mu_.AwaitWithTimeout(absl::Condition(&up), timeout);
  return comm_ ? absl::OkStatus() : status_;
}

MembershipView World::membership() const {
  absl::MutexLock lock(&mu_);
  return view_;
}

void World::AddBrokenCallback(std::function<void(uint64_t, const absl::Status&)> cb) {
  absl::MutexLock lock(&mu_);
  broken_callbacks_.push_back(std::move(cb));
}

}  // namespace diond::comm
