// Owns every session of a daemon: creation under memory limits, lookup, close, the idle reaper,
// automatic and explicit checkpoints, and the one compute context the steps share.
//
// Thread-safety: thread-safe. Sessions are independent; RPCs on different sessions run in
// parallel up to compute, which is serialized by one mutex (the CPU backend's thread pools are
// process-wide; see kernels/context.h).
#ifndef DIOND_SERVER_SESSION_SESSION_MANAGER_H_
#define DIOND_SERVER_SESSION_SESSION_MANAGER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kernels/context.h"
#include "server/session/session.h"

namespace diond::comm {
class KeyValueStore;
class World;
}  // namespace diond::comm

namespace diond::session {

struct ManagerOptions {
  int64_t max_session_bytes = 0;  // 0 = unlimited; optimizer state + master weights
  int64_t memory_budget_bytes = 0;  // 0 = unlimited; all sessions together
  absl::Duration idle_timeout = absl::ZeroDuration();  // 0 = never
  std::string state_dir;        // checkpoints root; empty = checkpoints need an explicit dir
  int64_t checkpoint_every = 0; // with state_dir: checkpoint after every N-th step
  int compute_threads = 0;      // 0 = all cores
  // The device the steps run on (kernels::ComputeDevice of the daemon's selected device).
  kernels::Device compute_device;
  // World sessions: how long CreateSession waits for every rank's trainer to create the same
  // world session (the shard-plan agreement, docs/DISTRIBUTED.md).
  absl::Duration world_session_timeout = absl::Seconds(60);
  // World sessions: compare parameter checksums every N-th step (0 = never), healing a copy that
  // differs from its owner's (docs/DISTRIBUTED.md).
  int64_t checksum_every = 0;
};

// Hooks for metrics and logs (the manager itself knows nothing of prometheus).
struct ManagerObserver {
  std::function<void(int64_t sessions)> on_sessions_changed;
  std::function<void(const std::string& session, const StepResult&)> on_step;
  std::function<void(const std::string& session, const std::string& path, int64_t bytes)>
      on_checkpoint;
};

class SessionManager {
 public:
  static absl::StatusOr<std::unique_ptr<SessionManager>> Create(const ManagerOptions& options,
                                                                ManagerObserver observer = {});
  ~SessionManager();  // stops the reaper; sessions are dropped (not checkpointed)

  // The daemon world for world sessions (Daemon calls it once it joined; both may be null: world
  // sessions then run as a world of one). Must outlive the manager's sessions.
  // `verdict_wait`: how long a world session's failed collective waits for the coordinator to
  // name the lost rank (Daemon: --peer_timeout plus two heartbeats).
  void AttachWorld(comm::World* world, comm::KeyValueStore* kv,
                   absl::Duration verdict_wait = absl::ZeroDuration());
  // Before the World is destroyed: world sessions lose it (their steps then fail with
  // UNAVAILABLE) and new world sessions are refused.
  void DetachWorld();

  // RESOURCE_EXHAUSTED with the numbers when over --max_session_bytes or the memory budget.
  // A spec with a world_key is a world session: the ranks agree on its shard plan through the
  // world's store first (FAILED_PRECONDITION naming the ranks whose plan differs; UNAVAILABLE
  // when the world is down or a rank's trainer does not create it within the timeout).
  absl::StatusOr<std::shared_ptr<Session>> CreateSession(SessionSpec spec);
  // NOT_FOUND naming the id.
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& id);
  absl::Status Close(const std::string& id);
  std::vector<SessionInfo> List();

  // Step through the shared compute context; checkpoints afterwards when due.
  absl::StatusOr<StepResult> Step(const std::string& id, const StepRequest& request);

  // Writes a checkpoint of `id` under `root` (empty = --state_dir; relative = under --state_dir;
  // FAILED_PRECONDITION if
  // neither). Returns the checkpoint directory and its bytes.
  absl::StatusOr<std::pair<std::string, int64_t>> SaveCheckpoint(const std::string& id,
                                                                 const std::string& root);
  // Restores a checkpoint directory into a new session. DATA_LOSS for corrupt files.
  // A relative `path` is resolved under --state_dir.
  absl::StatusOr<std::shared_ptr<Session>> LoadCheckpoint(const std::string& path);

  // Closes sessions idle for longer than the timeout (checkpointing first with a state dir).
  // Called by the reaper thread; public for tests.
  void ReapIdleSessions(absl::Time now);

 private:
  explicit SessionManager(const ManagerOptions& options, ManagerObserver observer);
  absl::Status CheckBudget(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Computes the shard plan of world session `spec` and agrees on it with the other ranks.
  absl::StatusOr<ShardPlan> AgreeOnPlan(const SessionSpec& spec, uint64_t* epoch);
  std::string NewId();

  ManagerOptions options_;
  ManagerObserver observer_;
  std::unique_ptr<kernels::Context> ctx_;
  absl::Mutex compute_mu_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t counter_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<WorldLink> world_ ABSL_GUARDED_BY(mu_);  // null: no world
  bool world_detached_ ABSL_GUARDED_BY(mu_) = false;
  comm::KeyValueStore* kv_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Duration verdict_wait_ ABSL_GUARDED_BY(mu_);
  // Per "<generation>/<world_key>": how many times this daemon created it (the agreement's key
  // suffix).
  std::map<std::string, int64_t> world_key_uses_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread reaper_;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_MANAGER_H_
