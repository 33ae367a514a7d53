#include "server/checkpoint/manifest.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/strict_json.h"
#include "server/checkpoint/internal/files.h"
#include "server/checkpoint/internal/spec_json.h"

namespace diond::checkpoint {
namespace {

using internal::Echo;
using session::StepResult;
using strict_json::Field;
using strict_json::FieldError;
using strict_json::GetArray;
using strict_json::GetBool;
using strict_json::GetInt;
using strict_json::GetNumber;
using strict_json::GetString;
using json = strict_json::Json;

json StepResultToJson(const StepResult& r) {
  json j;
  j["step_index"] = r.step_index;
  j["skipped"] = r.skipped;
  json norms = json::object();
  for (const auto& [g, n] : r.update_norms) {
    if (std::isfinite(n)) {
      norms[g] = n;
    } else {
      norms[g] = nullptr;  // JSON has no NaN/Inf; a non-finite norm comes back as NaN
    }
  }
  j["update_norms"] = norms;
  j["compute_micros"] = r.compute_micros;
  j["total_micros"] = r.total_micros;
  j["world_bytes_sent"] = r.world_bytes_sent;
  j["checksum_mismatches"] = r.checksum_mismatches;
  // A replayed clipped step answers its norm again; non-finite gradients' norm is null (NaN).
  if (std::isfinite(r.grad_norm)) {
    j["grad_norm"] = r.grad_norm;
  } else {
    j["grad_norm"] = nullptr;
  }
  return j;
}

absl::StatusOr<StepResult> StepResultFromJson(const json& j, int64_t step_index) {
  const std::string w = "last_step.";
  if (!j.is_object()) return FieldError("last_step", "is not a JSON object");
  StepResult r;
  DIOND_ASSIGN_OR_RETURN(r.step_index, GetInt(j, "step_index", w, step_index, step_index));
  DIOND_ASSIGN_OR_RETURN(r.skipped, GetBool(j, "skipped", w));
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max();
  DIOND_ASSIGN_OR_RETURN(r.compute_micros, GetInt(j, "compute_micros", w, 0, kBig));
  DIOND_ASSIGN_OR_RETURN(r.total_micros, GetInt(j, "total_micros", w, 0, kBig));
  DIOND_ASSIGN_OR_RETURN(r.world_bytes_sent, GetInt(j, "world_bytes_sent", w, 0, kBig));
  DIOND_ASSIGN_OR_RETURN(r.checksum_mismatches, GetInt(j, "checksum_mismatches", w, 0, kBig));
  // Absent in checkpoints written before the daemon clipped: 0, as for an unclipped step.
  if (auto g = j.find("grad_norm"); g != j.end()) {
    if (g->is_null()) {
      r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    } else {
      DIOND_ASSIGN_OR_RETURN(r.grad_norm, GetNumber(j, "grad_norm", w, 0.0));
    }
  }
  DIOND_ASSIGN_OR_RETURN(const json* norms, Field(j, "update_norms", w));
  if (!norms->is_object() || norms->size() > 4096) {
    return FieldError("last_step.update_norms", "expected an object of at most 4096 groups");
  }
  for (auto it = norms->begin(); it != norms->end(); ++it) {
    if (it->is_null()) {
      r.update_norms[it.key()] = std::numeric_limits<double>::quiet_NaN();
    } else if (it->is_number()) {
      r.update_norms[it.key()] = it->get<double>();
    } else {
      return FieldError(absl::StrCat("last_step.update_norms['", Echo(it.key()), "']"),
                        absl::StrCat("expected a number, got ", it->type_name()));
    }
  }
  return r;
}

}  // namespace

bool IsValidSessionId(absl::string_view id) {
  if (id.empty() || id.size() > 128 || id[0] == '.') return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

uint32_t Crc32(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    uInt n = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    bytes -= n;
  }
  return static_cast<uint32_t>(crc);
}

std::string EncodeManifest(const std::string& session_id,
                           const session::SessionSnapshot& snapshot) {
  json manifest;
  manifest["format_version"] = 1;
  manifest["session_id"] = session_id;
  manifest["step_index"] = snapshot.last_step_index;
  manifest["spec"] = internal::SpecToJsonValue(snapshot.spec);
  if (snapshot.last_result.has_value()) {
    manifest["last_step"] = StepResultToJson(*snapshot.last_result);
  }
  manifest["tensors"] = json::array();
  for (const session::NamedTensor& t : snapshot.tensors) {
    manifest["tensors"].push_back({{"name", t.name},
                                   {"shape", t.shape},
                                   {"dtype", "F32"},
                                   {"file", kTensorsFile},
                                   {"crc32", Crc32(t.data.data(), t.data.size() * 4)}});
  }
  return manifest.dump(1);
}

absl::Status DecodeManifest(const std::string& text, session::SessionSnapshot* snap,
                            std::vector<ManifestTensor>* tensors) {
  const int depth = strict_json::JsonDepth(text, kMaxManifestDepth);
  if (depth > kMaxManifestDepth) {
    return absl::DataLossError(
        absl::StrCat("JSON nested more than ", kMaxManifestDepth, " levels deep"));
  }
  json m = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded()) return absl::DataLossError("not valid JSON (corrupted or truncated)");
  if (!m.is_object()) return absl::DataLossError("not a JSON object");
  DIOND_ASSIGN_OR_RETURN(int64_t version, GetInt(m, "format_version", "", 1, 1));
  (void)version;
  DIOND_ASSIGN_OR_RETURN(std::string id, GetString(m, "session_id", "", 128));
  if (!IsValidSessionId(id)) {
    return FieldError("session_id", absl::StrCat("'", Echo(id), "' is not a session id"));
  }
  snap->session_id = id;
  DIOND_ASSIGN_OR_RETURN(snap->last_step_index,
                         GetInt(m, "step_index", "", 0, kMaxCheckpointStepIndex));
  DIOND_ASSIGN_OR_RETURN(const json* spec, Field(m, "spec", ""));
  DIOND_ASSIGN_OR_RETURN(snap->spec, internal::SpecFromJsonValue(*spec, "spec."));
  if (m.contains("last_step")) {
    DIOND_ASSIGN_OR_RETURN(StepResult r, StepResultFromJson(m["last_step"], snap->last_step_index));
    snap->last_result = std::move(r);
  }
  DIOND_ASSIGN_OR_RETURN(const json* list, GetArray(m, "tensors", "", 1 << 22));
  std::set<std::string> seen;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& jt = (*list)[i];
    const std::string w = absl::StrCat("tensors[", i, "].");
    if (!jt.is_object()) return FieldError(absl::StrCat("tensors[", i, "]"), "is not an object");
    ManifestTensor t;
    DIOND_ASSIGN_OR_RETURN(t.name, GetString(jt, "name", w, 1024));
    if (!seen.insert(t.name).second) {
      return FieldError(absl::StrCat(w, "name"),
                        absl::StrCat("'", Echo(t.name), "' is listed twice"));
    }
    DIOND_ASSIGN_OR_RETURN(t.shape, internal::GetShape(jt, "shape", w));
    DIOND_ASSIGN_OR_RETURN(std::string file, GetString(jt, "file", w, 256));
    if (file != kTensorsFile) {
      return FieldError(absl::StrCat(w, "file"),
                        absl::StrCat("'", Echo(file), "' is not ", kTensorsFile));
    }
    if (jt.contains("dtype")) {
      DIOND_ASSIGN_OR_RETURN(std::string dt, GetString(jt, "dtype", w, 16));
      if (dt != "F32") {
        return FieldError(absl::StrCat(w, "dtype"), absl::StrCat("'", Echo(dt), "' is not F32"));
      }
    }
    DIOND_ASSIGN_OR_RETURN(int64_t crc, GetInt(jt, "crc32", w, 0, 0xffffffffll));
    t.crc = static_cast<uint32_t>(crc);
    tensors->push_back(std::move(t));
  }
  return absl::OkStatus();
}

}  // namespace diond::checkpoint
