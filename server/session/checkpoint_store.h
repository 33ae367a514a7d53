// Where a SessionManager keeps its sessions' checkpoints (ARCHITECTURE.md §7). The manager
// decides when a session is saved, restored or recovered; a store decides where and how.
// server/checkpoint implements it on disk beneath --state_dir (checkpoint::DirectoryStore), and
// the composition root hands it in (ManagerOptions::checkpoints), so that the session room never
// touches the file system's layout of a checkpoint.
//
// Paths are those a client names (SaveCheckpoint's root, LoadCheckpoint's path): empty means
// the state dir, a relative one lies beneath it.
//
// Thread-safety: implementations are thread-safe.
#ifndef DIOND_SERVER_SESSION_CHECKPOINT_STORE_H_
#define DIOND_SERVER_SESSION_CHECKPOINT_STORE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "server/session/session.h"

namespace diond::session {

class CheckpointStore {
 public:
  virtual ~CheckpointStore() = default;

  // Start-up: removes what writers that died left behind. Returns how many directories it
  // removed.
  virtual int64_t RemoveStaleTemporaries() = 0;

  // Opens (creating it) the directory `root` names, then takes the snapshot (`take`, which may
  // run a collective: it is not called when the directory cannot be opened) and writes it as
  // session `id`'s checkpoint, keeping the newest `keep` of the session's checkpoints when
  // `keep` > 0. Returns the checkpoint's path and byte count; the first error otherwise.
  virtual absl::StatusOr<std::pair<std::string, int64_t>> Save(
      const std::string& root, const std::string& id, int64_t keep,
      absl::FunctionRef<absl::StatusOr<SessionSnapshot>()> take) = 0;

  // Reads the checkpoint at `path`. DATA_LOSS naming the file and field or tensor for a corrupt
  // one; NOT_FOUND, PERMISSION_DENIED (out of the state dir), INVALID_ARGUMENT (a bad path).
  virtual absl::StatusOr<SessionSnapshot> Read(const std::string& path) = 0;

  // A world session's snapshot (read from `path`) completed from the other old ranks'
  // checkpoints `shard_paths` of the same step: the tensors it lacks are taken from them.
  // INVALID_ARGUMENT when `snapshot` is a local session's, or a shard is not of the same world
  // session at the same step; Read's errors for a shard.
  virtual absl::Status AddShards(const std::string& path,
                                 const std::vector<std::string>& shard_paths,
                                 SessionSnapshot* snapshot) = 0;

  // --recover: the ids of the sessions with checkpoints that their client did not close, and
  // the paths of one session's checkpoints, newest first.
  virtual std::vector<std::string> RecoverableSessions() = 0;
  virtual std::vector<std::string> CheckpointsNewestFirst(const std::string& id) = 0;

  // The client closed session `id`: its checkpoints stay, but RecoverableSessions skips it.
  virtual void MarkClosed(const std::string& id) = 0;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_CHECKPOINT_STORE_H_
