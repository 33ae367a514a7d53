// Checkpoints on disk (ARCHITECTURE.md §7; docs/OPERATIONS.md, "Checkpoints and restarts").
//
// Layout: <dir>/manifest.json and <dir>/tensors.safetensors (manifest.h), where <dir> is
// <root>/<session_id>/step-<N>.
//
// Durability: a checkpoint is written into a temporary directory (.tmp-step-<N>-<pid>-<seq>) next
// to the final one, every file fsync'ed, then switched into place atomically and the parent
// fsync'ed. A first save is a rename that refuses to replace anything (RENAME_NOREPLACE); a
// re-save of a step that has a checkpoint exchanges the two directories in one step
// (RENAME_EXCHANGE) and only then removes the old one. So step-<N> is, at every instant, a
// complete checkpoint, and a daemon killed at any moment leaves the last good one. (A re-save is
// not skipped as a no-op: the state of the same step can differ, e.g. after SetState or
// SetHyperparameters, and the newer save is what the client asked for.)
//
// Reading treats the files as untrusted: sizes and JSON depth are bounded before anything is
// parsed, the manifest follows a strict schema, and anything else is DATA_LOSS naming the file
// and the field. A reader that races a re-save of the same directory retries on the new one, so
// it always sees one complete checkpoint.
//
// Paths are opened through the sandbox (sandbox.h): beneath --state_dir, never out of it.
//
// Thread-safety: thread-safe; concurrent writers of one session and step each leave a complete
// checkpoint, the last switch wins.
#ifndef DIOND_SERVER_CHECKPOINT_STORE_H_
#define DIOND_SERVER_CHECKPOINT_STORE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/checkpoint/sandbox.h"
#include "server/session/session.h"

namespace diond::checkpoint {

// Writes `snapshot` under <root>/<session_id>/step-<N> (see the top of this file); then, when
// `keep` > 0, removes the oldest step-* directories of the session beyond the newest `keep`.
// Returns the checkpoint's path and its byte count. INVALID_ARGUMENT for a bad session id.
absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(
    const CheckpointDir& root, const std::string& session_id,
    const session::SessionSnapshot& snapshot, int64_t keep = 0);

// Reads the checkpoint directory `path` (resolved as OpenCheckpointDir does). DATA_LOSS naming the
// file, and the field or tensor, for anything missing, malformed, out of range, truncated or
// failing its CRC; NOT_FOUND if there is no such directory.
absl::StatusOr<session::SessionSnapshot> ReadCheckpoint(const std::string& state_dir,
                                                        const std::string& path);
// The same for an absolute path (no state dir).
absl::StatusOr<session::SessionSnapshot> ReadCheckpoint(const std::string& path);

// The newest step-<N> under <root>/<session_id>, or NOT_FOUND.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root,
                                             const std::string& session_id);
// Every step-<N> under <root>/<session_id>, newest first.
std::vector<std::string> CheckpointsNewestFirst(const std::string& root,
                                                const std::string& session_id);

// Start-up clean-up of <state_dir>/*/: removes the .tmp-* directories left by writers that died
// (those of live processes other than this one are kept) and finishes a fallback switch that was
// interrupted (.old-step-*). Returns how many directories it removed.
int64_t RemoveStaleTemporaries(const std::string& state_dir);

// The session directories under `state_dir` (names that are session ids), for --recover.
std::vector<std::string> CheckpointSessions(const std::string& state_dir);

// Marks <state_dir>/<session_id> as closed by its client (--recover skips it) / asks.
void MarkSessionClosed(const std::string& state_dir, const std::string& session_id);
bool SessionMarkedClosed(const std::string& state_dir, const std::string& session_id);

}  // namespace diond::checkpoint

#endif  // DIOND_SERVER_CHECKPOINT_STORE_H_
