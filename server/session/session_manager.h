// Owns every session of a daemon: creation under memory limits, lookup, close, the idle reaper,
// automatic and explicit checkpoints, and the one compute context the steps share.
//
// Thread-safety: thread-safe. Sessions are independent; RPCs on different sessions run in
// parallel up to compute, which runs on one compute thread shared by all sessions (the CPU
// backend's thread pools are process-wide, and libgomp's are per calling thread; see
// kernels/context.h and compute_thread.h).
#ifndef DIOND_SERVER_SESSION_SESSION_MANAGER_H_
#define DIOND_SERVER_SESSION_SESSION_MANAGER_H_

#include <atomic>
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
#include "kernels/device_runtime.h"
#include "server/session/checkpoint_store.h"
#include "server/session/compute_thread.h"
#include "server/session/process_watch.h"
#include "server/session/session.h"

namespace diond::comm {
class KeyValueStore;
class World;
}  // namespace diond::comm

namespace diond::session {

struct ManagerOptions {
  int64_t max_session_bytes = 0;    // 0 = unlimited; optimizer state + master weights
  int64_t memory_budget_bytes = 0;  // 0 = unlimited; all sessions together
  absl::Duration idle_timeout = absl::ZeroDuration();  // 0 = never
  // The orphan reaper (docs/OPERATIONS.md "Orphan sessions"): a session whose every creating,
  // attaching or calling process is known and has exited is closed (checkpointed first with a
  // state dir) once it has been an orphan, and unused, for this long. `orphan_grace` applies to
  // sessions without a session_name, `orphan_grace_named` to named ones (which a restarted
  // trainer may re-attach to); 0 = never. World sessions are never reaped as orphans.
  absl::Duration orphan_grace = absl::ZeroDuration();
  absl::Duration orphan_grace_named = absl::ZeroDuration();
  // How long an overlapped step waits for each bucket's doorbell (--overlap_bucket_timeout; > 0).
  absl::Duration overlap_bucket_timeout = absl::Minutes(10);
  std::string state_dir;  // checkpoints root; empty = checkpoints need an explicit dir
  // Where checkpoints are written and read (checkpoint_store.h), opened on the same state_dir;
  // required with a state_dir. Null: SaveCheckpoint and LoadCheckpoint fail with
  // FAILED_PRECONDITION. Shared so that options stay copyable.
  std::shared_ptr<CheckpointStore> checkpoints;
  int64_t checkpoint_every = 0;  // with state_dir: checkpoint after every N-th step
  // Keep only the newest N step-* checkpoints of each session after every save; 0 = keep all.
  int64_t keep_checkpoints = 0;
  // With state_dir: at start-up, restore every session's latest checkpoint under its id and
  // name (sessions closed by their client and world sessions excepted).
  bool recover = false;
  int compute_threads = 0;  // 0 = all cores
  // The device the steps run on (kernels::ComputeDevice of the daemon's selected device).
  kernels::Device compute_device;
  // A device compute_device: its sessions' streams, host registration and graph capture come
  // from the device runtime registered for its type (kernels/device_runtime.h); their steps
  // replay captured graphs where they can unless step_graphs is false (docs/GPU.md "CUDA
  // graphs").
  bool step_graphs = true;
  // A device compute_device: asked before every step (a failure refuses the step, naming it)
  // and after a failed one; OK while the device's context is usable. Empty: never asked.
  std::function<absl::Status(kernels::Device)> device_health;
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
  // A checkpoint of an existing session that could not be written (automatic or requested).
  std::function<void(const std::string& session, const absl::Status& why)> on_checkpoint_failed;
  // The manager closed a session by itself; `reason` is "idle" or "orphan".
  std::function<void(const std::string& session, const std::string& reason)> on_session_reaped;
};

// Who calls a SessionManager operation that checks ownership: the principal string the RPC
// layer's authentication chose (server/rpc/auth.h), opaque here. The default, an admin with no
// name, is the in-process caller (tests, --recover).
struct Caller {
  std::string principal;
  bool admin = true;
  // The calling process when it is a local one the daemon can watch (the Unix socket's peer);
  // unknown otherwise (TCP, in-process callers). See "Orphan sessions" below.
  ProcessId process;
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
  //
  // `creator`: the process that asks, when it is a known local one; the session is then an
  // orphan once it and every process that used the session later are gone (ReapOrphanSessions).
  // An unknown creator (the default: TCP, in-process) makes the session one that is never
  // reaped as an orphan.
  absl::StatusOr<std::shared_ptr<Session>> CreateSession(SessionSpec spec,
                                                         const ProcessId& creator = {});
  // A spec with a session_name must carry a valid one (INVALID_ARGUMENT) that no live session
  // has (ALREADY_EXISTS: re-attach with Attach instead).
  //
  // NOT_FOUND naming the id.
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& id);
  // `by_client`: the client closed it (CloseSession): its checkpoints stay, but --recover no
  // longer restores it. The idle reaper closes with by_client = false.
  absl::Status Close(const std::string& id, bool by_client = true);

