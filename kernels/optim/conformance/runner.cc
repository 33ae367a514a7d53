#include "kernels/optim/conformance/runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/base/casts.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/conformance/reference_options.h"
#include "kernels/optim/group_optimizer.h"
#include "nlohmann/json.hpp"

namespace diond::optim::conformance {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

absl::StatusOr<json> ParseJson(absl::string_view text, absl::string_view what) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, " is not JSON"));
  return j;
}

struct Tolerances {
  std::map<std::string, double> values;  // "param_relfro", ..., "state.<name>"
};

void MergeManifest(const std::string& path, Tolerances* tol) {
  const fs::path file(path);
  for (const fs::path& dir : {file.parent_path(), file.parent_path().parent_path()}) {
    std::error_code ec;
    const fs::path manifest = dir / "manifest.json";
    if (!fs::exists(manifest, ec)) continue;
    std::ifstream in(manifest);
    std::stringstream ss;
    ss << in.rdbuf();
    json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("cases") || !j["cases"].is_array()) {
      continue;
    }
    for (const json& c : j["cases"]) {
      if (!c.is_object() || !c.contains("file") || !c["file"].is_string() ||
          c["file"].get<std::string>() != file.filename().string()) {
        continue;
      }
      if (!c.contains("tolerance") || !c["tolerance"].is_object()) continue;
      const json& t = c["tolerance"];
      for (auto it = t.begin(); it != t.end(); ++it) {
        if (it->is_number() && !tol->values.count(it.key())) {
          tol->values[it.key()] = it->get<double>();
        } else if (it.key() == "states_final_relfro" && it->is_object()) {
          for (auto s = it->begin(); s != it->end(); ++s) {
            const std::string key = "state." + s.key();
            if (s->is_number() && !tol->values.count(key)) tol->values[key] = s->get<double>();
          }
        }
      }
      return;
    }
  }
}

Tolerances ReadTolerances(const SafetensorsFile& f, const std::string& path) {
  Tolerances tol;
  for (const auto& [k, v] : f.metadata()) {
    if (k.rfind("tolerance_", 0) != 0) continue;
    const std::string name = k.substr(10);
    double d;
    if (name == "states_final_relfro") {
      json j = json::parse(v, nullptr, false);
      if (j.is_object()) {
        for (auto s = j.begin(); s != j.end(); ++s) {
          if (s->is_number()) tol.values["state." + s.key()] = s->get<double>();
        }
      }
    } else if (absl::SimpleAtod(v, &d)) {
      tol.values[name] = d;
    }
  }
  MergeManifest(path, &tol);
  return tol;
}

