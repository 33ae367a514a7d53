// Strict reading of untrusted JSON (checkpoint manifests): every field is looked up by name,
// typed and range-checked, and a refusal is DATA_LOSS naming the field by its path, e.g.
// "spec.groups[1].lr: expected a number, got string". The caller bounds the text (size, and
// depth with JsonDepth) before it parses it.
//
// `where` is the path of the object that holds `key`, ending in "." ("" at the top level).
//
// Thread-safety: stateless functions.
#ifndef DIOND_COMMON_STRICT_JSON_H_
#define DIOND_COMMON_STRICT_JSON_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace diond::strict_json {

using Json = nlohmann::json;

// The JSON text's nesting depth, scanning at most `limit` + 1 levels (strings are skipped), so
// that a document nested too deeply for the parser's recursion is refused before it is parsed.
int JsonDepth(absl::string_view text, int limit);

// DATA_LOSS "<field>: <what>".
absl::Status FieldError(absl::string_view field, absl::string_view what);

// The member `key` of object `o`; DATA_LOSS "missing" without it.
absl::StatusOr<const Json*> Field(const Json& o, const char* key, const std::string& where);
// A string of at most `max_bytes`.
absl::StatusOr<std::string> GetString(const Json& o, const char* key, const std::string& where,
                                      size_t max_bytes = 4096);
absl::StatusOr<bool> GetBool(const Json& o, const char* key, const std::string& where);
// An integer in [lo, hi] (`field` names it in messages).
absl::StatusOr<int64_t> IntValue(const Json& v, const std::string& field, int64_t lo, int64_t hi);
absl::StatusOr<int64_t> GetInt(const Json& o, const char* key, const std::string& where, int64_t lo,
                               int64_t hi);
// A finite number >= `lo`.
absl::StatusOr<double> GetNumber(const Json& o, const char* key, const std::string& where,
                                 double lo = -std::numeric_limits<double>::infinity());
// An array of at most `max_items` entries.
absl::StatusOr<const Json*> GetArray(const Json& o, const char* key, const std::string& where,
                                     size_t max_items);

}  // namespace diond::strict_json

#endif  // DIOND_COMMON_STRICT_JSON_H_
