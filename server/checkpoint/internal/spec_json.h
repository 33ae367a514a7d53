// The spec codec's JSON values, for the manifest codec that embeds them (manifest.cc).
#ifndef DIOND_SERVER_CHECKPOINT_INTERNAL_SPEC_JSON_H_
#define DIOND_SERVER_CHECKPOINT_INTERNAL_SPEC_JSON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/strict_json.h"
#include "server/session/types.h"

namespace diond::checkpoint::internal {

strict_json::Json SpecToJsonValue(const session::SessionSpec& spec);
// `where`: the spec's path with a trailing "." ("spec." in a manifest, "" alone).
absl::StatusOr<session::SessionSpec> SpecFromJsonValue(const strict_json::Json& j,
                                                       const std::string& where);
// A tensor shape: an array of at most 16 dimensions in [0, 2^40].
absl::StatusOr<std::vector<int64_t>> GetShape(const strict_json::Json& o, const char* key,
                                              const std::string& where);

}  // namespace diond::checkpoint::internal

#endif  // DIOND_SERVER_CHECKPOINT_INTERNAL_SPEC_JSON_H_
