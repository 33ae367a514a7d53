#include "common/strict_json.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace diond::strict_json {

int JsonDepth(absl::string_view text, int limit) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escape = false;
  for (char c : text) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) {
        max_depth = depth;
        if (max_depth > limit) return max_depth;
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(field, ": ", what));
}

absl::StatusOr<const Json*> Field(const Json& o, const char* key, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end()) return FieldError(absl::StrCat(where, key), "missing");
  return &*it;
}

absl::StatusOr<std::string> GetString(const Json& o, const char* key, const std::string& where,
                                      size_t max_bytes) {
  DIOND_ASSIGN_OR_RETURN(const Json* v, Field(o, key, where));
  if (!v->is_string()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected a string, got ", v->type_name()));
  }
  const std::string& s = v->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(s.size(), " bytes; at most ", max_bytes));
  }
  return s;
}

absl::StatusOr<bool> GetBool(const Json& o, const char* key, const std::string& where) {
  DIOND_ASSIGN_OR_RETURN(const Json* v, Field(o, key, where));
  if (!v->is_boolean()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected true or false, got ", v->type_name()));
  }
  return v->get<bool>();
}

absl::StatusOr<int64_t> IntValue(const Json& v, const std::string& field, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) {
    return FieldError(field, absl::StrCat("expected an integer, got ", v.type_name()));
  }
  // Unsigned first: a value above INT64_MAX read as int64_t would wrap into range.
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) {
      return FieldError(field, absl::StrCat(u, " is out of range [", lo, ", ", hi, "]"));
    }
    return static_cast<int64_t>(u);
  }
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi) {
    return FieldError(field, absl::StrCat(i, " is out of range [", lo, ", ", hi, "]"));
  }
  return i;
}

absl::StatusOr<int64_t> GetInt(const Json& o, const char* key, const std::string& where, int64_t lo,
                               int64_t hi) {
  DIOND_ASSIGN_OR_RETURN(const Json* v, Field(o, key, where));
  return IntValue(*v, absl::StrCat(where, key), lo, hi);
}

absl::StatusOr<double> GetNumber(const Json& o, const char* key, const std::string& where,
                                 double lo) {
  DIOND_ASSIGN_OR_RETURN(const Json* v, Field(o, key, where));
  if (!v->is_number()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected a number, got ", v->type_name()));
  }
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(d, " is out of range (finite, >= ", lo, ")"));
  }
  return d;
}

absl::StatusOr<const Json*> GetArray(const Json& o, const char* key, const std::string& where,
                                     size_t max_items) {
  DIOND_ASSIGN_OR_RETURN(const Json* v, Field(o, key, where));
  if (!v->is_array()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected an array, got ", v->type_name()));
  }
  if (v->size() > max_items) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(v->size(), " entries; at most ", max_items));
  }
  return v;
}

}  // namespace diond::strict_json
