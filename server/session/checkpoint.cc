#include "server/session/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace diond::session {
namespace {

using nlohmann::json;

constexpr char kManifest[] = "manifest.json";
constexpr char kTensors[] = "tensors.safetensors";
constexpr char kClosedMarker[] = "closed";

// Client-controlled text in messages is capped.
// At most 100 bytes of a path or value, control characters shown as '?' (common/bounded.h), so
// that a message stays short and one line (a newline in a path reached it raw: session_fuzz).
std::string Echo(absl::string_view s) {
  if (s.size() <= 100) return Bounded(s);
  return absl::StrCat(Bounded(s.substr(0, 100)), "... (", s.size(), " bytes)");
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

absl::Status Errno(absl::string_view what, absl::string_view path, int err = errno) {
  const std::string m = absl::StrCat(what, " ", Echo(path), ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(m);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(m);
  return absl::InternalError(m);
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

// openat2(dirfd, path, RESOLVE_BENEATH): nothing in `path`, symlinks and ".." included, may
// resolve outside `dirfd`. Where the kernel lacks openat2 (before 5.6), an equivalent walk: one
// component at a time with O_NOFOLLOW, refusing ".." and every symlink.
int OpenBeneath(int dirfd, const std::string& path, int flags) {
  struct open_how how;
  std::memset(&how, 0, sizeof(how));
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = syscall(SYS_openat2, dirfd, path.c_str(), &how, sizeof(how));
  if (fd >= 0 || errno != ENOSYS) return static_cast<int>(fd);
  Fd cur(dup(dirfd));
  std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
  if (parts.empty()) parts.push_back(".");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i] == "..") {
      errno = EXDEV;
      return -1;
    }
    const bool last = i + 1 == parts.size();
    int f = openat(cur.get(), parts[i].c_str(),
                   (last ? flags : (O_RDONLY | O_DIRECTORY)) | O_NOFOLLOW | O_CLOEXEC);
    if (f < 0) return -1;  // ELOOP for a symlink
    cur = Fd(f);
  }
  return cur.release();
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

std::string StripTrailingSlashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

absl::Status WriteFileAt(int dirfd, const char* name, const std::string& bytes,
                         const std::string& display) {
  Fd fd(openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) return Errno("create", display);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", display);
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd.get()) != 0) return Errno("fsync", display);
  return absl::OkStatus();
}

// Removes `name` (a directory tree or a file) under `dirfd`, never following symlinks.
void RemoveTreeAt(int parent, const std::string& name) {
  if (unlinkat(parent, name.c_str(), 0) == 0) return;
  int fd = openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    if (DIR* d = fdopendir(fd)) {  // takes fd
      std::vector<std::string> children;
      while (dirent* e = readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") children.push_back(n);
      }
      for (const std::string& c : children) RemoveTreeAt(dirfd(d), c);
      closedir(d);
    } else {
      close(fd);
    }
  }
  unlinkat(parent, name.c_str(), AT_REMOVEDIR);
}

std::vector<std::string> ListDir(int dirfd) {
  std::vector<std::string> out;
  int fd = dup(dirfd);
  if (fd < 0) return out;
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    close(fd);
    return out;
  }
  rewinddir(d);
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  closedir(d);
  return out;
}

// "step-<N>" -> N (N a plain non-negative decimal), else -1.
int64_t StepOfName(absl::string_view n) {
  if (!absl::ConsumePrefix(&n, "step-") || n.empty() || n.size() > 19) return -1;
  for (char c : n) {
    if (c < '0' || c > '9') return -1;
  }
  int64_t step;
  return absl::SimpleAtoi(n, &step) ? step : -1;
}

const char* DTypeJson(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBf16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "f32";
}

// ---- strict JSON access -------------------------------------------------------------------------
// Each getter names the field by its path (e.g. "spec.groups[1].lr") in a DATA_LOSS.

std::string TypeName(const json& v) { return v.type_name(); }

absl::Status FieldError(const std::string& field, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(field, ": ", what));
}

absl::StatusOr<const json*> Field(const json& o, const char* key, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end()) return FieldError(absl::StrCat(where, key), "missing");
  return &*it;
}

