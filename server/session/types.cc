#include "server/session/types.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/bounded.h"

namespace diond::session {

absl::Status ValidateSessionName(absl::string_view name) {
  if (name.empty() || name.size() > 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_name of ", name.size(), " bytes: it must be 1..200 bytes"));
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '/')) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_name '", Bounded(name.substr(0, 64)),
                       "' may only contain letters, digits, '-', '_', '.' and '/'"));
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("session_name '", Bounded(name.substr(0, 64)),
                       "': components between '/' must be non-empty and not '.' or '..'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::session