double RelFro(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

std::vector<float> Diff(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Flips each column of `mine` (rows×cols) to agree in sign with the reference column (P12).
void AlignColumnSigns(std::vector<float>* mine, const std::vector<float>& ref, int64_t rows,
                      int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    double dot = 0;
    for (int64_t r = 0; r < rows; ++r)
      dot += static_cast<double>((*mine)[r * cols + c]) * ref[r * cols + c];
    if (dot < 0) {
      for (int64_t r = 0; r < rows; ++r) (*mine)[r * cols + c] = -(*mine)[r * cols + c];
    }
  }
}

struct CaseData {
  GroupConfig config;
  std::vector<ParamShape> shapes;  // one per parameter (metadata num_params, default 1)
  int64_t steps = 0;
  std::vector<std::string> state_names;
};

// Tensor names of parameter i of a multi-parameter case: parameter 0 uses the plain names
// (param.init, grad.<t>, ...), parameter i > 0 the same names prefixed with "p<i>." (README
// "bf16_reference" section).
std::string Key(size_t i, absl::string_view name) {
  return i == 0 ? std::string(name) : absl::StrCat("p", i, ".", name);
}

absl::StatusOr<CaseData> ReadCase(const SafetensorsFile& f) {
  CaseData c;
  const auto& md = f.metadata();
  auto get = [&](const char* key) -> absl::StatusOr<std::string> {
    auto it = md.find(key);
    if (it == md.end()) return absl::InvalidArgumentError(absl::StrCat("no metadata '", key, "'"));
    return it->second;
  };
  DIOND_ASSIGN_OR_RETURN(std::string algo, get("algorithm"));
  DIOND_ASSIGN_OR_RETURN(c.config.algorithm, ParseAlgorithm(algo));
  c.config.hyperparams = DefaultHyperparams(c.config.algorithm);
  if (md.count("hyperparameters")) {
    DIOND_ASSIGN_OR_RETURN(json hp, ParseJson(md.at("hyperparameters"), "hyperparameters"));
    DIOND_RETURN_IF_ERROR(ApplyReferenceHyperparams(hp, &c.config));
  }
  if (md.count("param_group_options")) {
    DIOND_ASSIGN_OR_RETURN(json go, ParseJson(md.at("param_group_options"), "param_group_options"));
    DIOND_RETURN_IF_ERROR(ApplyReferenceGroupOptions(go, &c.config));
  }
  DIOND_ASSIGN_OR_RETURN(std::string t, get("T"));
  if (!absl::SimpleAtoi(t, &c.steps) || c.steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad T '", t, "'"));
  }
  int64_t num_params = 1;
  if (md.count("num_params") && (!absl::SimpleAtoi(md.at("num_params"), &num_params) ||
                                 num_params < 1 || num_params > 4096)) {
    return absl::InvalidArgumentError("bad num_params (want 1..4096)");
  }
  for (int64_t i = 0; i < num_params; ++i) {
    const std::string key = Key(static_cast<size_t>(i), "param.init");
    const SafetensorsTensorInfo* init = f.Find(key);
    if (init == nullptr) return absl::InvalidArgumentError(absl::StrCat("no tensor ", key));
    c.shapes.push_back(init->shape);
  }
  if (md.count("state_names")) {
    DIOND_ASSIGN_OR_RETURN(json sn, ParseJson(md.at("state_names"), "state_names"));
    if (!sn.is_array()) return absl::InvalidArgumentError("state_names is not a list");
    for (const json& s : sn) {
      if (!s.is_string()) return absl::InvalidArgumentError("state_names entry");
      c.state_names.push_back(s.get<std::string>());
    }
  } else {
    c.state_names = StateNames(c.config.algorithm);
  }
  return c;
}

// f32 host vector <-> a Buffer of ctx's device (explicit copies; plain copies on the CPU).
absl::StatusOr<kernels::Buffer> ToDevice(const kernels::Context& ctx, const std::vector<float>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  DIOND_ASSIGN_OR_RETURN(kernels::Buffer b, ctx.Allocate(kernels::DType::kF32, {n}));
  DIOND_RETURN_IF_ERROR(kernels::CopyFromHost(ctx, kernels::MakeView(v.data(), {n}), b.view()));
  return b;
}
absl::Status ToHost(const kernels::Context& ctx, const kernels::Buffer& b, std::vector<float>* v) {
  v->resize(static_cast<size_t>(b.NumElements()));
  return kernels::CopyToHost(ctx, b.view(), kernels::MakeView(v->data(), {b.NumElements()}));
}

// State `name` of parameter i, as the optimizer holds it now.
absl::StatusOr<std::vector<float>> ReadState(const kernels::Context& ctx, const GroupOptimizer& opt,
                                             size_t i, const std::string& name) {
  DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape, opt.StateShape(i, name));
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::vector<float> mine(static_cast<size_t>(count));
  DIOND_RETURN_IF_ERROR(opt.GetState(ctx, i, name, absl::MakeSpan(mine)));
  return mine;
}

// The worst parameter's error of state `name` against the file's final state (Q up to column
// signs, P12; step_dev relative); nullopt when the file does not hold it for every parameter.
absl::StatusOr<std::optional<double>> FinalStateError(const kernels::Context& ctx,
                                                      const SafetensorsFile& f,
                                                      const GroupOptimizer& opt, size_t n,
                                                      const std::string& name) {
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string key = Key(i, "state." + name + ".final");
    DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape, opt.StateShape(i, name));
    if (!f.Has(key)) return std::optional<double>();
    DIOND_ASSIGN_OR_RETURN(std::vector<float> ref, f.ReadFloat(key, shape));
    DIOND_ASSIGN_OR_RETURN(std::vector<float> mine, ReadState(ctx, opt, i, name));
    if (name == kStateQ && shape.size() == 2) {
      AlignColumnSigns(&mine, ref, shape[0], shape[1]);
      err = std::max(err, RelFro(mine, ref));
    } else if (name == kStateStepDev) {
      const double m0 = mine[0], r0 = ref[0];
      err = std::max(err, r0 == 0 ? std::abs(m0) : std::abs(m0 - r0) / std::abs(r0));
    } else {
      err = std::max(err, RelFro(mine, ref));
    }
  }
  return std::optional<double>(err);
}

