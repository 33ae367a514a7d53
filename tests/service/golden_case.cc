#include "tests/service/golden_case.h"

#include <cmath>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

namespace diond::service_testing {
namespace {

using json = nlohmann::json;

absl::Status MapHyperparameters(const json& hp, GoldenCase* c) {
  if (!hp.is_object()) return absl::InvalidArgumentError("hyperparameters is not an object");
  v1::Hyperparameters& p = *c->group.proto.mutable_hyperparameters();
  optim::Hyperparams& h = c->group.config.hyperparams;
  auto number = [](const json& v) { return v.is_number() ? v.get<double>() : NAN; };
  for (auto it = hp.begin(); it != hp.end(); ++it) {
    const std::string& k = it.key();
    const json& v = *it;
    if (k == "lr") {
      p.set_lr(number(v));
      h.lr = number(v);
    } else if (k == "mu") {
      p.set_mu(number(v));
      h.mu = number(v);
    } else if (k == "weight_decay") {
      p.set_weight_decay(number(v));
      h.weight_decay = number(v);
    } else if (k == "epsilon") {
      p.set_epsilon(number(v));
      h.epsilon = number(v);
    } else if (k == "muon_beta2") {
      p.set_muon_beta2(number(v));
      h.muon_beta2 = number(v);
    } else if (k == "fraction") {
      p.set_fraction(number(v));
      h.fraction = number(v);
    } else if (k == "ef_decay") {
      p.set_ef_decay(number(v));
      h.ef_decay = number(v);
    } else if (k == "rank_fraction") {
      p.set_rank_fraction(number(v));
      h.rank_fraction = number(v);
    } else if (k == "rank_multiple_of") {
      p.set_rank_multiple_of(static_cast<int64_t>(number(v)));
      h.rank_multiple_of = static_cast<int64_t>(number(v));
    } else if (k == "nesterov") {
      p.set_nesterov(v.get<bool>());
      h.nesterov = v.get<bool>();
    } else if (k == "cautious_wd") {
      p.set_cautious_wd(v.get<bool>());
      h.cautious_wd = v.get<bool>();
    } else if (k == "flatten") {
      c->group.proto.set_flatten(v.get<bool>());
      c->group.config.flatten = v.get<bool>();
    } else if (k == "betas") {
      if (!v.is_array() || v.size() != 2) return absl::InvalidArgumentError("betas");
      p.set_beta1(number(v[0]));
      p.set_beta2(number(v[1]));
      h.beta1 = number(v[0]);
      h.beta2 = number(v[1]);
    } else if (k == "adjust_lr") {
      const std::string a = v.is_null() ? "none" : v.get<std::string>();
      if (a == "spectral_norm") {
        p.set_adjust_lr(v1::ADJUST_LR_SPECTRAL_NORM);
        h.adjust_lr = optim::AdjustLr::kSpectralNorm;
      } else if (a == "rms_norm") {
        p.set_adjust_lr(v1::ADJUST_LR_RMS_NORM);
        h.adjust_lr = optim::AdjustLr::kRmsNorm;
      } else if (a == "none") {
        p.set_adjust_lr(v1::ADJUST_LR_NONE);
        h.adjust_lr = optim::AdjustLr::kNone;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("adjust_lr ", a));
      }
    } else if (k == "use_polar_express") {
      const bool pe = v.get<bool>();
      p.set_orthogonalizer(pe ? v1::ORTHOGONALIZER_POLAR_EXPRESS
                              : v1::ORTHOGONALIZER_NEWTON_SCHULZ);
      h.orthogonalizer =
          pe ? optim::Orthogonalizer::kPolarExpress : optim::Orthogonalizer::kNewtonSchulz5;
    } else if (k == "use_triton" || k == "use_gram_newton_schulz" || k == "triton_post_ortho") {
      if (v.get<bool>()) return absl::UnimplementedError(absl::StrCat(k, "=true"));
    } else if (k == "qr_method") {
      const std::string m = v.is_string() ? v.get<std::string>() : "";
      if (m == "rcqr") {
        p.set_qr_method(v1::QR_METHOD_RCQR);
      } else if (m == "qr") {
        p.set_qr_method(v1::QR_METHOD_QR);
      } else if (m == "cqr") {
        p.set_qr_method(v1::QR_METHOD_CQR);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("qr_method ", m));
      }
      absl::StatusOr<optim::QrMethod> q = optim::ParseQrMethod(m);
      if (!q.ok()) return q.status();
      h.qr_method = *q;
    } else if (k == "cqr_warmup_steps") {
      p.set_cqr_warmup_steps(static_cast<int64_t>(number(v)));
      h.cqr_warmup_steps = static_cast<int64_t>(number(v));
    } else if (k == "rcqr_oversample") {
      p.set_oversample(number(v));
      h.rcqr_oversample = number(v);
    } else if (k == "power_iters") {
      if (number(v) != 1) return absl::UnimplementedError("power_iters != 1");
    } else if (k == "selection_scope" || k == "verbose") {
      // No effect on the single-device numbers (runner.cc ApplyHyperparams).
    } else {
      return absl::UnimplementedError(absl::StrCat("hyperparameter '", k, "'"));
    }
  }
  return absl::OkStatus();
}

