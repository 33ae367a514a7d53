#include "kernels/optim/conformance/reference_options.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/optim/option_table.h"

namespace diond::optim::conformance {
namespace {

using json = nlohmann::json;

absl::StatusOr<double> Number(const json& j, absl::string_view key) {
  if (!j.is_number()) return absl::InvalidArgumentError(absl::StrCat(key, " is not a number"));
  return j.get<double>();
}
absl::StatusOr<bool> Bool(const json& j, absl::string_view key) {
  if (!j.is_boolean()) return absl::InvalidArgumentError(absl::StrCat(key, " is not a bool"));
  return j.get<bool>();
}

// A reference key that is an option's checkpoint key (the row's member, kernels/optim/options.def),
// read by the row's type. Ranges are ValidateGroup's, when the optimizer is made.
absl::Status ApplyOptionRow(const OptionRow& row, const json& v, Hyperparams& h) {
  const std::string key(row.member);
  OptionValue value = row.get(h);
  switch (row.type) {
    case OptionType::kDouble: {
      DIOND_ASSIGN_OR_RETURN(value.number, Number(v, key));
      break;
    }
    case OptionType::kInt: {
      DIOND_ASSIGN_OR_RETURN(const double d, Number(v, key));
      if (d != std::floor(d)) return absl::InvalidArgumentError(key + " is not an integer");
      value.integer = static_cast<int64_t>(d);
      break;
    }
    case OptionType::kBool: {
      DIOND_ASSIGN_OR_RETURN(const bool b, Bool(v, key));
      value.integer = b ? 1 : 0;
      break;
    }
    case OptionType::kEnum: {
      if (!v.is_string()) return absl::InvalidArgumentError(key + " is not a string");
      const auto& names = row.enum_names;
      const auto it = std::find(names.begin(), names.end(), v.get<std::string>());
      if (it == names.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown ", key, " '", v.get<std::string>().substr(0, 64), "'"));
      }
      value.integer = it - names.begin();
      break;
    }
  }
  row.set(h, value);
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyReferenceHyperparams(const json& hp, GroupConfig* cfg) {
  if (!hp.is_object()) return absl::InvalidArgumentError("hyperparameters is not an object");
  Hyperparams& h = cfg->hyperparams;
  for (auto it = hp.begin(); it != hp.end(); ++it) {
    const std::string& k = it.key();
    const json& v = *it;
    if (k == "flatten") {
      DIOND_ASSIGN_OR_RETURN(cfg->flatten, Bool(v, k));
    } else if (k == "betas") {
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
        return absl::InvalidArgumentError("betas is not a pair of numbers");
      }
      h.beta1 = v[0].get<double>();
      h.beta2 = v[1].get<double>();
    } else if (k == "adjust_lr" && v.is_null()) {
      h.adjust_lr = AdjustLr::kNone;
    } else if (k == "use_polar_express") {
      DIOND_ASSIGN_OR_RETURN(bool pe, Bool(v, k));
      h.orthogonalizer = pe ? Orthogonalizer::kPolarExpress : Orthogonalizer::kNewtonSchulz5;
    } else if (k == "use_triton" || k == "use_gram_newton_schulz" || k == "triton_post_ortho") {
      // Triton kernels compute the same functions (§3.2, §7.6); Gram-NS is a different one.
      DIOND_ASSIGN_OR_RETURN(bool on, Bool(v, k));
      if (on && k == "use_gram_newton_schulz") {
        return absl::UnimplementedError("use_gram_newton_schulz=true is not supported");
      }
    } else if (k == "power_iters") {
      DIOND_ASSIGN_OR_RETURN(double d, Number(v, k));
      if (d != 1) return absl::UnimplementedError("power_iters != 1 is not supported");
    } else if (k == "selection_scope") {
      // Only differs on the sharded path (§7.4); single device both scopes are "local".
      if (!v.is_string() || (v.get<std::string>() != "local" && v.get<std::string>() != "global")) {
        return absl::InvalidArgumentError("selection_scope must be local or global");
      }
    } else if (k == "verbose") {
      // Logging only.
    } else if (const OptionRow* row = FindOptionByMember(k); row != nullptr) {
      DIOND_RETURN_IF_ERROR(ApplyOptionRow(*row, v, h));
    } else {
      return absl::UnimplementedError(absl::StrCat("unsupported hyperparameter '", k, "'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyReferenceGroupOptions(const json& opt, GroupConfig* cfg) {
  if (!opt.is_object()) return absl::InvalidArgumentError("param_group_options is not an object");
  for (auto it = opt.begin(); it != opt.end(); ++it) {
    const std::string& k = it.key();
    const json& v = *it;
    if (k == "algorithm") continue;  // already taken from the metadata's algorithm
    if (k == "num_heads") {
      if (v.is_null()) continue;
      if (!v.is_number_integer()) return absl::InvalidArgumentError("num_heads is not an int");
      cfg->num_heads = v.get<int64_t>();
    } else if (k == "split_sizes") {
      if (v.is_null()) continue;
      if (!v.is_array()) return absl::InvalidArgumentError("split_sizes is not a list");
      for (const json& s : v) {
        if (!s.is_number_integer()) return absl::InvalidArgumentError("split_sizes entry");
        cfg->split_sizes.push_back(s.get<int64_t>());
      }
    } else if (k == "cautious_wd") {
      DIOND_ASSIGN_OR_RETURN(cfg->hyperparams.cautious_wd, Bool(v, k));
    } else {
      return absl::UnimplementedError(absl::StrCat("unsupported group option '", k, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::optim::conformance