absl::StatusOr<std::string> GetString(const json& o, const char* key, const std::string& where,
                                      size_t max_bytes = 4096) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  if (!v->is_string()) {
    return FieldError(absl::StrCat(where, key), absl::StrCat("expected a string, got ",
                                                             TypeName(*v)));
  }
  const std::string& s = v->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(s.size(), " bytes; at most ", max_bytes));
  }
  return s;
}

absl::StatusOr<bool> GetBool(const json& o, const char* key, const std::string& where) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  if (!v->is_boolean()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected true or false, got ", TypeName(*v)));
  }
  return v->get<bool>();
}

// An integer in [lo, hi].
absl::StatusOr<int64_t> IntValue(const json& v, const std::string& field, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) {
    return FieldError(field, absl::StrCat("expected an integer, got ", TypeName(v)));
  }
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

absl::StatusOr<int64_t> GetInt(const json& o, const char* key, const std::string& where,
                               int64_t lo, int64_t hi) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  return IntValue(*v, absl::StrCat(where, key), lo, hi);
}

// A finite number >= `lo` (the algorithm-specific ranges are Session::Create's, the same checks
// CreateSession makes).
absl::StatusOr<double> GetNumber(const json& o, const char* key, const std::string& where,
                                 double lo = -std::numeric_limits<double>::infinity()) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  if (!v->is_number()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected a number, got ", TypeName(*v)));
  }
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(d, " is out of range (finite, >= ", lo, ")"));
  }
  return d;
}

absl::StatusOr<std::vector<int64_t>> GetShape(const json& o, const char* key,
                                              const std::string& where) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  const std::string field = absl::StrCat(where, key);
  if (!v->is_array()) return FieldError(field, absl::StrCat("expected an array, got ", TypeName(*v)));
  if (v->size() > 16) return FieldError(field, absl::StrCat(v->size(), " dimensions; at most 16"));
  std::vector<int64_t> shape;
  for (size_t i = 0; i < v->size(); ++i) {
    DIOND_ASSIGN_OR_RETURN(int64_t d,
                           IntValue((*v)[i], absl::StrCat(field, "[", i, "]"), 0, int64_t{1} << 40));
    shape.push_back(d);
  }
  return shape;
}

absl::StatusOr<const json*> GetArray(const json& o, const char* key, const std::string& where,
                                     size_t max_items) {
  DIOND_ASSIGN_OR_RETURN(const json* v, Field(o, key, where));
  if (!v->is_array()) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat("expected an array, got ", TypeName(*v)));
  }
  if (v->size() > max_items) {
    return FieldError(absl::StrCat(where, key),
                      absl::StrCat(v->size(), " entries; at most ", max_items));
  }
  return v;
}