// Runs one precision mode of a case on ctx: the optimizer, its state, the parameters and the
// gradients live on ctx's device (uploaded from the file, read back after each step). `trace`
// (if not null) receives every parameter after every step, then every final state, for the
// device-vs-CPU comparison.
absl::StatusOr<ModeResult> RunMode(const kernels::Context& ctx, const SafetensorsFile& f,
                                   const CaseData& c, const Tolerances& tol, Precision precision,
                                   Bf16MatmulEngine bf16_matmul,
                                   std::vector<float>* trace = nullptr) {
  ModeResult r;
  r.precision = precision;
  GroupConfig cfg = c.config;
  cfg.precision = precision;
  cfg.bf16_matmul = bf16_matmul;
  r.bf16_matmul = ResolveBf16Matmul(bf16_matmul);
  const size_t n = c.shapes.size();
  DIOND_ASSIGN_OR_RETURN(std::unique_ptr<GroupOptimizer> opt,
                         CreateGroupOptimizer(ctx, cfg, c.shapes));
  for (size_t i = 0; i < n; ++i) {
    for (const std::string& name : c.state_names) {
      DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape, opt->StateShape(i, name));
      const std::string key = Key(i, "state." + name + ".init");
      if (!f.Has(key)) continue;  // zeros, as the optimizer initializes them
      DIOND_ASSIGN_OR_RETURN(std::vector<float> v, f.ReadFloat(key, shape));
      DIOND_RETURN_IF_ERROR(opt->SetState(ctx, i, name, v));
    }
  }
  // On the CPU the rules step the host vectors themselves (as the daemon steps a trainer's
  // memory); on a device, uploaded copies.
  const bool on_host = ctx.device().type == kernels::DeviceType::kCpu;
  std::vector<std::vector<float>> p0(n), p(n);
  std::vector<kernels::Buffer> dp(n);
  for (size_t i = 0; i < n; ++i) {
    DIOND_ASSIGN_OR_RETURN(p0[i], f.ReadFloat(Key(i, "param.init")));
    p[i] = p0[i];
    if (!on_host) {
      DIOND_ASSIGN_OR_RETURN(dp[i], ToDevice(ctx, p[i]));
    }
  }
  // Errors are per matrix; a case reports the worst matrix (and the worst step).
  double param_err = 0, delta_err = 0;
  for (int64_t t = 1; t <= c.steps; ++t) {
    std::vector<std::vector<float>> g(n);
    std::vector<kernels::Buffer> dg(n);
    std::vector<float*> pp(n);
    std::vector<const float*> gp(n);
    for (size_t i = 0; i < n; ++i) {
      DIOND_ASSIGN_OR_RETURN(g[i], f.ReadFloat(Key(i, absl::StrCat("grad.", t)), c.shapes[i]));
      if (on_host) {
        pp[i] = p[i].data();
        gp[i] = g[i].data();
      } else {
        DIOND_ASSIGN_OR_RETURN(dg[i], ToDevice(ctx, g[i]));
        pp[i] = dp[i].As<float>();
        gp[i] = dg[i].As<float>();
      }
    }
    DIOND_RETURN_IF_ERROR(opt->Step(ctx, absl::MakeSpan(pp), absl::MakeSpan(gp)));
    for (size_t i = 0; i < n; ++i) {
      if (!on_host) DIOND_RETURN_IF_ERROR(ToHost(ctx, dp[i], &p[i]));
      if (trace != nullptr) trace->insert(trace->end(), p[i].begin(), p[i].end());
    }
    for (size_t i = 0; i < n; ++i) {
      DIOND_ASSIGN_OR_RETURN(std::vector<float> ref,
                             f.ReadFloat(Key(i, absl::StrCat("param.", t)), c.shapes[i]));
      param_err = std::max(param_err, RelFro(p[i], ref));
      delta_err = std::max(delta_err, RelFro(Diff(p[i], p0[i]), Diff(ref, p0[i])));
    }
  }
  const bool bf16_algo = HasBf16Path(cfg.algorithm);
  const bool bf16_mode = precision == Precision::kBf16Reference;
  const bool strict_traj = !bf16_algo || bf16_mode;
  const bool f64_checks = !bf16_algo || precision == Precision::kFp32;
  auto add = [&](const std::string& name, double measured, bool enforced, bool available) {
    Check ch;
    ch.name = name;
    ch.measured = measured;
    auto it = tol.values.find(name);
    if (it != tol.values.end()) ch.tolerance = it->second;
    ch.enforced = enforced;
    ch.skipped = enforced && (!available || !ch.tolerance);
    r.checks.push_back(ch);
  };
  add("param_relfro", param_err, strict_traj, true);
  add("delta_relfro", delta_err, !bf16_algo, true);
  // The bf16_reference bound on the update: the emulation must sit within the reference's own
  // rounding spread of the stored trajectory (tolerance bf16_reference_delta_relfro, README).
  if (bf16_algo && bf16_mode) add("bf16_reference_delta_relfro", delta_err, true, true);
  // With the float32 GEMM, Muon and Dion2 reproduce the stored trajectories bit for bit
  // (docs/CONFORMANCE.md; NorMuon/NorDion2 differ at float32 level, their norms accumulate in
  // double): enforced as an exact check, on the vectors that record the reference's bf16 run
  // (those with a bf16_reference tolerance; a trajectory computed otherwise has other bits).
  const bool reference_bf16_run = tol.values.count("bf16_reference_delta_relfro") > 0;
  if (bf16_mode && reference_bf16_run && r.bf16_matmul == Bf16MatmulEngine::kFloat32Gemm &&
      (cfg.algorithm == AlgorithmKind::kMuon || cfg.algorithm == AlgorithmKind::kDion2)) {
    Check ch;
    ch.name = "bf16_reference_bitwise";
    ch.measured = delta_err;
    ch.tolerance = 0.0;
    ch.enforced = true;
    r.checks.push_back(ch);
  }
  const std::string f64_key = absl::StrCat("param_f64.", c.steps);
  bool have_f64 = true;
  for (size_t i = 0; i < n; ++i) have_f64 = have_f64 && f.Has(Key(i, f64_key));
  if (have_f64) {
    double e = 0, de = 0;
    for (size_t i = 0; i < n; ++i) {
      DIOND_ASSIGN_OR_RETURN(std::vector<float> ref64, f.ReadFloat(Key(i, f64_key), c.shapes[i]));
      e = std::max(e, RelFro(p[i], ref64));
      de = std::max(de, RelFro(Diff(p[i], p0[i]), Diff(ref64, p0[i])));
    }
    add("param_f64_final_relfro", e, f64_checks, true);
    add("delta_f64_final_relfro", de, f64_checks, true);
  } else {
    add("param_f64_final_relfro", 0, f64_checks, false);
    add("delta_f64_final_relfro", 0, f64_checks, false);
  }
  if (trace != nullptr) {
    for (size_t i = 0; i < n; ++i) {
      for (const std::string& name : c.state_names) {
        DIOND_ASSIGN_OR_RETURN(std::vector<float> mine, ReadState(ctx, *opt, i, name));
        trace->insert(trace->end(), mine.begin(), mine.end());
      }
    }
  }
  for (const std::string& name : c.state_names) {
    DIOND_ASSIGN_OR_RETURN(std::optional<double> err, FinalStateError(ctx, f, *opt, n, name));
    add("state." + name, err.value_or(0), true, err.has_value());
  }
  bool any_enforced = false;
  r.passed = true;
  for (const Check& ch : r.checks) {
    if (ch.enforced && !ch.skipped) any_enforced = true;
    if (!ch.ok()) r.passed = false;
  }
  if (!any_enforced) r.passed = false;
  return r;
}

}  // namespace

