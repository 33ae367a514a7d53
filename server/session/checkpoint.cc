#include "server/session/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace diond::session {
namespace {

using nlohmann::json;

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

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status MakeDirs(const std::string& path) {
  std::string cur;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      cur = path.substr(0, i);
      if (!cur.empty() && mkdir(cur.c_str(), 0700) != 0 && errno != EEXIST) {
        return Errno("mkdir", cur);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status WriteFileSynced(const std::string& path, const std::string& bytes) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", path);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = Errno("write", path);
      close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    absl::Status s = Errno("fsync", path);
    close(fd);
    return s;
  }
  close(fd);
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : Errno("fsync", path);
}

void RemoveTree(const std::string& path) {
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      std::string child = path + "/" + n;
      struct stat st;
      if (lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        RemoveTree(child);
      } else {
        unlink(child.c_str());
      }
    }
    closedir(d);
  }
  rmdir(path.c_str());
}

const char* DTypeJson(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBf16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "f32";
}

}  // namespace

std::string SpecToJson(const SessionSpec& spec) {
  json j;
  j["non_finite"] = spec.non_finite == NonFinitePolicy::kSkip ? "skip" : "error";
  j["fp32_master_weights"] = spec.fp32_master_weights;
  j["client_name"] = spec.client_name;
  if (!spec.world_key.empty()) {  // world sessions only (local manifests stay as they were)
    j["world_key"] = spec.world_key;
    j["gradient_sync"] = std::string(GradientSyncName(spec.gradient_sync));
  }
  for (const GroupSpec& g : spec.groups) {
    const optim::GroupConfig& c = g.config;
    const optim::Hyperparams& h = c.hyperparams;
    json jg;
    jg["name"] = g.name;
    jg["algorithm"] = std::string(optim::AlgorithmName(c.algorithm));
    jg["precision"] = std::string(optim::PrecisionName(c.precision));
    jg["num_heads"] = c.num_heads;
    jg["split_sizes"] = c.split_sizes;
    jg["flatten"] = c.flatten;
    jg["seed"] = c.seed;
    jg["lr"] = h.lr;
    jg["weight_decay"] = h.weight_decay;
    jg["epsilon"] = h.epsilon;
    jg["mu"] = h.mu;
    jg["beta1"] = h.beta1;
    jg["beta2"] = h.beta2;
    jg["muon_beta2"] = h.muon_beta2;
    jg["fraction"] = h.fraction;
    jg["ef_decay"] = h.ef_decay;
    jg["rank_fraction"] = h.rank_fraction;
    jg["rank_multiple_of"] = h.rank_multiple_of;
    jg["nesterov"] = h.nesterov;
    jg["cautious_wd"] = h.cautious_wd;
    jg["adjust_lr"] = std::string(optim::AdjustLrName(h.adjust_lr));
    jg["orthogonalizer"] =
        h.orthogonalizer == optim::Orthogonalizer::kPolarExpress ? "polar_express" : "ns5";
    jg["qr_method"] = std::string(optim::QrMethodName(h.qr_method));
    jg["cqr_warmup_steps"] = h.cqr_warmup_steps;
    jg["rcqr_oversample"] = h.rcqr_oversample;
    j["groups"].push_back(jg);
  }
  for (const ParamSpec& p : spec.params) {
    j["params"].push_back(
        {{"name", p.name}, {"shape", p.shape}, {"dtype", DTypeJson(p.dtype)}, {"group", p.group}});
  }
  return j.dump(1);
}