absl::StatusOr<SessionSpec> SpecFromJsonValue(const json& j, const std::string& where) {
  if (!j.is_object()) return FieldError(where.empty() ? "spec" : where.substr(0, where.size() - 1),
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
    for (GradientSync s : {GradientSync::kReplicated, GradientSync::kAverage,
                           GradientSync::kDionCompressed}) {
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
    const json& jg = (*groups)[gi];
    const std::string w = absl::StrCat(where, "groups[", gi, "].");
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
      DIOND_ASSIGN_OR_RETURN(int64_t v, IntValue((*splits)[i],
                                                 absl::StrCat(w, "split_sizes[", i, "]"), 1,
                                                 int64_t{1} << 40));
      c.split_sizes.push_back(v);
    }
    DIOND_ASSIGN_OR_RETURN(c.flatten, GetBool(jg, "flatten", w));
    DIOND_ASSIGN_OR_RETURN(const json* seed, Field(jg, "seed", w));
    if (!seed->is_number_unsigned() && !(seed->is_number_integer() && seed->get<int64_t>() == 0)) {
      return FieldError(absl::StrCat(w, "seed"), "expected an unsigned 64-bit integer");
    }
    c.seed = seed->get<uint64_t>();
    optim::Hyperparams& h = c.hyperparams;
    DIOND_ASSIGN_OR_RETURN(h.lr, GetNumber(jg, "lr", w, 0));
    DIOND_ASSIGN_OR_RETURN(h.weight_decay, GetNumber(jg, "weight_decay", w, 0));
    DIOND_ASSIGN_OR_RETURN(h.epsilon, GetNumber(jg, "epsilon", w, 0));
    DIOND_ASSIGN_OR_RETURN(h.mu, GetNumber(jg, "mu", w));
    DIOND_ASSIGN_OR_RETURN(h.beta1, GetNumber(jg, "beta1", w));
    DIOND_ASSIGN_OR_RETURN(h.beta2, GetNumber(jg, "beta2", w));
    DIOND_ASSIGN_OR_RETURN(h.muon_beta2, GetNumber(jg, "muon_beta2", w));
    DIOND_ASSIGN_OR_RETURN(h.fraction, GetNumber(jg, "fraction", w));
    DIOND_ASSIGN_OR_RETURN(h.ef_decay, GetNumber(jg, "ef_decay", w));
    DIOND_ASSIGN_OR_RETURN(h.rank_fraction, GetNumber(jg, "rank_fraction", w));
    DIOND_ASSIGN_OR_RETURN(h.rank_multiple_of,
                           GetInt(jg, "rank_multiple_of", w, 1, int64_t{1} << 31));
    DIOND_ASSIGN_OR_RETURN(h.nesterov, GetBool(jg, "nesterov", w));
    DIOND_ASSIGN_OR_RETURN(h.cautious_wd, GetBool(jg, "cautious_wd", w));
    DIOND_ASSIGN_OR_RETURN(std::string adjust, GetString(jg, "adjust_lr", w));
    auto adj = optim::ParseAdjustLr(adjust);
    if (!adj.ok()) return FieldError(absl::StrCat(w, "adjust_lr"), adj.status().message());
    h.adjust_lr = *adj;
    DIOND_ASSIGN_OR_RETURN(std::string ortho, GetString(jg, "orthogonalizer", w));
    if (ortho == "polar_express") {
      h.orthogonalizer = optim::Orthogonalizer::kPolarExpress;
    } else if (ortho == "ns5") {
      h.orthogonalizer = optim::Orthogonalizer::kNewtonSchulz5;
    } else {
      return FieldError(absl::StrCat(w, "orthogonalizer"),
                        absl::StrCat("'", Echo(ortho), "' is not polar_express or ns5"));
    }
    // Dion's QR method: absent in checkpoints written before it existed (the defaults then).
    if (jg.contains("qr_method")) {
      DIOND_ASSIGN_OR_RETURN(std::string qr, GetString(jg, "qr_method", w));
      auto q = optim::ParseQrMethod(qr);
      if (!q.ok()) return FieldError(absl::StrCat(w, "qr_method"), q.status().message());
      h.qr_method = *q;
    }
    if (jg.contains("cqr_warmup_steps")) {
      DIOND_ASSIGN_OR_RETURN(h.cqr_warmup_steps,
                             GetInt(jg, "cqr_warmup_steps", w, 0, int64_t{1} << 53));
    }
    if (jg.contains("rcqr_oversample")) {
      DIOND_ASSIGN_OR_RETURN(h.rcqr_oversample, GetNumber(jg, "rcqr_oversample", w, 0));
    }
    spec.groups.push_back(std::move(g));
  }
  for (size_t pi = 0; pi < params->size(); ++pi) {
    const json& jp = (*params)[pi];
    const std::string w = absl::StrCat(where, "params[", pi, "].");
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
    spec.params.push_back(std::move(p));
  }
  return spec;
}

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
                        absl::StrCat("expected a number, got ", TypeName(*it)));
    }
  }
  return r;
}