absl::StatusOr<Mode> ParseMode(absl::string_view s) {
  if (s == "fp32") return Mode::kFp32;
  if (s == "bf16_reference") return Mode::kBf16Reference;
  if (s == "both") return Mode::kBoth;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode must be fp32, bf16_reference or both, not '", s, "'"));
}

absl::StatusOr<std::vector<std::string>> CollectVectorFiles(const std::vector<std::string>& args) {
  std::vector<std::string> files;
  for (const std::string& a : args) {
    std::error_code ec;
    if (fs::is_directory(a, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(a, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_regular_file(ec) && it->path().extension() == ".safetensors") {
          found.push_back(it->path().string());
        }
      }
      if (ec) return absl::NotFoundError(absl::StrCat("cannot list '", a, "': ", ec.message()));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::exists(a, ec)) {
      files.push_back(a);
    } else {
      return absl::NotFoundError(absl::StrCat("no such file or folder '", a, "'"));
    }
  }
  return files;
}

namespace {

// Elements of two traces whose bits differ (a size mismatch counts every element of the longer).
double BitMismatches(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return static_cast<double>(std::max(a.size(), b.size()));
  double bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (absl::bit_cast<uint32_t>(a[i]) != absl::bit_cast<uint32_t>(b[i])) ++bad;
  }
  return bad;
}

}  // namespace