absl::StatusOr<SessionSpec> SpecFromJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError("spec is not a JSON object");
  SessionSpec spec;
  // nlohmann's typed getters throw on a type mismatch; check types explicitly instead.
  auto str = [](const json& o, const char* k) -> std::string {
    return o.contains(k) && o[k].is_string() ? o[k].get<std::string>() : std::string();
  };
  auto num = [](const json& o, const char* k, double d) -> double {
    return o.contains(k) && o[k].is_number() ? o[k].get<double>() : d;
  };
  auto boolean = [](const json& o, const char* k) -> bool {
    return o.contains(k) && o[k].is_boolean() && o[k].get<bool>();
  };
  spec.non_finite = str(j, "non_finite") == "error" ? NonFinitePolicy::kError
                                                    : NonFinitePolicy::kSkip;
  spec.fp32_master_weights = boolean(j, "fp32_master_weights");
  spec.client_name = str(j, "client_name");
  spec.world_key = str(j, "world_key");
  for (GradientSync s : {GradientSync::kReplicated, GradientSync::kAverage,
                         GradientSync::kDionCompressed}) {
    if (str(j, "gradient_sync") == GradientSyncName(s)) spec.gradient_sync = s;
  }
  if (!j.contains("groups") || !j["groups"].is_array() || !j.contains("params") ||
      !j["params"].is_array()) {
    return absl::DataLossError("spec lacks groups or params");
  }
  for (const json& jg : j["groups"]) {
    if (!jg.is_object()) return absl::DataLossError("spec group is not an object");
    GroupSpec g;
    g.name = str(jg, "name");
    optim::GroupConfig& c = g.config;
    DIOND_ASSIGN_OR_RETURN(c.algorithm, optim::ParseAlgorithm(str(jg, "algorithm")));
    DIOND_ASSIGN_OR_RETURN(c.precision, optim::ParsePrecision(str(jg, "precision")));
    c.num_heads = static_cast<int64_t>(num(jg, "num_heads", 1));
    if (jg.contains("split_sizes") && jg["split_sizes"].is_array()) {
      for (const json& v : jg["split_sizes"]) {
        if (v.is_number_integer()) c.split_sizes.push_back(v.get<int64_t>());
      }
    }
    c.flatten = boolean(jg, "flatten");
    c.seed = jg.contains("seed") && jg["seed"].is_number_unsigned() ? jg["seed"].get<uint64_t>() : 0;
    optim::Hyperparams& h = c.hyperparams;
    h.lr = num(jg, "lr", h.lr);
    h.weight_decay = num(jg, "weight_decay", h.weight_decay);
    h.epsilon = num(jg, "epsilon", h.epsilon);
    h.mu = num(jg, "mu", h.mu);
    h.beta1 = num(jg, "beta1", h.beta1);
    h.beta2 = num(jg, "beta2", h.beta2);
    h.muon_beta2 = num(jg, "muon_beta2", h.muon_beta2);
    h.fraction = num(jg, "fraction", h.fraction);
    h.ef_decay = num(jg, "ef_decay", h.ef_decay);
    h.rank_fraction = num(jg, "rank_fraction", h.rank_fraction);
    h.rank_multiple_of = static_cast<int64_t>(num(jg, "rank_multiple_of", 1));
    h.nesterov = boolean(jg, "nesterov");
    h.cautious_wd = boolean(jg, "cautious_wd");
    DIOND_ASSIGN_OR_RETURN(h.adjust_lr, optim::ParseAdjustLr(str(jg, "adjust_lr")));
    h.orthogonalizer = str(jg, "orthogonalizer") == "ns5" ? optim::Orthogonalizer::kNewtonSchulz5
                                                         : optim::Orthogonalizer::kPolarExpress;
    // Absent in checkpoints written before Dion's qr_method existed: the defaults.
    if (jg.contains("qr_method")) {
      DIOND_ASSIGN_OR_RETURN(h.qr_method, optim::ParseQrMethod(str(jg, "qr_method")));
    }
    h.cqr_warmup_steps = static_cast<int64_t>(num(jg, "cqr_warmup_steps", h.cqr_warmup_steps));
    h.rcqr_oversample = num(jg, "rcqr_oversample", h.rcqr_oversample);
    spec.groups.push_back(std::move(g));
  }
  for (const json& jp : j["params"]) {
    if (!jp.is_object()) return absl::DataLossError("spec param is not an object");
    ParamSpec p;
    p.name = str(jp, "name");
    p.group = str(jp, "group");
    std::string d = str(jp, "dtype");
    p.dtype = d == "bf16" ? DType::kBf16 : d == "f16" ? DType::kF16 : DType::kF32;
    if (jp.contains("shape") && jp["shape"].is_array()) {
      for (const json& v : jp["shape"]) {
        if (!v.is_number_integer()) return absl::DataLossError("spec shape is not integral");
        p.shape.push_back(v.get<int64_t>());
      }
    }
    spec.params.push_back(std::move(p));
  }
  return spec;
}

absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(const std::string& root,
                                                                const std::string& session_id,
                                                                const SessionSnapshot& snapshot) {
  const std::string parent = absl::StrCat(root, "/", session_id);
  DIOND_RETURN_IF_ERROR(MakeDirs(parent));
  const std::string final_dir = absl::StrCat(parent, "/step-", snapshot.last_step_index);
  const std::string tmp_dir =
      absl::StrCat(parent, "/.tmp-step-", snapshot.last_step_index, "-", getpid());
  RemoveTree(tmp_dir);
  if (mkdir(tmp_dir.c_str(), 0700) != 0) return Errno("mkdir", tmp_dir);

  SafetensorsWriter writer;
  json manifest;
  manifest["format_version"] = 1;
  manifest["session_id"] = session_id;
  manifest["step_index"] = snapshot.last_step_index;
  manifest["spec"] = json::parse(SpecToJson(snapshot.spec));
  for (const NamedTensor& t : snapshot.tensors) {
    absl::Status s = writer.AddF32(t.name, t.shape, t.data);
    if (!s.ok()) {
      RemoveTree(tmp_dir);
      return s;
    }
    manifest["tensors"].push_back({{"name", t.name},
                                   {"shape", t.shape},
                                   {"file", "tensors.safetensors"},
                                   {"crc32", Crc32(t.data.data(), t.data.size() * 4)}});
  }
  std::string tensors = writer.Serialize();
  std::string manifest_text = manifest.dump(1);
  for (auto [name, bytes] : {std::pair<const char*, const std::string*>{"tensors.safetensors", &tensors},
                             {"manifest.json", &manifest_text}}) {
    absl::Status s = WriteFileSynced(absl::StrCat(tmp_dir, "/", name), *bytes);
    if (!s.ok()) {
      RemoveTree(tmp_dir);
      return s;
    }
  }
  DIOND_RETURN_IF_ERROR(FsyncDir(tmp_dir));
  RemoveTree(final_dir);  // re-saving the same step replaces it
  if (rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    absl::Status s = Errno("rename to", final_dir);
    RemoveTree(tmp_dir);
    return s;
  }
  DIOND_RETURN_IF_ERROR(FsyncDir(parent));
  return std::make_pair(final_dir,
                        static_cast<int64_t>(tensors.size() + manifest_text.size()));
}

absl::StatusOr<SessionSnapshot> ReadCheckpoint(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint directory at ", path));
  }
  const std::string manifest_path = path + "/manifest.json";
  std::ifstream in(manifest_path);
  if (!in) return absl::DataLossError(absl::StrCat("missing ", manifest_path));
  std::stringstream ss;
  ss << in.rdbuf();
  json manifest = json::parse(ss.str(), nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object() || !manifest.contains("spec") ||
      !manifest.contains("tensors") || !manifest["tensors"].is_array() ||
      !manifest.contains("step_index") || !manifest["step_index"].is_number_integer()) {
    return absl::DataLossError(absl::StrCat(manifest_path, " is corrupted or truncated"));
  }
  SessionSnapshot snap;
  auto spec = SpecFromJson(manifest["spec"].dump());
  if (!spec.ok()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": ", spec.status().message()));
  }
  snap.spec = *std::move(spec);
  snap.last_step_index = manifest["step_index"].get<int64_t>();
  std::map<std::string, SafetensorsFile> files;
  for (const json& jt : manifest["tensors"]) {
    if (!jt.is_object() || !jt.contains("name") || !jt["name"].is_string() ||
        !jt.contains("file") || !jt["file"].is_string() || !jt.contains("crc32") ||
        !jt["crc32"].is_number_unsigned()) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": bad tensor entry"));
    }
    const std::string file = jt["file"].get<std::string>();
    if (file.find('/') != std::string::npos || file == "..") {
      return absl::DataLossError(absl::StrCat(manifest_path, ": bad file name '", file, "'"));
    }
    const std::string file_path = path + "/" + file;
    auto it = files.find(file);
    if (it == files.end()) {
      auto f = SafetensorsFile::ReadFile(file_path);
      if (!f.ok()) {
        return absl::DataLossError(absl::StrCat(file_path, ": ", f.status().message()));
      }
      it = files.emplace(file, *std::move(f)).first;
    }
    NamedTensor t;
    t.name = jt["name"].get<std::string>();
    auto values = it->second.ReadFloat(t.name);
    if (!values.ok()) {
      return absl::DataLossError(absl::StrCat(file_path, ": tensor '", t.name, "': ",
                                              values.status().message()));
    }
    t.data = *std::move(values);
    if (Crc32(t.data.data(), t.data.size() * 4) != jt["crc32"].get<uint32_t>()) {
      return absl::DataLossError(
          absl::StrCat(file_path, ": tensor '", t.name, "' fails its CRC-32 check"));
    }
    const SafetensorsTensorInfo* info = it->second.Find(t.name);
    t.shape = info->shape;
    snap.tensors.push_back(std::move(t));
  }
  return snap;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root,
                                             const std::string& session_id) {
  const std::string parent = absl::StrCat(root, "/", session_id);
  DIR* d = opendir(parent.c_str());
  if (d == nullptr) return absl::NotFoundError(absl::StrCat("no checkpoints in ", parent));
  int64_t best = -1;
  while (dirent* e = readdir(d)) {
    absl::string_view n = e->d_name;
    int64_t step;
    if (absl::ConsumePrefix(&n, "step-") && absl::SimpleAtoi(n, &step) && step > best) {
      best = step;
    }
  }
  closedir(d);
  if (best < 0) return absl::NotFoundError(absl::StrCat("no checkpoints in ", parent));
  return absl::StrCat(parent, "/step-", best);
}

}  // namespace diond::session
