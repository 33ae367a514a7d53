// The read side of store.h: one checkpoint directory, checked file by file against its
// manifest, and read again when a re-save replaced it meanwhile.
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "server/checkpoint/internal/files.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/store.h"

namespace diond::checkpoint {
namespace {

using internal::Echo;
using internal::Errno;
using internal::Fd;
using internal::ReadBounded;
using session::NamedTensor;
using session::SessionSnapshot;

int OpenInDir(int dirfd, const char* name) {
  return openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
}

// The largest tensors.safetensors that can hold exactly the listed tensors (f32): anything
// larger is refused by its size before it is read.
absl::StatusOr<int64_t> TensorFileLimit(const std::vector<ManifestTensor>& entries,
                                        const std::string& manifest_path) {
  uint64_t limit = 8 + SafetensorsFile::kMaxHeaderBytes;
  for (const ManifestTensor& t : entries) {
    uint64_t n = 4;
    for (int64_t d : t.shape) {
      if (d != 0 && n > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) {
        return absl::DataLossError(
            absl::StrCat(manifest_path, ": tensor '", Echo(t.name), "': shape overflows"));
      }
      n *= static_cast<uint64_t>(d);
    }
    limit += n;
    if (limit > (uint64_t{1} << 62)) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": tensors too large"));
    }
  }
  return static_cast<int64_t>(limit);
}

// The listed tensors out of `file`, each checked against its manifest entry (dtype, shape,
// CRC-32), into `snap`; a tensor the manifest does not list is DATA_LOSS too.
absl::Status ReadTensors(const SafetensorsFile& file, const std::vector<ManifestTensor>& entries,
                         const std::string& manifest_path, const std::string& tensors_path,
                         SessionSnapshot* snap) {
  for (const ManifestTensor& e : entries) {
    const SafetensorsTensorInfo* info = file.Find(e.name);
    if (info == nullptr) {
      return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(e.name),
                                              "' listed in the manifest is missing"));
    }
    if (info->dtype != SafetensorsDtype::kF32) {
      return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(e.name),
                                              "' has dtype ", SafetensorsDtypeName(info->dtype),
                                              "; checkpoints hold F32"));
    }
    if (info->shape != e.shape) {
      return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(e.name),
                                              "' has shape [", absl::StrJoin(info->shape, ","),
                                              "]; the manifest says [", absl::StrJoin(e.shape, ","),
                                              "]"));
    }
    NamedTensor t;
    t.name = e.name;
    t.shape = e.shape;
    auto values = file.ReadFloat(e.name);
    if (!values.ok()) {
      return absl::DataLossError(
          absl::StrCat(tensors_path, ": tensor '", Echo(e.name), "': ", values.status().message()));
    }
    t.data = *std::move(values);
    if (Crc32(t.data.data(), t.data.size() * 4) != e.crc) {
      return absl::DataLossError(
          absl::StrCat(tensors_path, ": tensor '", Echo(e.name), "' fails its CRC-32 check"));
    }
    snap->tensors.push_back(std::move(t));
  }
  if (file.tensors().size() != entries.size()) {
    std::set<std::string> listed;
    for (const ManifestTensor& e : entries) listed.insert(e.name);
    for (const SafetensorsTensorInfo& info : file.tensors()) {
      if (!listed.count(info.name)) {
        return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(info.name),
                                                "' is not listed in ", manifest_path));
      }
    }
  }
  return absl::OkStatus();
}

// One attempt at reading the checkpoint in `dir`. *retry: a file vanished because a re-save
// replaced the directory meanwhile (the caller opens the path again).
absl::StatusOr<SessionSnapshot> ReadCheckpointOnce(const CheckpointDir& dir, bool* retry) {
  *retry = false;
  // For messages only (bounded, one line: found by session_fuzz).
  const std::string manifest_path = absl::StrCat(Echo(dir.path()), "/", kManifestFile);
  const std::string tensors_path = absl::StrCat(Echo(dir.path()), "/", kTensorsFile);
  Fd mfd(OpenInDir(dir.fd(), kManifestFile));
  const int merr = errno;
  Fd tfd(OpenInDir(dir.fd(), kTensorsFile));
  const int terr = errno;
  if (mfd.get() < 0 || tfd.get() < 0) {
    // Both files exist in every complete checkpoint. Missing ones may have been removed with the
    // directory after a re-save switched a new one in: the caller looks again (*retry) and
    // reports this error if the path still names the same directory.
    *retry = merr == ENOENT || terr == ENOENT;
    if (mfd.get() < 0) {
      return absl::DataLossError(
          absl::StrCat(manifest_path, ": cannot open: ", std::strerror(merr)));
    }
    return absl::DataLossError(absl::StrCat(tensors_path, ": cannot open: ", std::strerror(terr)));
  }
  auto text = ReadBounded(mfd.get(), kMaxManifestBytes, manifest_path);
  if (!text.ok()) return text.status();
  SessionSnapshot snap;
  std::vector<ManifestTensor> entries;
  if (absl::Status s = DecodeManifest(*text, &snap, &entries); !s.ok()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": ", s.message()));
  }
  DIOND_ASSIGN_OR_RETURN(const int64_t limit, TensorFileLimit(entries, manifest_path));
  auto bytes = ReadBounded(tfd.get(), limit, tensors_path);
  if (!bytes.ok()) return bytes.status();
  auto file = SafetensorsFile::Parse(*std::move(bytes), tensors_path);
  if (!file.ok()) return absl::DataLossError(file.status().message());
  DIOND_RETURN_IF_ERROR(ReadTensors(*file, entries, manifest_path, tensors_path, &snap));
  return snap;
}

}  // namespace

absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& state_dir,
                                               const std::string& path) {
  // A re-save replaces the directory while a read may be under way; the read then starts over
  // on the new one (a handful of times at most: each retry needs another complete re-save).
  struct stat prev;
  bool have_prev = false;
  for (int attempt = 0; attempt < 50; ++attempt) {
    DIOND_ASSIGN_OR_RETURN(CheckpointDir dir, OpenCheckpointDir(state_dir, path, false));
    struct stat cur;
    if (fstat(dir.fd(), &cur) != 0) return Errno("stat", dir.path());
    if (have_prev && cur.st_dev == prev.st_dev && cur.st_ino == prev.st_ino) {
      bool ignored;
      return ReadCheckpointOnce(dir, &ignored);  // the same directory: the loss is real
    }
    bool retry = false;
    auto snap = ReadCheckpointOnce(dir, &retry);
    if (!retry) return snap;
    prev = cur;
    have_prev = true;
  }
  return absl::UnavailableError(
      absl::StrCat(Echo(path), " was replaced by re-saves 50 times while being read; retry"));
}

absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& path) {
  return ReadCheckpoint("", path);
}

}  // namespace diond::checkpoint