CaseResult RunCase(const kernels::Context& ctx, const std::string& path, Mode mode,
                   const kernels::Context* cpu_twin, Bf16MatmulEngine bf16_matmul) {
  CaseResult res;
  res.file = fs::path(path).filename().string();
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(path);
  if (!f.ok()) {
    res.error = std::string(f.status().message());
    return res;
  }
  absl::StatusOr<CaseData> c = ReadCase(*f);
  if (!c.ok()) {
    res.error = std::string(c.status().message());
    return res;
  }
  res.algorithm = f->metadata().count("algorithm") ? f->metadata().at("algorithm") : "";
  const Tolerances tol = ReadTolerances(*f, path);
  std::vector<Precision> precisions;
  if (mode != Mode::kBf16Reference) precisions.push_back(Precision::kFp32);
  if (mode != Mode::kFp32) precisions.push_back(Precision::kBf16Reference);
  res.passed = true;
  for (Precision p : precisions) {
    std::vector<float> trace, twin_trace;
    absl::StatusOr<ModeResult> m =
        RunMode(ctx, *f, *c, tol, p, bf16_matmul, cpu_twin != nullptr ? &trace : nullptr);
    if (!m.ok()) {
      res.error = absl::StrCat("[", PrecisionName(p), "] ", m.status().ToString());
      res.passed = false;
      return res;
    }
    if (cpu_twin != nullptr) {
      // The same case on the CPU context: every parameter after every step and every final
      // state must be the same bits.
      absl::StatusOr<ModeResult> twin =
          RunMode(*cpu_twin, *f, *c, tol, p, bf16_matmul, &twin_trace);
      if (!twin.ok()) {
        res.error = absl::StrCat("[", PrecisionName(p), "] cpu twin: ", twin.status().ToString());
        res.passed = false;
        return res;
      }
      Check ch;
      ch.name = "device_vs_cpu_bit_mismatches";
      ch.measured = BitMismatches(trace, twin_trace);
      ch.tolerance = 0.0;
      ch.enforced = true;
      m->checks.push_back(ch);
      if (!ch.ok()) m->passed = false;
    }
    res.passed = res.passed && m->passed;
    res.modes.push_back(*std::move(m));
  }
  return res;
}

std::string FormatResult(const CaseResult& r) {
  std::string line = absl::StrCat(r.passed ? "PASS " : "FAIL ", r.file);
  if (!r.error.empty()) return absl::StrCat(line, "  error: ", r.error);
  for (const ModeResult& m : r.modes) {
    absl::StrAppend(&line, "  [", PrecisionName(m.precision),
                    m.precision == Precision::kBf16Reference
                        ? absl::StrCat(" matmul=", Bf16MatmulEngineName(m.bf16_matmul))
                        : "",
                    m.passed ? "" : " FAILED", "]");
    for (const Check& ch : m.checks) {
      std::string tol = ch.tolerance ? absl::StrFormat("%.3g", *ch.tolerance) : "n/a";
      const char* mark = !ch.enforced ? " (info)"
                         : ch.skipped ? " (skipped)"
                         : ch.ok()    ? ""
                                      : " (FAIL)";
      absl::StrAppend(&line, " ", ch.name, "=", absl::StrFormat("%.3g", ch.measured), "/", tol,
                      mark);
    }
  }
  return line;
}

int RunAll(const kernels::Context& ctx, const std::vector<std::string>& paths, Mode mode,
           std::ostream& out, const kernels::Context* cpu_twin, Bf16MatmulEngine bf16_matmul) {
  absl::StatusOr<std::vector<std::string>> files = CollectVectorFiles(paths);
  if (!files.ok()) {
    out << "error: " << files.status().message() << "\n0 passed, 1 failed\n";
    return 1;
  }
  int passed = 0, failed = 0;
  for (const std::string& path : *files) {
    CaseResult r = RunCase(ctx, path, mode, cpu_twin, bf16_matmul);
    out << FormatResult(r) << "\n";
    (r.passed ? passed : failed)++;
  }
  out << passed << " passed, " << failed << " failed\n";
  return failed;
}

}  // namespace diond::optim::conformance