absl::Status MapGroupOptions(const json& opt, GoldenCase* c) {
  if (!opt.is_object()) return absl::InvalidArgumentError("param_group_options");
  for (auto it = opt.begin(); it != opt.end(); ++it) {
    const std::string& k = it.key();
    const json& v = *it;
    if (k == "algorithm" || v.is_null()) continue;
    if (k == "num_heads") {
      c->group.proto.set_num_heads(v.get<int64_t>());
      c->group.config.num_heads = v.get<int64_t>();
    } else if (k == "split_sizes") {
      for (const json& s : v) {
        c->group.proto.add_split_sizes(s.get<int64_t>());
        c->group.config.split_sizes.push_back(s.get<int64_t>());
      }
    } else {
      return absl::UnimplementedError(absl::StrCat("group option '", k, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

SessionDesc GoldenCase::Session(optim::Precision precision) const {
  SessionDesc d;
  GroupDesc g = group;
  g.config.precision = precision;
  g.proto.set_precision(precision == optim::Precision::kFp32 ? v1::PRECISION_FP32
                                                             : v1::PRECISION_BF16_REFERENCE);
  d.groups.push_back(std::move(g));
  d.params.push_back({"w", shape, "g"});
  return d;
}

absl::StatusOr<GoldenCase> LoadGoldenCase(const std::string& path) {
  auto f = SafetensorsFile::ReadFile(path);
  if (!f.ok()) return f.status();
  GoldenCase c;
  c.file = std::filesystem::path(path).filename().string();
  const auto& md = f->metadata();
  for (const char* key : {"algorithm", "hyperparameters", "T"}) {
    if (!md.count(key)) return absl::InvalidArgumentError(absl::StrCat("no metadata ", key));
  }
  auto algo = optim::ParseAlgorithm(md.at("algorithm"));
  if (!algo.ok()) return algo.status();
  c.algorithm = *algo;
  c.group.proto.set_name("g");
  c.group.proto.set_algorithm(AlgorithmToProto(c.algorithm));
  c.group.config.algorithm = c.algorithm;
  c.group.config.hyperparams = optim::DefaultHyperparams(c.algorithm);
  json hp = json::parse(md.at("hyperparameters"), nullptr, false);
  if (absl::Status s = MapHyperparameters(hp, &c); !s.ok()) return s;
  if (md.count("param_group_options")) {
    json go = json::parse(md.at("param_group_options"), nullptr, false);
    if (absl::Status s = MapGroupOptions(go, &c); !s.ok()) return s;
  }
  if (!absl::SimpleAtoi(md.at("T"), &c.steps) || c.steps < 1) {
    return absl::InvalidArgumentError("bad T");
  }
  const SafetensorsTensorInfo* init = f->Find("param.init");
  if (init == nullptr) return absl::InvalidArgumentError("no param.init");
  c.shape = init->shape;
  auto read = [&](const std::string& name, std::vector<float>* out) -> absl::Status {
    auto v = f->ReadFloat(name);
    if (!v.ok()) return v.status();
    *out = *std::move(v);
    return absl::OkStatus();
  };
  if (absl::Status s = read("param.init", &c.param_init); !s.ok()) return s;
  c.grads.resize(static_cast<size_t>(c.steps));
  c.ref_params.resize(static_cast<size_t>(c.steps));
  for (int64_t t = 1; t <= c.steps; ++t) {
    if (absl::Status s = read(absl::StrCat("grad.", t), &c.grads[t - 1]); !s.ok()) return s;
    if (absl::Status s = read(absl::StrCat("param.", t), &c.ref_params[t - 1]); !s.ok()) return s;
  }
  if (f->Has(absl::StrCat("param_f64.", c.steps))) {
    if (absl::Status s = read(absl::StrCat("param_f64.", c.steps), &c.param_f64_final); !s.ok()) {
      return s;
    }
  }
  for (const SafetensorsTensorInfo& t : f->tensors()) {
    const std::string& n = t.name;
    if (n.rfind("state.", 0) == 0 && n.size() > 11 && n.substr(n.size() - 5) == ".init") {
      std::vector<float> v;
      if (absl::Status s = read(n, &v); !s.ok()) return s;
      c.state_init[n.substr(6, n.size() - 11)] = std::move(v);
    }
  }
  for (const auto& [k, v] : md) {
    double d;
    if (k.rfind("tolerance_", 0) == 0 && absl::SimpleAtod(v, &d)) c.tolerance[k.substr(10)] = d;
  }
  return c;
}

double RelFro(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

}  // namespace diond::service_testing
