// A conformance vector (tests/conformance/README.md) as a service session: its metadata mapped
// onto the proto ParameterGroup a trainer would send AND onto the optim::GroupConfig that the
// in-process replay uses, key by key in one place so the two cannot drift apart.
//
// Mapping: metadata `algorithm` (dion_reference -> ALGORITHM_DION, nordion2 -> ALGORITHM_DION3),
// `hyperparameters` (lr, mu, weight_decay, epsilon, muon_beta2, fraction, ef_decay,
// rank_fraction, rank_multiple_of, nesterov, cautious_wd, betas, adjust_lr (null = NONE),
// use_polar_express -> orthogonalizer, flatten -> ParameterGroup.flatten, qr_method,
// cqr_warmup_steps, rcqr_oversample -> oversample) and `param_group_options` (num_heads,
// split_sizes). Keys that do not change a single-device result (use_triton, selection_scope,
// verbose; see kernels/optim/conformance/runner.cc) are not sent.
//
// Thread-safety: plain values.
#ifndef DIOND_TESTS_SERVICE_GOLDEN_CASE_H_
#define DIOND_TESTS_SERVICE_GOLDEN_CASE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {

struct GoldenCase {
  std::string file;
  optim::AlgorithmKind algorithm = optim::AlgorithmKind::kMuon;
  GroupDesc group;  // named "g"; precision fp32 (callers set the mode)
  std::vector<int64_t> shape;
  int64_t steps = 0;
  std::vector<float> param_init;
  std::vector<std::vector<float>> grads;                 // grads[t-1] = grad.<t>
  std::vector<std::vector<float>> ref_params;            // param.<t>
  std::vector<float> param_f64_final;                    // empty if absent
  std::map<std::string, std::vector<float>> state_init;  // present state.<name>.init
  std::map<std::string, double> tolerance;               // tolerance_* metadata

  // A one-parameter session ("w" in group "g") with `precision`.
  SessionDesc Session(optim::Precision precision) const;
};

absl::StatusOr<GoldenCase> LoadGoldenCase(const std::string& path);

// Relative Frobenius error ||a - b|| / ||b|| in double (README §4).
double RelFro(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace diond::service_testing

#endif  // DIOND_TESTS_SERVICE_GOLDEN_CASE_H_
