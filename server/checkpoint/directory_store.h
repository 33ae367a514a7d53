// The session room's CheckpointStore (server/session/checkpoint_store.h) on disk: checkpoints
// under --state_dir as store.h writes and reads them, paths through the sandbox (sandbox.h).
//
// Thread-safety: thread-safe (it holds only the state dir).
#ifndef DIOND_SERVER_CHECKPOINT_DIRECTORY_STORE_H_
#define DIOND_SERVER_CHECKPOINT_DIRECTORY_STORE_H_

#include <string>
#include <utility>
#include <vector>

#include "server/session/checkpoint_store.h"

namespace diond::checkpoint {

class DirectoryStore : public session::CheckpointStore {
 public:
  // `state_dir`: --state_dir, or empty (every path must then be absolute).
  explicit DirectoryStore(std::string state_dir) : state_dir_(std::move(state_dir)) {}

  int64_t RemoveStaleTemporaries() override;
  absl::StatusOr<std::pair<std::string, int64_t>> Save(
      const std::string& root, const std::string& id, int64_t keep,
      absl::FunctionRef<absl::StatusOr<session::SessionSnapshot>()> take) override;
  absl::StatusOr<session::SessionSnapshot> Read(const std::string& path) override;
  absl::Status AddShards(const std::string& path, const std::vector<std::string>& shard_paths,
                         session::SessionSnapshot* snapshot) override;
  std::vector<std::string> RecoverableSessions() override;
  std::vector<std::string> CheckpointsNewestFirst(const std::string& id) override;
  void MarkClosed(const std::string& id) override;

 private:
  const std::string state_dir_;
};

}  // namespace diond::checkpoint

#endif  // DIOND_SERVER_CHECKPOINT_DIRECTORY_STORE_H_