  // A new trainer re-attaches to the live session named `name` (Session::DetachTrainer: the old
  // trainer's regions are dropped, the weights kept for the new one's). NOT_FOUND if no live
  // session has the name. `principal`: the caller's identity as the RPC layer's authentication
  // names it (empty = unauthenticated); a session whose owner is set and differs refuses with
  // PERMISSION_DENIED. (The ownership policy itself belongs to the authentication layer; this is
  // its hook.)
  // `expect`: when non-empty, the parameters the new trainer declares; FAILED_PRECONDITION naming
  // the first difference from the session's (and nothing changes) unless they are equal.
  // `admin`: the caller may use every session (the RPC layer's admin principals).
  // `process`: the attaching process; it keeps the session from being an orphan from now on
  // (an unknown one, as in CreateSession, exempts the session from the orphan reaper).
  absl::StatusOr<std::shared_ptr<Session>> Attach(const std::string& name,
                                                  const std::string& principal,
                                                  const std::vector<ParamSpec>& expect = {},
                                                  bool admin = false,
                                                  const ProcessId& process = {});

  // A known local process called on session `id` (any RPC that names it): it keeps the session
  // from being an orphan while it lives (a trainer's forked child on its own connection, a
  // helper that registers regions). Unknown processes and unknown ids are ignored; at most
  // kMaxWatchedProcesses live processes are watched per session.
  void NoteProcess(const std::string& id, const ProcessId& process);
  static constexpr size_t kMaxWatchedProcesses = 64;

  // --recover: restores every session's latest readable checkpoint under <state_dir> with its
  // id and name. Returns how many it restored. Called by Create when options.recover.
  int64_t RecoverSessions();
  std::vector<SessionInfo> List();

  // Step through the shared compute context; checkpoints afterwards when due.
  // An asynchronous step (request.asynchronous) is recorded, counted and checkpointed when it
  // has run, on the session's thread.
  absl::StatusOr<StepResult> Step(const std::string& id, const StepRequest& request);
  // Waits for every session's queued asynchronous step, and refuses Steps from then on (the
  // daemon's shutdown; the destructor calls it too).
  void DrainQueuedSteps();
  // Every overlapped step waiting for a bucket fails now (the daemon's stop, before the RPC
  // drain: a Step wait on such a step would otherwise hold the drain until the bucket timeout).
  void CancelDoorbellWaits();

  // Writes a checkpoint of `id` under `root` (empty = --state_dir; relative = under --state_dir;
  // FAILED_PRECONDITION if
  // neither). Returns the checkpoint directory and its bytes.
  absl::StatusOr<std::pair<std::string, int64_t>> SaveCheckpoint(const std::string& id,
                                                                 const std::string& root);
  // Restores a checkpoint directory into a new session. DATA_LOSS for corrupt files.
  // A relative `path` is resolved under --state_dir.
  // `shard_paths`: for a world session, the other old ranks' checkpoints of the same step
  // (elastic restore into a world of another size: the state of this rank's new share is taken
  // from whichever checkpoint holds it).
  // `caller`: who asks. The restored session keeps the owner recorded in the checkpoint (or
  // becomes the caller's when none is recorded); a caller that is not an admin may load only
  // checkpoints it owns (PERMISSION_DENIED otherwise).
  absl::StatusOr<std::shared_ptr<Session>> LoadCheckpoint(
      const std::string& path, const std::vector<std::string>& shard_paths = {},
      const Caller& caller = {});

