// The spec codec: SessionSpec <-> JSON, field by field. Fields added after the first format are
// optional on read (absent: the default they had before), so older checkpoints stay readable.
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/strict_json.h"
#include "kernels/optim/option_table.h"
#include "server/checkpoint/internal/files.h"
#include "server/checkpoint/internal/spec_json.h"
#include "server/checkpoint/manifest.h"

namespace diond::checkpoint {
namespace internal {
namespace {

using session::DType;
using session::GradientSync;
using session::GroupSpec;
using session::NonFinitePolicy;
using session::ParamSpec;
using session::SessionSpec;
using session::ValidateSessionName;
using strict_json::Field;
using strict_json::FieldError;
using strict_json::GetArray;
using strict_json::GetBool;
using strict_json::GetInt;
using strict_json::GetNumber;
using strict_json::GetString;
using strict_json::IntValue;
using json = strict_json::Json;

std::string TypeName(const json& v) { return v.type_name(); }

const char* DTypeJson(DType d) {
  switch (d) {
    case DType::kF32:
      return "f32";
    case DType::kBf16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "f32";
}

// One option of group `jg` (path `w`), under its checkpoint key (the Hyperparams member).
// The algorithm-specific ranges are Session::Create's, the same checks CreateSession makes;
// here only the type, and the integers' bounds.
absl::StatusOr<optim::OptionValue> OptionFromJson(const json& jg, const std::string& w,
                                                  const optim::OptionRow& row) {
  const std::string key(row.member);
  optim::OptionValue v;
  switch (row.type) {
    case optim::OptionType::kDouble: {
      DIOND_ASSIGN_OR_RETURN(v.number, GetNumber(jg, key.c_str(), w));
      break;
    }
    case optim::OptionType::kInt: {
      DIOND_ASSIGN_OR_RETURN(v.integer,
                             GetInt(jg, key.c_str(), w, static_cast<int64_t>(row.range.lo),
                                    static_cast<int64_t>(row.range.hi)));
      break;
    }
    case optim::OptionType::kBool: {
      DIOND_ASSIGN_OR_RETURN(bool b, GetBool(jg, key.c_str(), w));
      v.integer = b ? 1 : 0;
      break;
    }
    case optim::OptionType::kEnum: {
      DIOND_ASSIGN_OR_RETURN(std::string name, GetString(jg, key.c_str(), w));
      v.integer = -1;
      std::string known;
      for (size_t i = 0; i < row.enum_names.size(); ++i) {
        if (name == row.enum_names[i]) v.integer = static_cast<int64_t>(i);
        absl::StrAppend(&known,
                        i == 0                           ? ""
                        : i + 1 == row.enum_names.size() ? " or "
                                                         : ", ",
                        row.enum_names[i]);
      }
      if (v.integer < 0) {
        return FieldError(absl::StrCat(w, key), absl::StrCat("'", Echo(name), "' is not ", known));
      }
      break;
    }
  }
  return v;
}

// The hyperparameters of group `jg` (path `w`) of `algorithm`: every row of the option table. An
// option added after the first format is absent from older checkpoints, which load with its
// default. A value outside its row's range, for an algorithm that reads it, is a damaged
// checkpoint (DATA_LOSS), not a bad request: no valid session could have written it.
absl::Status HyperparamsFromJson(const json& jg, const std::string& w,
                                 optim::AlgorithmKind algorithm, optim::Hyperparams& h) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    if (row.since == optim::OptionSince::kLater && !jg.contains(std::string(row.member))) continue;
    DIOND_ASSIGN_OR_RETURN(optim::OptionValue v, OptionFromJson(jg, w, row));
    if (row.AppliesTo(algorithm)) {
      if (absl::Status s = row.CheckRange(v); !s.ok()) {
        return FieldError(absl::StrCat(w, row.member), s.message());
      }
    }
    row.set(h, v);
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupSpec> GroupFromJson(const json& jg, const std::string& w) {
  if (!jg.is_object()) return FieldError(w.substr(0, w.size() - 1), "is not a JSON object");
  GroupSpec g;
  DIOND_ASSIGN_OR_RETURN(g.name, GetString(jg, "name", w, 512));
  optim::GroupConfig& c = g.config;
  DIOND_ASSIGN_OR_RETURN(std::string algorithm, GetString(jg, "algorithm", w));
  auto a = optim::ParseAlgorithm(algorithm);
  if (!a.ok()) return FieldError(absl::StrCat(w, "algorithm"), a.status().message());
  c.algorithm = *a;
  DIOND_ASSIGN_OR_RETURN(std::string precision, GetString(jg, "precision", w));
  auto p = optim::ParsePrecision(precision);
  if (!p.ok()) return FieldError(absl::StrCat(w, "precision"), p.status().message());
  c.precision = *p;
  // Optional (checkpoints before the field have none: auto, the default).
  if (jg.contains("bf16_matmul")) {
    DIOND_ASSIGN_OR_RETURN(std::string mm, GetString(jg, "bf16_matmul", w));
    auto e = optim::ParseBf16MatmulEngine(mm);
    if (!e.ok()) return FieldError(absl::StrCat(w, "bf16_matmul"), e.status().message());
    c.bf16_matmul = *e;
  }
  DIOND_ASSIGN_OR_RETURN(c.num_heads, GetInt(jg, "num_heads", w, 1, int64_t{1} << 31));
  DIOND_ASSIGN_OR_RETURN(const json* splits, GetArray(jg, "split_sizes", w, 1 << 16));
  for (size_t i = 0; i < splits->size(); ++i) {
    DIOND_ASSIGN_OR_RETURN(
        int64_t v,
        IntValue((*splits)[i], absl::StrCat(w, "split_sizes[", i, "]"), 1, int64_t{1} << 40));
    c.split_sizes.push_back(v);
  }
  DIOND_ASSIGN_OR_RETURN(c.flatten, GetBool(jg, "flatten", w));
  DIOND_ASSIGN_OR_RETURN(const json* seed, Field(jg, "seed", w));
  if (!seed->is_number_unsigned() && !(seed->is_number_integer() && seed->get<int64_t>() == 0)) {
    return FieldError(absl::StrCat(w, "seed"), "expected an unsigned 64-bit integer");
  }
  c.seed = seed->get<uint64_t>();
  DIOND_RETURN_IF_ERROR(HyperparamsFromJson(jg, w, c.algorithm, c.hyperparams));
  return g;
}

absl::StatusOr<ParamSpec> ParamFromJson(const json& jp, const std::string& w) {
  if (!jp.is_object()) return FieldError(w.substr(0, w.size() - 1), "is not a JSON object");
  ParamSpec p;
  DIOND_ASSIGN_OR_RETURN(p.name, GetString(jp, "name", w, 512));
  DIOND_ASSIGN_OR_RETURN(p.group, GetString(jp, "group", w, 512));
  DIOND_ASSIGN_OR_RETURN(const json* d, Field(jp, "dtype", w));
  const std::string ds = d->is_string() ? d->get<std::string>() : std::string();
  if (ds == "f32") {
    p.dtype = DType::kF32;
  } else if (ds == "bf16") {
    p.dtype = DType::kBf16;
  } else if (ds == "f16") {
    p.dtype = DType::kF16;
  } else {
    return FieldError(absl::StrCat(w, "dtype"),
                      absl::StrCat(d->is_string() ? absl::StrCat("'", Echo(ds), "'")
                                                  : absl::StrCat("a ", TypeName(*d)),
                                   " is not f32, bf16 or f16"));
  }
  DIOND_ASSIGN_OR_RETURN(p.shape, GetShape(jp, "shape", w));
  return p;
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> GetShape(const json& o, const char* key,
                                              const std::string& where) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  const std::string field = absl::StrCat(where, key);
  if (!v->is_array())
    return FieldError(field, absl::StrCat("expected an array, got ", TypeName(*v)));
  if (v->size() > 16) return FieldError(field, absl::StrCat(v->size(), " dimensions; at most 16"));
  std::vector<int64_t> shape;
  for (size_t i = 0; i < v->size(); ++i) {
    DIOND_ASSIGN_OR_RETURN(
        int64_t d, IntValue((*v)[i], absl::StrCat(field, "[", i, "]"), 0, int64_t{1} << 40));
    shape.push_back(d);
  }
  return shape;
}

absl::StatusOr<SessionSpec> SpecFromJsonValue(const json& j, const std::string& where) {
  if (!j.is_object())
    return FieldError(where.empty() ? "spec" : where.substr(0, where.size() - 1),
                      "is not a JSON object");
  SessionSpec spec;
  DIOND_ASSIGN_OR_RETURN(std::string nf, GetString(j, "non_finite", where));
  if (nf == "skip") {
    spec.non_finite = NonFinitePolicy::kSkip;
  } else if (nf == "error") {
    spec.non_finite = NonFinitePolicy::kError;
  } else {
    return FieldError(absl::StrCat(where, "non_finite"),
                      absl::StrCat("'", Echo(nf), "' is not skip or error"));
  }
  DIOND_ASSIGN_OR_RETURN(spec.fp32_master_weights, GetBool(j, "fp32_master_weights", where));
  DIOND_ASSIGN_OR_RETURN(spec.client_name, GetString(j, "client_name", where));
  if (j.contains("session_name")) {
    DIOND_ASSIGN_OR_RETURN(spec.session_name, GetString(j, "session_name", where));
    if (absl::Status s = ValidateSessionName(spec.session_name); !s.ok()) {
      return FieldError(absl::StrCat(where, "session_name"), s.message());
    }
  }
  if (j.contains("owner")) {
    DIOND_ASSIGN_OR_RETURN(spec.owner, GetString(j, "owner", where));
  }
  if (j.contains("world_key")) {
    DIOND_ASSIGN_OR_RETURN(spec.world_key, GetString(j, "world_key", where, 128));
    DIOND_ASSIGN_OR_RETURN(std::string gs, GetString(j, "gradient_sync", where));
    bool known = false;
    for (GradientSync s :
         {GradientSync::kReplicated, GradientSync::kAverage, GradientSync::kDionCompressed}) {
      if (gs == GradientSyncName(s)) {
        spec.gradient_sync = s;
        known = true;
      }
    }
    if (!known) {
      return FieldError(absl::StrCat(where, "gradient_sync"),
                        absl::StrCat("unknown value '", Echo(gs), "'"));
    }
  }
  DIOND_ASSIGN_OR_RETURN(const json* groups, GetArray(j, "groups", where, 4096));
  DIOND_ASSIGN_OR_RETURN(const json* params, GetArray(j, "params", where, 1 << 20));
  for (size_t gi = 0; gi < groups->size(); ++gi) {
    DIOND_ASSIGN_OR_RETURN(GroupSpec g,
                           GroupFromJson((*groups)[gi], absl::StrCat(where, "groups[", gi, "].")));
    spec.groups.push_back(std::move(g));
  }
  for (size_t pi = 0; pi < params->size(); ++pi) {
    DIOND_ASSIGN_OR_RETURN(ParamSpec p,
                           ParamFromJson((*params)[pi], absl::StrCat(where, "params[", pi, "].")));
    spec.params.push_back(std::move(p));
  }
  return spec;
}

json SpecToJsonValue(const SessionSpec& spec) {
  json j;
  j["non_finite"] = spec.non_finite == NonFinitePolicy::kSkip ? "skip" : "error";
  j["fp32_master_weights"] = spec.fp32_master_weights;
  j["client_name"] = spec.client_name;
  if (!spec.session_name.empty()) j["session_name"] = spec.session_name;
  if (!spec.owner.empty()) j["owner"] = spec.owner;
  if (!spec.world_key.empty()) {  // world sessions only (local manifests stay as they were)
    j["world_key"] = spec.world_key;
    j["gradient_sync"] = std::string(GradientSyncName(spec.gradient_sync));
  }
  j["groups"] = json::array();
  j["params"] = json::array();
  for (const GroupSpec& g : spec.groups) {
    const optim::GroupConfig& c = g.config;
    const optim::Hyperparams& h = c.hyperparams;
    json jg;
    jg["name"] = g.name;
    jg["algorithm"] = std::string(optim::AlgorithmName(c.algorithm));
    jg["precision"] = std::string(optim::PrecisionName(c.precision));
    jg["bf16_matmul"] = std::string(optim::Bf16MatmulEngineName(c.bf16_matmul));
    jg["num_heads"] = c.num_heads;
    jg["split_sizes"] = c.split_sizes;
    jg["flatten"] = c.flatten;
    jg["seed"] = c.seed;
    for (const optim::OptionRow& row : optim::OptionTable()) {
      const optim::OptionValue v = row.get(h);
      json& out = jg[std::string(row.member)];
      switch (row.type) {
        case optim::OptionType::kDouble:
          out = v.number;
          break;
        case optim::OptionType::kInt:
          out = v.integer;
          break;
        case optim::OptionType::kBool:
          out = v.integer != 0;
          break;
        case optim::OptionType::kEnum:
          out = row.Format(v);
          break;
      }
    }
    j["groups"].push_back(jg);
  }
  for (const ParamSpec& p : spec.params) {
    j["params"].push_back(
        {{"name", p.name}, {"shape", p.shape}, {"dtype", DTypeJson(p.dtype)}, {"group", p.group}});
  }
  return j;
}

}  // namespace internal

std::string SpecToJson(const session::SessionSpec& spec) {
  return internal::SpecToJsonValue(spec).dump(1);
}

absl::StatusOr<session::SessionSpec> SpecFromJson(const std::string& text) {
  if (strict_json::JsonDepth(text, kMaxManifestDepth) > kMaxManifestDepth) {
    return absl::DataLossError("spec: JSON nested too deeply");
  }
  strict_json::Json j = strict_json::Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError("spec is not a JSON object");
  return internal::SpecFromJsonValue(j, "");
}

}  // namespace diond::checkpoint
