#include "server/rpc/access.h"

#include <sys/stat.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/bounded.h"

namespace diond::rpc {

bool MayUseSession(const Principal& p, const std::string& owner) {
  return p.admin || owner == p.name;
}

absl::StatusOr<std::shared_ptr<session::Session>> OwnedSession(session::SessionManager* manager,
                                                               const Principal& p,
                                                               const std::string& id) {
  auto s = manager->Get(id);
  if (!s.ok()) return s.status();
  if (!MayUseSession(p, (*s)->spec().owner)) {
    return absl::PermissionDeniedError(absl::StrCat("session '", Bounded(id),
                                                    "' belongs to another principal (you are ",
                                                    Bounded(p.name), ")"));
  }
  // A local process that uses the session keeps it from being an orphan while it lives.
  if (p.local) manager->NoteProcess(id, p.process);
  return s;
}

absl::Status CheckPathAllowed(const Principal& p, const std::string& path, const char* field) {
  if (p.local && p.admin) return absl::OkStatus();
  if (!path.empty() && (path[0] == '/' || absl::StrContains(path, ".."))) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, " '", Bounded(path),
        "': only paths relative to --state_dir (without '..') are allowed, except for the "
        "daemon's own user on the Unix socket"));
  }
  return absl::OkStatus();
}

absl::Status CheckSegmentOwner(const Principal& p, const std::string& name) {
  if (!p.local || p.admin || name.empty() || name == "." || name == ".." || name.size() > 255) {
    return absl::OkStatus();
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::OkStatus();
    }
  }
  struct stat st;
  if (lstat(absl::StrCat("/dev/shm/", name).c_str(), &st) == 0 && st.st_uid != p.uid) {
    return absl::PermissionDeniedError(absl::StrCat("shm segment '", name, "' belongs to uid ",
                                                    st.st_uid, ", not to the caller (",
                                                    Bounded(p.name), ")"));
  }
  return absl::OkStatus();
}

}  // namespace diond::rpc
