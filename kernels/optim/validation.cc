#include "kernels/optim/validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "kernels/optim/option_table.h"

namespace diond::optim {
namespace {

absl::Status Bad(const GroupConfig& c, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(AlgorithmName(c.algorithm), ": ", what));
}

std::string ShapeString(const ParamShape& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

bool IsMegabatch(AlgorithmKind k) { return HasBf16Path(k); }

// Every row of the option table: the range of each option the algorithm reads, then the
// options it lacks (a non-default value of a kRefused row).
absl::Status CheckHyperparams(const GroupConfig& c) {
  const Hyperparams& h = c.hyperparams;
  const AlgorithmKind k = c.algorithm;
  for (const OptionRow& row : OptionTable()) {
    if (!row.AppliesTo(k)) continue;
    if (absl::Status s = row.CheckRange(row.get(h)); !s.ok()) return Bad(c, s.message());
  }
  for (const OptionRow& row : OptionTable()) {
    if (row.AppliesTo(k) || row.elsewhere != OptionElsewhere::kRefused) continue;
    const OptionValue v = row.get(h);
    if (v != row.Default(k)) {
      return Bad(c, absl::StrCat(row.Label(), " = ", row.Format(v), " is not supported (",
                                 AlgorithmList(row.algorithms), " only)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckShapes(const GroupConfig& c, const std::vector<ParamShape>& shapes) {
  const AlgorithmKind k = c.algorithm;
  if (shapes.empty()) return Bad(c, "a group needs at least one parameter");
  const bool matrix = k != AlgorithmKind::kAdamW && k != AlgorithmKind::kLion;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const ParamShape& s = shapes[i];
    for (int64_t d : s) {
      if (d < 0 || (matrix && d == 0)) {
        return Bad(c, absl::StrCat("parameter ", i, " has invalid shape ", ShapeString(s)));
      }
    }
    if (matrix && s.size() < 2) {
      return Bad(c, absl::StrCat("parameter ", i, " has shape ", ShapeString(s),
                                 "; matrix algorithms need rank >= 2"));
    }
    if (k == AlgorithmKind::kDion && s.size() != 2) {
      return Bad(c, absl::StrCat("parameter ", i, " has shape ", ShapeString(s),
                                 "; Dion supports 2-D parameters only"));
    }
    if (k == AlgorithmKind::kDion && c.hyperparams.qr_method != QrMethod::kQr) {
      // The randomized Cholesky QR (rcqr, and cqr's warm-up and fallback) needs a sketch of at
      // least r rows when P is tall (a > r).
      const int64_t r =
          DionRank(s[0], s[1], c.hyperparams.rank_fraction, c.hyperparams.rank_multiple_of);
      const int64_t a = std::max(s[0], s[1]);
      const int64_t rows = RcqrSketchRows(r, c.hyperparams.rcqr_oversample);
      if (a > r && rows < r) {
        return Bad(c, absl::StrCat("rcqr_oversample = ", c.hyperparams.rcqr_oversample,
                                   " gives a sketch of ", rows, " rows for parameter ", i, " ",
                                   ShapeString(s), " of rank r = ", r,
                                   "; the randomized Cholesky QR needs at least r rows"));
      }
    }
    if (c.num_heads > 1) {
      if (s.size() != 2) {
        return Bad(c, absl::StrCat("num_heads is only supported for 2-D parameters; parameter ", i,
                                   " has shape ", ShapeString(s)));
      }
      if (s[0] % c.num_heads != 0) {
        return Bad(c, absl::StrCat("num_heads = ", c.num_heads, " does not divide dim 0 of ",
                                   "parameter ", i, " ", ShapeString(s)));
      }
    }
    if (!c.split_sizes.empty()) {
      if (s.size() != 2) {
        return Bad(c, absl::StrCat("split_sizes is only supported for 2-D parameters; ",
                                   "parameter ", i, " has shape ", ShapeString(s)));
      }
      // Saturating: a client may send sizes whose sum overflows int64.
      int64_t sum = 0;
      for (int64_t v : c.split_sizes) {
        sum = v > 0 && sum > std::numeric_limits<int64_t>::max() - v
                  ? std::numeric_limits<int64_t>::max()
                  : sum + v;
      }
      if (sum != s[0]) {
        return Bad(c, absl::StrCat("split_sizes [", BoundedList(c.split_sizes), "] sum to ", sum,
                                   ", not dim 0 of parameter ", i, " ", ShapeString(s)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const GroupConfig& c) {
  const AlgorithmKind k = c.algorithm;
  if (c.num_heads < 1) return Bad(c, absl::StrCat("num_heads = ", c.num_heads, " must be >= 1"));
  if (c.num_heads > 1) {
    if (!IsMegabatch(k)) return Bad(c, "num_heads is not supported by this algorithm");
    if (c.flatten) return Bad(c, "num_heads cannot be combined with flatten");
  }
  if (!c.split_sizes.empty()) {
    if (k != AlgorithmKind::kMuon && k != AlgorithmKind::kNorMuon) {
      return Bad(c, "split_sizes is not supported (Muon and NorMuon only)");
    }
    if (c.split_sizes.size() < 2) {
      return Bad(
          c, absl::StrCat("split_sizes [", BoundedList(c.split_sizes), "] needs at least 2 sizes"));
    }
    for (int64_t s : c.split_sizes) {
      if (s <= 0) {
        return Bad(c, absl::StrCat("split_sizes [", BoundedList(c.split_sizes),
                                   "] has a non-positive size"));
      }
    }
    if (c.num_heads > 1) return Bad(c, "split_sizes cannot be combined with num_heads");
    if (c.flatten) return Bad(c, "split_sizes cannot be combined with flatten");
  }
  if (c.flatten && !IsMegabatch(k)) return Bad(c, "flatten is not supported by this algorithm");
  if (c.precision != Precision::kFp32 && c.precision != Precision::kBf16Reference) {
    return Bad(c, "unknown precision");
  }
  if (c.bf16_matmul != Bf16MatmulEngine::kAuto && c.bf16_matmul != Bf16MatmulEngine::kFloat32Gemm &&
      c.bf16_matmul != Bf16MatmulEngine::kOneDnn) {
    return Bad(c, "unknown bf16_matmul");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGroup(const GroupConfig& config, const std::vector<ParamShape>& shapes) {
  if (absl::Status s = CheckHyperparams(config); !s.ok()) return s;
  if (absl::Status s = CheckOptions(config); !s.ok()) return s;
  return CheckShapes(config, shapes);
}

absl::Status CheckStepKnob(absl::string_view name, double v, double max) {
  if (std::isfinite(v) && v >= 0 && v <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " = ", v, " is outside [0, ", max, "] (finite)"));
}

absl::Status ValidateStepOptions(const StepOptions& options) {
  if (options.lr.has_value()) {
    DIOND_RETURN_IF_ERROR(CheckStepKnob("step lr override", *options.lr, kMaxLr));
  }
  if (options.weight_decay.has_value()) {
    DIOND_RETURN_IF_ERROR(
        CheckStepKnob("step weight_decay override", *options.weight_decay, kMaxWeightDecay));
  }
  if (options.step.has_value() && *options.step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step number = ", *options.step, " must be >= 1"));
  }
  return absl::OkStatus();
}

}  // namespace diond::optim
