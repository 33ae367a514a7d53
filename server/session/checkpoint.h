// Session checkpoints on disk (ARCHITECTURE.md §7).
//
// Layout: <dir>/manifest.json and <dir>/tensors.safetensors, where <dir> is
// <root>/<session_id>/step-<N>. The manifest holds the session spec, the step index and, per
// tensor, its shape and CRC-32 (zlib). Writes are atomic: a temporary directory next to the
// final one, every file fsync'ed, rename(), then an fsync of the parent, so a daemon killed at
// any instant leaves either the previous checkpoint or the new one, never a torn one.
#ifndef DIOND_SERVER_SESSION_CHECKPOINT_H_
#define DIOND_SERVER_SESSION_CHECKPOINT_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/session/session.h"

namespace diond::session {

// Writes `snapshot` under <root>/<session_id>/step-<N>; returns that path and its byte count.
absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(const std::string& root,
                                                                const std::string& session_id,
                                                                const SessionSnapshot& snapshot);

// Reads a checkpoint directory. DATA_LOSS naming the file (and tensor) for a missing,
// truncated or corrupted file or a checksum mismatch; NOT_FOUND if `path` does not exist.
absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& path);

// The newest complete checkpoint under <root>/<session_id>, or NOT_FOUND.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root,
                                             const std::string& session_id);

// The spec as JSON and back (used by the manifest). INVALID_ARGUMENT / DATA_LOSS on bad input.
std::string SpecToJson(const SessionSpec& spec);
absl::StatusOr<SessionSpec> SpecFromJson(const std::string& json);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_CHECKPOINT_H_
