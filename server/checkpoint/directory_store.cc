#include "server/checkpoint/directory_store.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/sandbox.h"
#include "server/checkpoint/store.h"

namespace diond::checkpoint {

using session::NamedTensor;
using session::SessionSnapshot;
using session::SessionSpec;

int64_t DirectoryStore::RemoveStaleTemporaries() {
  return checkpoint::RemoveStaleTemporaries(state_dir_);
}

absl::StatusOr<std::pair<std::string, int64_t>> DirectoryStore::Save(
    const std::string& root, const std::string& id, int64_t keep,
    absl::FunctionRef<absl::StatusOr<SessionSnapshot>()> take) {
  DIOND_ASSIGN_OR_RETURN(CheckpointDir dir,
                         OpenCheckpointDir(state_dir_, root.empty() ? state_dir_ : root, true));
  DIOND_ASSIGN_OR_RETURN(SessionSnapshot snapshot, take());
  return WriteCheckpoint(dir, id, snapshot, keep);
}

absl::StatusOr<SessionSnapshot> DirectoryStore::Read(const std::string& path) {
  return ReadCheckpoint(state_dir_, path);
}

absl::Status DirectoryStore::AddShards(const std::string& path,
                                       const std::vector<std::string>& shard_paths,
                                       SessionSnapshot* snap) {
  if (snap->spec.world_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_paths are for world sessions; ", path, " holds a local session"));
  }
  // The ranks' specs are equal but for the per-rank names.
  auto comparable = [](SessionSpec spec) {
    spec.client_name.clear();
    spec.session_name.clear();
    spec.owner.clear();
    return SpecToJson(spec);
  };
  const std::string want = comparable(snap->spec);
  std::set<std::string> have;
  for (const NamedTensor& t : snap->tensors) have.insert(t.name);
  for (const std::string& shard_path : shard_paths) {
    DIOND_ASSIGN_OR_RETURN(SessionSnapshot shard, Read(shard_path));
    if (shard.last_step_index != snap->last_step_index || comparable(shard.spec) != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", shard_path, " (step ", shard.last_step_index,
                       ") is not a checkpoint of the same world session at the same step as ", path,
                       " (step ", snap->last_step_index, ")"));
    }
    for (NamedTensor& t : shard.tensors) {
      if (have.insert(t.name).second) snap->tensors.push_back(std::move(t));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> DirectoryStore::RecoverableSessions() {
  std::vector<std::string> out;
  for (std::string& id : CheckpointSessions(state_dir_)) {
    if (!SessionMarkedClosed(state_dir_, id)) out.push_back(std::move(id));
  }
  return out;
}

std::vector<std::string> DirectoryStore::CheckpointsNewestFirst(const std::string& id) {
  return checkpoint::CheckpointsNewestFirst(state_dir_, id);
}

void DirectoryStore::MarkClosed(const std::string& id) { MarkSessionClosed(state_dir_, id); }

}  // namespace diond::checkpoint
