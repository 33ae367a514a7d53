// The access checks of the Optimizer service, given the caller's Principal (server/rpc/auth.h):
// who may use a session, which checkpoint paths and which shm segments a caller may name. Kept
// out of optimizer_service.cc so that tests/fuzz/auth_fuzz.cc drives the service's own checks.
#ifndef DIOND_SERVER_RPC_ACCESS_H_
#define DIOND_SERVER_RPC_ACCESS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/rpc/auth.h"
#include "server/session/session_manager.h"

namespace diond::rpc {

// True when `p` may see and use a session owned by `owner` (its own, or any for an admin).
bool MayUseSession(const Principal& p, const std::string& owner);

// Session `id` if `p` may use it: NOT_FOUND as the manager says, PERMISSION_DENIED when it
// belongs to another principal and `p` is no admin. A local caller's process is noted as one
// that uses the session (SessionManager::NoteProcess, the orphan reaper).
absl::StatusOr<std::shared_ptr<session::Session>> OwnedSession(session::SessionManager* manager,
                                                               const Principal& p,
                                                               const std::string& id);

// Checkpoint paths name files on the daemon's host. Admins on the Unix socket (root or the
// daemon's own uid) may name any path; everybody else (TCP peers, other local uids) only
// relative paths, which the session manager resolves under --state_dir, without "..".
// PERMISSION_DENIED naming `field` otherwise.
absl::Status CheckPathAllowed(const Principal& p, const std::string& path, const char* field);

// A local non-admin caller may only register shm segments its uid owns (the daemon could open
// other users' segments). Names the session layer will refuse anyway are left to it.
absl::Status CheckSegmentOwner(const Principal& p, const std::string& name);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_ACCESS_H_