// Reads all of an open file whose size is at most `limit` (checked with fstat before reading).
absl::StatusOr<std::string> ReadBounded(int fd, int64_t limit, const std::string& display) {
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::DataLossError(absl::StrCat("cannot stat ", display));
  if (!S_ISREG(st.st_mode)) return absl::DataLossError(absl::StrCat(display, " is not a file"));
  if (st.st_size > limit) {
    return absl::DataLossError(absl::StrCat(display, " is ", st.st_size,
                                            " bytes; the limit is ", limit, " bytes"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (done != out.size()) {
    return absl::DataLossError(absl::StrCat(display, ": short read (", done, " of ", out.size(),
                                            " bytes)"));
  }
  return out;
}

struct ManifestTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t crc = 0;
};

// The parsed manifest.json: everything but the tensor data.
absl::Status ParseManifest(const std::string& text, SessionSnapshot* snap,
                           std::vector<ManifestTensor>* tensors) {
  const int depth = JsonDepth(text, kMaxManifestDepth);
  if (depth > kMaxManifestDepth) {
    return absl::DataLossError(absl::StrCat("JSON nested more than ", kMaxManifestDepth,
                                            " levels deep"));
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
  DIOND_ASSIGN_OR_RETURN(snap->spec, SpecFromJsonValue(*spec, "spec."));
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
      return FieldError(absl::StrCat(w, "name"), absl::StrCat("'", Echo(t.name), "' is listed twice"));
    }
    DIOND_ASSIGN_OR_RETURN(t.shape, GetShape(jt, "shape", w));
    DIOND_ASSIGN_OR_RETURN(std::string file, GetString(jt, "file", w, 256));
    if (file != kTensors) {
      return FieldError(absl::StrCat(w, "file"),
                        absl::StrCat("'", Echo(file), "' is not ", kTensors));
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

int OpenInDir(int dirfd, const char* name) {
  return openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
}

// One attempt at reading the checkpoint in `dir`. *retry: a file vanished because a re-save
// replaced the directory meanwhile (the caller opens the path again).
absl::StatusOr<SessionSnapshot> ReadCheckpointOnce(const CheckpointDir& dir, bool* retry) {
  *retry = false;
  // For messages only (bounded, one line: found by session_fuzz).
  const std::string manifest_path = absl::StrCat(Echo(dir.path()), "/", kManifest);
  const std::string tensors_path = absl::StrCat(Echo(dir.path()), "/", kTensors);
  Fd mfd(OpenInDir(dir.fd(), kManifest));
  const int merr = errno;
  Fd tfd(OpenInDir(dir.fd(), kTensors));
  const int terr = errno;
  if (mfd.get() < 0 || tfd.get() < 0) {
    // Both files exist in every complete checkpoint. Missing ones may have been removed with the
    // directory after a re-save switched a new one in: the caller looks again (*retry) and
    // reports this error if the path still names the same directory.
    *retry = merr == ENOENT || terr == ENOENT;
    if (mfd.get() < 0) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": cannot open: ",
                                              std::strerror(merr)));
    }
    return absl::DataLossError(absl::StrCat(tensors_path, ": cannot open: ", std::strerror(terr)));
  }
  auto text = ReadBounded(mfd.get(), kMaxManifestBytes, manifest_path);
  if (!text.ok()) return text.status();
  SessionSnapshot snap;
  std::vector<ManifestTensor> entries;
  if (absl::Status s = ParseManifest(*text, &snap, &entries); !s.ok()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": ", s.message()));
  }
  // The tensor file holds exactly the listed tensors (f32): anything larger is refused by its
  // size before it is read.
  uint64_t limit = 8 + SafetensorsFile::kMaxHeaderBytes;
  for (const ManifestTensor& t : entries) {
    uint64_t n = 4;
    for (int64_t d : t.shape) {
      if (d != 0 && n > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) {
        return absl::DataLossError(absl::StrCat(manifest_path, ": tensor '", Echo(t.name),
                                                "': shape overflows"));
      }
      n *= static_cast<uint64_t>(d);
    }
    limit += n;
    if (limit > (uint64_t{1} << 62)) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": tensors too large"));
    }
  }
  auto bytes = ReadBounded(tfd.get(), static_cast<int64_t>(limit), tensors_path);
  if (!bytes.ok()) return bytes.status();
  auto file = SafetensorsFile::Parse(*std::move(bytes), tensors_path);
  if (!file.ok()) return absl::DataLossError(file.status().message());
  for (const ManifestTensor& e : entries) {
    const SafetensorsTensorInfo* info = file->Find(e.name);
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
      return absl::DataLossError(absl::StrCat(
          tensors_path, ": tensor '", Echo(e.name), "' has shape [",
          absl::StrJoin(info->shape, ","), "]; the manifest says [", absl::StrJoin(e.shape, ","),
          "]"));
    }
    NamedTensor t;
    t.name = e.name;
    t.shape = e.shape;
    auto values = file->ReadFloat(e.name);
    if (!values.ok()) {
      return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(e.name), "': ",
                                              values.status().message()));
    }
    t.data = *std::move(values);
    if (Crc32(t.data.data(), t.data.size() * 4) != e.crc) {
      return absl::DataLossError(
          absl::StrCat(tensors_path, ": tensor '", Echo(e.name), "' fails its CRC-32 check"));
    }
    snap.tensors.push_back(std::move(t));
  }
  if (file->tensors().size() != entries.size()) {
    std::set<std::string> listed;
    for (const ManifestTensor& e : entries) listed.insert(e.name);
    for (const SafetensorsTensorInfo& info : file->tensors()) {
      if (!listed.count(info.name)) {
        return absl::DataLossError(absl::StrCat(tensors_path, ": tensor '", Echo(info.name),
                                                "' is not listed in ", manifest_path));
      }
    }
  }
  return snap;
}