  // Closes sessions idle for longer than the timeout (checkpointing first with a state dir).
  // Called by the reaper thread; public for tests.
  void ReapIdleSessions(absl::Time now);
  // Orphan sessions (docs/OPERATIONS.md): a session whose processes (CreateSession, Attach,
  // LoadCheckpoint, NoteProcess) were all known and have all exited becomes an orphan at the
  // first look that finds them gone; it is closed like an idle one (checkpoint first; kept, and
  // tried again a grace later, when that fails) once `now` is a grace past both that moment and
  // its last use. Sessions with an unknown creator or attacher, world sessions and sessions
  // whose grace is 0 are only logged, once. An orphan's overlapped step waiting for a doorbell
  // is given up when it is found (Session::CancelDoorbellWaits), whatever the grace. Called by the
  // reaper thread; public for tests.
  void ReapOrphanSessions(absl::Time now);

  // The CPU threads of the compute context (--compute_threads as it took effect).
  int compute_threads() const { return ctx_->num_threads(); }

 private:
  // A step's bookkeeping once it ran: the step time, the observer, the automatic checkpoint.
  void AfterStep(const std::string& id, const StepResult& r);
  explicit SessionManager(const ManagerOptions& options, ManagerObserver observer);
  // RESOURCE_EXHAUSTED when a session needing `bytes` (`what` says of what) exceeds
  // --max_session_bytes, or with the open sessions' Session::BudgetBytes exceeds
  // --memory_budget_bytes; the message names the bytes needed, the limit and the bytes in use.
  absl::Status CheckBudget(int64_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Computes the shard plan of world session `spec` and agrees on it with the other ranks
  // (world_plan.h); *epoch: the world's generation it was agreed in.
  absl::StatusOr<ShardPlan> AgreeOnPlan(const SessionSpec& spec, uint64_t* epoch);
  std::string NewId();
  // Warns once when the CPU ops ran on more than one thread (kernels::CpuParallelCallerThreads).
  void CheckComputeThreads();
  // CreateSession with a given id (--recover keeps the checkpoint's).
  absl::StatusOr<std::shared_ptr<Session>> CreateSessionWithId(std::string id, SessionSpec spec);
  absl::StatusOr<std::shared_ptr<Session>> RestoreSnapshot(const std::string& id,
                                                           const SessionSnapshot& snap,
                                                           const std::string& where);
  // Records `process` as one that created or attached (`binds`) or used session `id`; see
  // NoteProcess and CreateSession.
  void TrackProcess(const std::string& id, const ProcessId& process, bool binds);
  // The idle and orphan reapers' close: a checkpoint first with --state_dir (false, and the
  // session stays, when it fails), then Close, the log line `why` and on_session_reaped.
  // `for_good`: closed as by its client (--recover no longer restores it; its checkpoints stay).
  bool CloseReaped(const std::string& id, const std::string& reason, const std::string& why,
                   bool for_good);

  // The processes of one session, for the orphan reaper.
  struct Trainers {
    bool untracked = false;  // an unknown process created or attached it: never an orphan
    std::vector<std::shared_ptr<ProcessWatch>> live;  // watched, not yet seen exited
    std::vector<pid_t> exited;                        // the last few seen exited (for the log)
    absl::Time orphan_since = absl::InfinitePast();   // InfinitePast: not an orphan
    bool noted = false;  // the "kept although orphaned" line was logged
  };

  ManagerOptions options_;
  ManagerObserver observer_;
  std::unique_ptr<kernels::Context> ctx_;
  // The compute device's runtime (empty on the CPU), capture nulled without step_graphs.
  kernels::DeviceRuntime runtime_;
  // Every session's compute runs here (one thread, so one OpenMP pool); declared before the
  // sessions, so that it outlives them.
  ComputeThread compute_;
  std::atomic<bool> warned_compute_threads_{false};
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> names_ ABSL_GUARDED_BY(mu_);  // session_name -> id
  std::map<std::string, Trainers> trainers_ ABSL_GUARDED_BY(mu_);  // id -> its processes
  std::shared_ptr<WorldLink> world_ ABSL_GUARDED_BY(mu_);          // null: no world
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
