// libFuzzer target: the Hyperparameters message as CreateSession and SetHyperparameters read it
// (server/rpc/convert.cc: ApplyHyperparameters, HyperparameterChangeFromProto), then the
// group's validation (kernels/optim/validation.cc, ValidateGroup and CheckStepKnob) for every
// algorithm. Properties, besides no crash and no sanitizer report:
//  - ApplyHyperparameters either sets exactly the fields the message sets, to their values, or
//    fails and changes nothing (no partial mutation);
//  - SetHyperparameters accepts only lr and weight_decay, and passes them through unchanged;
//  - a group ValidateGroup accepts has finite knobs with lr and weight_decay in their
//    documented ranges [0, 1e4];
//  - every error message is bounded and one line.
// Input: one byte choosing the algorithm, two bytes giving the [m, n] shape (1..64 each), then
// a SetHyperparametersRequest in wire form (scripts/fuzz.sh encodes the text seeds so).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "diond/v1/optimizer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/optim/validation.h"
#include "server/rpc/convert.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::optim::Hyperparams;

using diond::fuzz::Require;

void RequireBounded(const absl::Status& s) { diond::fuzz::RequireBoundedMessage(s, 1024); }

bool Same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

bool SameHyperparams(const Hyperparams& a, const Hyperparams& b) {
  return Same(a.lr, b.lr) && Same(a.weight_decay, b.weight_decay) && Same(a.epsilon, b.epsilon) &&
         Same(a.mu, b.mu) && Same(a.beta1, b.beta1) && Same(a.beta2, b.beta2) &&
         Same(a.muon_beta2, b.muon_beta2) && Same(a.fraction, b.fraction) &&
         Same(a.ef_decay, b.ef_decay) && Same(a.rank_fraction, b.rank_fraction) &&
         a.rank_multiple_of == b.rank_multiple_of && a.nesterov == b.nesterov &&
         a.cautious_wd == b.cautious_wd && a.adjust_lr == b.adjust_lr &&
         a.orthogonalizer == b.orthogonalizer && a.qr_method == b.qr_method &&
         a.cqr_warmup_steps == b.cqr_warmup_steps && Same(a.rcqr_oversample, b.rcqr_oversample);
}

constexpr diond::optim::AlgorithmKind kAlgorithms[] = {
    diond::optim::AlgorithmKind::kMuon,     diond::optim::AlgorithmKind::kNorMuon,
    diond::optim::AlgorithmKind::kDion,     diond::optim::AlgorithmKind::kDion2,
    diond::optim::AlgorithmKind::kNorDion2, diond::optim::AlgorithmKind::kAdamW,
    diond::optim::AlgorithmKind::kLion};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  diond::fuzz::SilenceProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const auto algorithm = kAlgorithms[data[0] % 7];
  const std::vector<int64_t> shape = {1 + data[1] % 64, 1 + data[2] % 64};
  diond::v1::SetHyperparametersRequest req;
  if (!req.ParseFromArray(data + 3, static_cast<int>(size - 3))) return 0;
  const diond::v1::Hyperparameters& h = req.hyperparameters();

  // CreateSession's reading of the message.
  diond::optim::GroupConfig config;
  config.algorithm = algorithm;
  config.hyperparams = diond::optim::DefaultHyperparams(algorithm);
  const Hyperparams before = config.hyperparams;
  absl::Status applied = diond::rpc::ApplyHyperparameters(h, &config.hyperparams);
  if (!applied.ok()) {
    RequireBounded(applied);
    Require(SameHyperparams(before, config.hyperparams),
            "a refused Hyperparameters message changed the group's options");
  } else {
    const Hyperparams& a = config.hyperparams;
    Require(!h.has_lr() || Same(a.lr, h.lr()), "lr not applied");
    Require(!h.has_weight_decay() || Same(a.weight_decay, h.weight_decay()),
            "weight_decay not applied");
    Require(!h.has_mu() || Same(a.mu, h.mu()), "mu not applied");
    Require(!h.has_epsilon() || Same(a.epsilon, h.epsilon()), "epsilon not applied");
    Require(!h.has_rank_multiple_of() || a.rank_multiple_of == h.rank_multiple_of(),
            "rank_multiple_of not applied");
    Require(h.has_lr() || Same(a.lr, before.lr), "lr changed although unset");
    Require(h.has_beta1() || Same(a.beta1, before.beta1), "beta1 changed although unset");
    Require(h.has_cqr_warmup_steps() || a.cqr_warmup_steps == before.cqr_warmup_steps,
            "cqr_warmup_steps changed although unset");
    absl::Status valid = diond::optim::ValidateGroup(config, {shape});
    if (!valid.ok()) {
      RequireBounded(valid);
    } else {
      Require(std::isfinite(a.lr) && a.lr >= 0 && a.lr <= diond::optim::kMaxLr,
              "lr outside [0, kMaxLr] accepted");
      Require(std::isfinite(a.weight_decay) && a.weight_decay >= 0 &&
                  a.weight_decay <= diond::optim::kMaxWeightDecay,
              "weight_decay outside [0, kMaxWeightDecay] accepted");
      Require(std::isfinite(a.epsilon) && std::isfinite(a.mu) && std::isfinite(a.beta1) &&
                  std::isfinite(a.beta2),
              "a non-finite knob accepted");
    }
  }

  // SetHyperparameters' reading of the same message.
  auto change = diond::rpc::HyperparameterChangeFromProto(req);
  if (!change.ok()) {
    RequireBounded(change.status());
    diond::v1::Hyperparameters rest = h;
    rest.clear_lr();
    rest.clear_weight_decay();
    Require(rest.ByteSizeLong() != 0, "a request with lr and weight_decay only was refused");
    return 0;
  }
  Require(change->group == req.group(), "group changed");
  Require(change->lr.has_value() == h.has_lr() && (!h.has_lr() || Same(*change->lr, h.lr())),
          "lr not passed through");
  Require(change->weight_decay.has_value() == h.has_weight_decay() &&
              (!h.has_weight_decay() || Same(*change->weight_decay, h.weight_decay())),
          "weight_decay not passed through");
  for (const auto& [name, v, max] :
       {std::tuple<const char*, std::optional<double>, double>{"lr", change->lr,
                                                               diond::optim::kMaxLr},
        {"weight_decay", change->weight_decay, diond::optim::kMaxWeightDecay}}) {
    if (!v.has_value()) continue;
    absl::Status knob = diond::optim::CheckStepKnob(name, *v, max);
    if (knob.ok()) {
      Require(std::isfinite(*v) && *v >= 0 && *v <= max, "a knob outside its range accepted");
    } else {
      RequireBounded(knob);
    }
  }
  return 0;
}