std::atomic<uint64_t> g_write_seq{0};

}  // namespace

// ---- public ---------------------------------------------------------------------------------------

CheckpointDir& CheckpointDir::operator=(CheckpointDir&& o) noexcept {
  std::swap(fd_, o.fd_);
  std::swap(path_, o.path_);
  return *this;
}

CheckpointDir::~CheckpointDir() {
  if (fd_ >= 0) close(fd_);
}

bool IsValidSessionId(absl::string_view id) {
  if (id.empty() || id.size() > 128 || id[0] == '.') return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

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

absl::StatusOr<CheckpointDir> OpenCheckpointDir(const std::string& state_dir_in,
                                                const std::string& path, bool create) {
  if (path.size() > kMaxCheckpointPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint path '", Echo(path), "' of ",
                                                   path.size(), " bytes: at most ",
                                                   kMaxCheckpointPathBytes));
  }
  // The system calls below read up to the first NUL: "a\0/b" would open "a", another directory
  // than the one named.
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", Echo(path), "' contains a NUL byte"));
  }
  const std::string state_dir = state_dir_in.empty() ? "" : StripTrailingSlashes(state_dir_in);
  std::string rel;
  bool beneath = false;
  if (path.empty() || path[0] != '/') {
    if (state_dir.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "relative checkpoint path '", Echo(path),
          "' needs --state_dir to resolve against (it is never resolved against the daemon's "
          "working directory)"));
    }
    rel = path;
    beneath = true;
  } else if (!state_dir.empty() &&
             (path == state_dir || absl::StartsWith(path, absl::StrCat(state_dir, "/")))) {
    rel = path.substr(state_dir.size());
    beneath = true;
  }
  if (!beneath) {
    if (create) DIOND_RETURN_IF_ERROR(MakeDirs(path));
    int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR) {
        return absl::NotFoundError(absl::StrCat("no checkpoint directory at ", Echo(path)));
      }
      return Errno("open", path);
    }
    return CheckpointDir(fd, StripTrailingSlashes(path));
  }
  if (create) DIOND_RETURN_IF_ERROR(MakeDirs(state_dir));
  Fd base(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (base.get() < 0) return Errno("open --state_dir", state_dir);
  std::vector<std::string> parts = absl::StrSplit(rel, '/', absl::SkipEmpty());
  const std::string display = parts.empty() ? state_dir
                                            : absl::StrCat(state_dir, "/", absl::StrJoin(parts, "/"));
  auto escape = [&]() {
    return absl::PermissionDeniedError(absl::StrCat(
        "checkpoint path '", Echo(path), "' leaves --state_dir (through '..' or a symlink)"));
  };
  if (!create) {
    const std::string joined = parts.empty() ? "." : absl::StrJoin(parts, "/");
    int fd = OpenBeneath(base.get(), joined, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
      if (errno == EXDEV || errno == ELOOP) return escape();
      if (errno == ENOENT || errno == ENOTDIR) {
        return absl::NotFoundError(absl::StrCat("no checkpoint directory at ", Echo(display)));
      }
      return Errno("open", display);
    }
    return CheckpointDir(fd, display);
  }
  // Creating: one component at a time, each made in and resolved beneath its parent.
  Fd cur(dup(base.get()));
  for (const std::string& part : parts) {
    if (part == "." ) continue;
    if (part == "..") return escape();
    if (mkdirat(cur.get(), part.c_str(), 0700) != 0 && errno != EEXIST) {
      return Errno("mkdir", display);
    }
    int fd = OpenBeneath(cur.get(), part, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
      if (errno == EXDEV || errno == ELOOP) return escape();
      return Errno("open", display);
    }
    cur = Fd(fd);
  }
  return CheckpointDir(cur.release(), display);
}

