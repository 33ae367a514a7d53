// The reference's options, as its golden vectors record them (tests/conformance/README.md), mapped
// onto a GroupConfig: the option table's rows by their checkpoint keys (kernels/optim/options.def)
// and the reference's own spellings (betas, use_polar_express, ...). UNIMPLEMENTED for an option
// this implementation cannot honour, INVALID_ARGUMENT for a value of the wrong type: never
// ignored.
#ifndef DIOND_KERNELS_OPTIM_CONFORMANCE_REFERENCE_OPTIONS_H_
#define DIOND_KERNELS_OPTIM_CONFORMANCE_REFERENCE_OPTIONS_H_

#include "absl/status/status.h"
#include "kernels/optim/optimizer_types.h"
#include "nlohmann/json.hpp"

namespace diond::optim::conformance {

// The case's "hyperparameters" object.
absl::Status ApplyReferenceHyperparams(const nlohmann::json& hp, GroupConfig* cfg);
// The case's "param_group_options" object.
absl::Status ApplyReferenceGroupOptions(const nlohmann::json& opt, GroupConfig* cfg);

}  // namespace diond::optim::conformance

#endif  // DIOND_KERNELS_OPTIM_CONFORMANCE_REFERENCE_OPTIONS_H_
