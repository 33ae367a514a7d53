// Session checkpoints on disk (ARCHITECTURE.md §7;
// docs/OPERATIONS.md, "Checkpoints and restarts").
//
// Layout: <dir>/manifest.json and <dir>/tensors.safetensors, where <dir> is
// <root>/<session_id>/step-<N>. The manifest holds the session spec, the step index, the record
// of the last applied step (so that a retried Step is answered after a restore exactly as before)
// and, per tensor, its shape and CRC-32 (zlib).
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
// parsed, the manifest follows a strict schema (every field typed and range-checked), and
// anything else is DATA_LOSS naming the file and the field. A reader that races a re-save of the
// same directory retries on the new one, so it always sees one complete checkpoint.
//
// Paths: a relative path is resolved beneath --state_dir without following any symlink out of it
// (openat2 RESOLVE_BENEATH); without --state_dir a relative path is refused.
#ifndef DIOND_SERVER_SESSION_CHECKPOINT_H_
#define DIOND_SERVER_SESSION_CHECKPOINT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/session/session.h"

namespace diond::session {

// Largest step index a checkpoint may hold (2^53: exact in every JSON reader).
inline constexpr int64_t kMaxCheckpointStepIndex = int64_t{1} << 53;
// Largest manifest.json accepted; refused by its size before it is read.
inline constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;
// Longest checkpoint path a client may name (messages that echo it stay small).
inline constexpr size_t kMaxCheckpointPathBytes = 1024;
// Deepest JSON nesting accepted in a manifest (a valid one is 5 deep).
inline constexpr int kMaxManifestDepth = 32;

// An open directory (O_DIRECTORY file descriptor) and the path it was opened as (for messages).
class CheckpointDir {
 public:
  CheckpointDir() = default;
  CheckpointDir(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  CheckpointDir(CheckpointDir&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  CheckpointDir& operator=(CheckpointDir&& o) noexcept;
  CheckpointDir(const CheckpointDir&) = delete;
  CheckpointDir& operator=(const CheckpointDir&) = delete;
  ~CheckpointDir();
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Opens the directory a client named. `state_dir` may be empty (no --state_dir).
//  - relative `path`: beneath `state_dir`, no symlink may lead out of it (PERMISSION_DENIED);
//    FAILED_PRECONDITION without a state_dir (never resolved against the daemon's cwd);
//  - absolute `path` inside `state_dir`: the same as its relative remainder;
//  - other absolute paths: opened as given (the RPC layer allows them to Unix-socket peers only).
// `create`: missing directories are made (mode 0700). NOT_FOUND if it does not exist.
absl::StatusOr<CheckpointDir> OpenCheckpointDir(const std::string& state_dir,
                                                const std::string& path, bool create);

// Writes `snapshot` under <root>/<session_id>/step-<N> (see the top of this file); then, when
// `keep` > 0, removes the oldest step-* directories of the session beyond the newest `keep`.
// Returns the checkpoint's path and its byte count.
absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(const CheckpointDir& root,
                                                                const std::string& session_id,
                                                                const SessionSnapshot& snapshot,
                                                                int64_t keep = 0);

// Reads the checkpoint directory `path` (resolved as OpenCheckpointDir does). DATA_LOSS naming the
// file, and the field or tensor, for anything missing, malformed, out of range, truncated or
// failing its CRC; NOT_FOUND if there is no such directory.
absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& state_dir,
                                               const std::string& path);
// The same for an absolute path (no state dir).
absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& path);

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

// A session id as a checkpoint directory name: 1..128 of [A-Za-z0-9._-], not starting with '.'.
bool IsValidSessionId(absl::string_view id);

// The spec as JSON and back (used by the manifest). DATA_LOSS naming the field on bad input.
std::string SpecToJson(const SessionSpec& spec);
absl::StatusOr<SessionSpec> SpecFromJson(const std::string& json);

// The JSON text's nesting depth, scanning at most `limit` + 1 levels (strings are skipped).
int JsonDepth(absl::string_view text, int limit);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_CHECKPOINT_H_
