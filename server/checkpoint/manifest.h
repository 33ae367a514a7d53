// The checkpoint manifest codec (ARCHITECTURE.md §7): manifest.json holds the session's spec,
// the step index, the record of the last applied step (so that a retried Step is answered after
// a restore exactly as before) and, per tensor of tensors.safetensors, its shape and CRC-32
// (zlib).
//
// Decoding treats the text as untrusted: its depth is bounded before it is parsed, every field
// is typed and range-checked (common/strict_json.h), and anything else is DATA_LOSS naming the
// field by its path (e.g. "spec.groups[1].lr").
//
// Thread-safety: stateless functions.
#ifndef DIOND_SERVER_CHECKPOINT_MANIFEST_H_
#define DIOND_SERVER_CHECKPOINT_MANIFEST_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/session/session.h"
#include "server/session/types.h"

namespace diond::checkpoint {

inline constexpr char kManifestFile[] = "manifest.json";
inline constexpr char kTensorsFile[] = "tensors.safetensors";
// Largest step index a checkpoint may hold (2^53: exact in every JSON reader).
inline constexpr int64_t kMaxCheckpointStepIndex = int64_t{1} << 53;
// Largest manifest.json accepted; refused by its size before it is read.
inline constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;
// Deepest JSON nesting accepted in a manifest (a valid one is 5 deep).
inline constexpr int kMaxManifestDepth = 32;

// A session id as a checkpoint directory name: 1..128 of [A-Za-z0-9._-], not starting with '.'.
bool IsValidSessionId(absl::string_view id);

// The spec as JSON and back (the manifest's "spec"). DATA_LOSS naming the field on bad input.
// The text is canonical: equal specs give equal text.
std::string SpecToJson(const session::SessionSpec& spec);
absl::StatusOr<session::SessionSpec> SpecFromJson(const std::string& json);

// The CRC-32 (zlib) the manifest records for a tensor's bytes.
uint32_t Crc32(const void* data, size_t bytes);

// One tensor as the manifest lists it.
struct ManifestTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t crc = 0;
};

// manifest.json for `snapshot` written under `session_id`: its tensors are listed in order,
// with their CRC-32, as F32 tensors of kTensorsFile.
std::string EncodeManifest(const std::string& session_id, const session::SessionSnapshot& snapshot);

// Parses manifest.json: fills everything of `snap` but the tensors, and `tensors` with the listed
// ones. DATA_LOSS naming the field (without the file name) on bad input.
absl::Status DecodeManifest(const std::string& text, session::SessionSnapshot* snap,
                            std::vector<ManifestTensor>* tensors);

}  // namespace diond::checkpoint

#endif  // DIOND_SERVER_CHECKPOINT_MANIFEST_H_