std::string SpecToJson(const SessionSpec& spec) {
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
  if (JsonDepth(text, kMaxManifestDepth) > kMaxManifestDepth) {
    return absl::DataLossError("spec: JSON nested too deeply");
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError("spec is not a JSON object");
  return SpecFromJsonValue(j, "");
}

absl::StatusOr<std::pair<std::string, int64_t>> WriteCheckpoint(const CheckpointDir& root,
                                                                const std::string& session_id,
                                                                const SessionSnapshot& snapshot,
                                                                int64_t keep) {
  if (!IsValidSessionId(session_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", Echo(session_id), "' is not a session id"));
  }
  const std::string parent = absl::StrCat(root.path(), "/", session_id);
  if (mkdirat(root.fd(), session_id.c_str(), 0700) != 0 && errno != EEXIST) {
    return Errno("mkdir", parent);
  }
  Fd sfd(openat(root.fd(), session_id.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (sfd.get() < 0) return Errno("open", parent);
  const std::string final_name = absl::StrCat("step-", snapshot.last_step_index);
  const std::string final_dir = absl::StrCat(parent, "/", final_name);
  const std::string tmp_name = absl::StrCat(".tmp-", final_name, "-", getpid(), "-",
                                            g_write_seq.fetch_add(1));
  const std::string tmp_dir = absl::StrCat(parent, "/", tmp_name);
  if (mkdirat(sfd.get(), tmp_name.c_str(), 0700) != 0) return Errno("mkdir", tmp_dir);
  auto fail = [&](absl::Status s) {
    RemoveTreeAt(sfd.get(), tmp_name);
    return s;
  };
  Fd tfd(openat(sfd.get(), tmp_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (tfd.get() < 0) return fail(Errno("open", tmp_dir));

  SafetensorsWriter writer;
  json manifest;
  manifest["format_version"] = 1;
  manifest["session_id"] = session_id;
  manifest["step_index"] = snapshot.last_step_index;
  manifest["spec"] = json::parse(SpecToJson(snapshot.spec));
  if (snapshot.last_result.has_value()) {
    manifest["last_step"] = StepResultToJson(*snapshot.last_result);
  }
  manifest["tensors"] = json::array();
  for (const NamedTensor& t : snapshot.tensors) {
    absl::Status s = writer.AddF32(t.name, t.shape, t.data);
    if (!s.ok()) return fail(s);
    manifest["tensors"].push_back({{"name", t.name},
                                   {"shape", t.shape},
                                   {"dtype", "F32"},
                                   {"file", kTensors},
                                   {"crc32", Crc32(t.data.data(), t.data.size() * 4)}});
  }
  const std::string tensors = writer.Serialize();
  const std::string manifest_text = manifest.dump(1);
  if (absl::Status s = WriteFileAt(tfd.get(), kTensors, tensors, tmp_dir + "/" + kTensors);
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = WriteFileAt(tfd.get(), kManifest, manifest_text, tmp_dir + "/" + kManifest);
      !s.ok()) {
    return fail(s);
  }
  if (fsync(tfd.get()) != 0) return fail(Errno("fsync", tmp_dir));

  // The switch: never a moment without a complete step-<N>.
  if (syscall(SYS_renameat2, sfd.get(), tmp_name.c_str(), sfd.get(), final_name.c_str(),
              RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST) {
      // A re-save: swap the two directories atomically, then drop the old one.
      if (syscall(SYS_renameat2, sfd.get(), tmp_name.c_str(), sfd.get(), final_name.c_str(),
                  RENAME_EXCHANGE) != 0) {
        return fail(Errno("exchange with", final_dir));
      }
      RemoveTreeAt(sfd.get(), tmp_name);
    } else if (errno == EINVAL || errno == ENOSYS) {
      // A file system without renameat2 flags: move the old one aside first. A crash in
      // between leaves .old-step-<N>-*, which start-up moves back (RemoveStaleTemporaries).
      const std::string old_name = absl::StrCat(".old-", final_name, "-", getpid(), "-",
                                                g_write_seq.fetch_add(1));
      const bool had_old = renameat(sfd.get(), final_name.c_str(), sfd.get(),
                                    old_name.c_str()) == 0;
      if (renameat(sfd.get(), tmp_name.c_str(), sfd.get(), final_name.c_str()) != 0) {
        absl::Status s = Errno("rename to", final_dir);
        if (had_old) renameat(sfd.get(), old_name.c_str(), sfd.get(), final_name.c_str());
        return fail(s);
      }
      if (had_old) RemoveTreeAt(sfd.get(), old_name);
    } else {
      return fail(Errno("rename to", final_dir));
    }
  }
  if (fsync(sfd.get()) != 0) return Errno("fsync", parent);

  if (keep > 0) {
    std::vector<int64_t> steps;
    for (const std::string& n : ListDir(sfd.get())) {
      const int64_t s = StepOfName(n);
      if (s >= 0) steps.push_back(s);
    }
    std::sort(steps.begin(), steps.end(), std::greater<>());
    for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) {
      if (steps[i] == snapshot.last_step_index) continue;
      RemoveTreeAt(sfd.get(), absl::StrCat("step-", steps[i]));
    }
    fsync(sfd.get());
  }
  return std::make_pair(final_dir,
                        static_cast<int64_t>(tensors.size() + manifest_text.size()));
}

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

std::vector<std::string> CheckpointsNewestFirst(const std::string& root,
                                                const std::string& session_id) {
  std::vector<std::string> out;
  if (!IsValidSessionId(session_id)) return out;
  const std::string parent = absl::StrCat(StripTrailingSlashes(root), "/", session_id);
  Fd fd(open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return out;
  std::vector<int64_t> steps;
  for (const std::string& n : ListDir(fd.get())) {
    const int64_t s = StepOfName(n);
    if (s >= 0) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  for (int64_t s : steps) out.push_back(absl::StrCat(parent, "/step-", s));
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root,
                                             const std::string& session_id) {
  std::vector<std::string> all = CheckpointsNewestFirst(root, session_id);
  if (all.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoints in ", Echo(root), "/",
                                            Echo(session_id)));
  }
  return all.front();
}

int64_t RemoveStaleTemporaries(const std::string& state_dir) {
  int64_t removed = 0;
  Fd root(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.get() < 0) return 0;
  for (const std::string& session : ListDir(root.get())) {
    if (!IsValidSessionId(session)) continue;
    Fd sfd(openat(root.get(), session.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (sfd.get() < 0) continue;
    const std::vector<std::string> names = ListDir(sfd.get());
    const std::set<std::string> present(names.begin(), names.end());
    for (const std::string& n : names) {
      const bool tmp = absl::StartsWith(n, ".tmp-step-");
      const bool old = absl::StartsWith(n, ".old-step-");
      if (!tmp && !old) continue;
      // .{tmp,old}-step-<N>-<pid>-<seq>: a live writer other than this process keeps its own.
      std::vector<std::string> f = absl::StrSplit(n.substr(5), '-');
      int pid = 0;
      if (f.size() >= 3 && absl::SimpleAtoi(f[2], &pid) && pid > 0 && pid != getpid() &&
          kill(pid, 0) == 0) {
        continue;
      }
      if (old && f.size() >= 2) {
        const std::string final_name = absl::StrCat("step-", f[1]);
        if (present.count(final_name) == 0 &&
            renameat(sfd.get(), n.c_str(), sfd.get(), final_name.c_str()) == 0) {
          DIOND_LOG(WARNING) << "checkpoint " << state_dir << "/" << session << "/" << final_name
                             << " restored from an interrupted re-save";
          continue;
        }
      }
      RemoveTreeAt(sfd.get(), n);
      ++removed;
    }
    fsync(sfd.get());
  }
  return removed;
}

std::vector<std::string> CheckpointSessions(const std::string& state_dir) {
  std::vector<std::string> out;
  Fd root(open(state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.get() < 0) return out;
  for (const std::string& n : ListDir(root.get())) {
    if (IsValidSessionId(n)) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void MarkSessionClosed(const std::string& state_dir, const std::string& session_id) {
  if (state_dir.empty() || !IsValidSessionId(session_id)) return;
  const std::string dir = absl::StrCat(StripTrailingSlashes(state_dir), "/", session_id);
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return;  // never checkpointed: nothing to recover anyway
  Fd m(openat(fd.get(), kClosedMarker, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (m.get() >= 0) fsync(m.get());
  fsync(fd.get());
}

bool SessionMarkedClosed(const std::string& state_dir, const std::string& session_id) {
  const std::string p =
      absl::StrCat(StripTrailingSlashes(state_dir), "/", session_id, "/", kClosedMarker);
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

}  // namespace diond::session
