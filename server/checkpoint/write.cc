// The write protocol of store.h: a temporary directory, every file fsync'ed, an atomic switch
// into place, an fsync of the parent; then the retention of --keep_checkpoints.
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "server/checkpoint/internal/files.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/store.h"

namespace diond::checkpoint {
namespace {

using internal::Echo;
using internal::Errno;
using internal::Fd;
using internal::RemoveTreeAt;

std::atomic<uint64_t> g_write_seq{0};

// Writes the tensors and the manifest of `snapshot` into the empty directory `dirfd` (`display`
// in messages) and fsyncs it. Returns the bytes written.
absl::StatusOr<int64_t> WriteFiles(int dirfd, const std::string& display,
                                   const std::string& session_id,
                                   const session::SessionSnapshot& snapshot) {
  SafetensorsWriter writer;
  for (const session::NamedTensor& t : snapshot.tensors) {
    if (absl::Status s = writer.AddF32(t.name, t.shape, t.data); !s.ok()) return s;
  }
  const std::string tensors = writer.Serialize();
  const std::string manifest = EncodeManifest(session_id, snapshot);
  if (absl::Status s = internal::WriteFileAt(dirfd, kTensorsFile, tensors,
                                             absl::StrCat(display, "/", kTensorsFile));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = internal::WriteFileAt(dirfd, kManifestFile, manifest,
                                             absl::StrCat(display, "/", kManifestFile));
      !s.ok()) {
    return s;
  }
  if (fsync(dirfd) != 0) return Errno("fsync", display);
  return static_cast<int64_t>(tensors.size() + manifest.size());
}

// Switches the complete directory `tmp_name` of session directory `sfd` into place as
// `final_name` (`final_dir` in messages): never a moment without a complete step-<N>. On failure
// `tmp_name` is left for the caller to remove.
absl::Status SwitchIntoPlace(int sfd, const std::string& tmp_name, const std::string& final_name,
                             const std::string& final_dir) {
  if (syscall(SYS_renameat2, sfd, tmp_name.c_str(), sfd, final_name.c_str(), RENAME_NOREPLACE) ==
      0) {
    return absl::OkStatus();
  }
  if (errno == EEXIST) {
    // A re-save: swap the two directories atomically, then drop the old one.
    if (syscall(SYS_renameat2, sfd, tmp_name.c_str(), sfd, final_name.c_str(), RENAME_EXCHANGE) !=
        0) {
      return Errno("exchange with", final_dir);
    }
    RemoveTreeAt(sfd, tmp_name);
    return absl::OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS) return Errno("rename to", final_dir);
  // A file system without renameat2 flags: move the old one aside first. A crash in between
  // leaves .old-step-<N>-*, which start-up moves back (RemoveStaleTemporaries).
  const std::string old_name =
      absl::StrCat(".old-", final_name, "-", getpid(), "-", g_write_seq.fetch_add(1));
  const bool had_old = renameat(sfd, final_name.c_str(), sfd, old_name.c_str()) == 0;
  if (renameat(sfd, tmp_name.c_str(), sfd, final_name.c_str()) != 0) {
    absl::Status s = Errno("rename to", final_dir);
    if (had_old) renameat(sfd, old_name.c_str(), sfd, final_name.c_str());
    return s;
  }
  if (had_old) RemoveTreeAt(sfd, old_name);
  return absl::OkStatus();
}

// Keeps the newest `keep` step-* directories of session directory `sfd` (and `current`, the one
// just written, whatever its step).
void ApplyRetention(int sfd, int64_t keep, int64_t current) {
  std::vector<int64_t> steps;
  for (const std::string& n : internal::ListDir(sfd)) {
    const int64_t s = internal::StepOfName(n);
    if (s >= 0) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) {
    if (steps[i] == current) continue;
    RemoveTreeAt(sfd, absl::StrCat("step-", steps[i]));
  }
  fsync(sfd);
}

}  // namespace

absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(
    const CheckpointDir& root, const std::string& session_id,
    const session::SessionSnapshot& snapshot, int64_t keep) {
  if (!IsValidSessionId(session_id)) {
    return absl::InvalidArgumentError(absl::StrCat("'", Echo(session_id), "' is not a session id"));
  }
  const std::string parent = absl::StrCat(root.path(), "/", session_id);
  if (mkdirat(root.fd(), session_id.c_str(), 0700) != 0 && errno != EEXIST) {
    return Errno("mkdir", parent);
  }
  Fd sfd(openat(root.fd(), session_id.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (sfd.get() < 0) return Errno("open", parent);
  const std::string final_name = absl::StrCat("step-", snapshot.last_step_index);
  const std::string final_dir = absl::StrCat(parent, "/", final_name);
  const std::string tmp_name =
      absl::StrCat(".tmp-", final_name, "-", getpid(), "-", g_write_seq.fetch_add(1));
  const std::string tmp_dir = absl::StrCat(parent, "/", tmp_name);
  if (mkdirat(sfd.get(), tmp_name.c_str(), 0700) != 0) return Errno("mkdir", tmp_dir);
  auto fail = [&](absl::Status s) {
    RemoveTreeAt(sfd.get(), tmp_name);
    return s;
  };
  Fd tfd(openat(sfd.get(), tmp_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (tfd.get() < 0) return fail(Errno("open", tmp_dir));
  absl::StatusOr<int64_t> bytes = WriteFiles(tfd.get(), tmp_dir, session_id, snapshot);
  if (!bytes.ok()) return fail(bytes.status());
  if (absl::Status s = SwitchIntoPlace(sfd.get(), tmp_name, final_name, final_dir); !s.ok()) {
    return fail(s);
  }
  if (fsync(sfd.get()) != 0) return Errno("fsync", parent);
  if (keep > 0) ApplyRetention(sfd.get(), keep, snapshot.last_step_index);
  return std::make_pair(final_dir, *bytes);
}

}  // namespace diond::checkpoint
