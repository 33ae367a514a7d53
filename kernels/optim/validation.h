// Validation of a parameter group's configuration and parameter shapes, mirroring the
// reference's constructor and step-time checks (ALGORITHMS.md §5.1, §6.1, §7.1, §8.1, §9.1,
// §14) where the reference raises ValueError / NotImplementedError / AssertionError. Every
// failure is INVALID_ARGUMENT with a message naming the field and its value. Nothing aborts.
//
// Thread-safety: pure functions.
#ifndef DIOND_KERNELS_OPTIM_VALIDATION_H_
#define DIOND_KERNELS_OPTIM_VALIDATION_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim {

// Upper bounds of the step-size knobs. Every update is computed in fp32 as w -= lr * (update) and
// w *= 1 - lr * weight_decay, where each rule's update is bounded (orthogonalized matrices have
// entries <= 1 times an lr adjustment of at most ~1e3, Adam's ratio and Lion's sign are O(1)):
// with lr, weight_decay <= 1e4 no single step can overflow fp32 (max ~3.4e38) from finite
// weights, and every value stays exactly representable as a float. Without the bounds, an lr of
// 1e308 writes NaN into every weight (Muon) or fails only at Step time (AdamW, Lion).
inline constexpr double kMaxLr = 1e4;
inline constexpr double kMaxWeightDecay = 1e4;
inline constexpr double kMaxEpsilon = 1e4;

// INVALID_ARGUMENT "<name> = <v> is outside [0, <max>]" unless v is finite and in [0, max]: the
// one rule for lr and weight_decay wherever they arrive (CreateSession, SetHyperparameters,
// Step's lr_override).
absl::Status CheckStepKnob(absl::string_view name, double v, double max);

// Checks every hyperparameter the algorithm reads (finite and in range), every option
// (rejected when the algorithm lacks it), and every shape against the algorithm and options:
//   * every row of the option table (option_table.h, options.def) that applies to the
//     algorithm: in its range (lr in [0, kMaxLr], mu in [0, 1), ...); every row of kind
//     kRefused that does not: its default (nesterov only Muon/NorMuon, cautious_wd only
//     Muon/NorMuon/AdamW/Lion, adjust_lr / orthogonalizer only the megabatch family, Dion's
//     qr_method, cqr_warmup_steps and rcqr_oversample only Dion).
//   * Dion: 2-D parameters only; with a tall P a sketch of at least r rows (unless qr_method
//     is qr).
//   * AdamW/Lion: any shape (0-D included).
//   * Matrix algorithms: rank >= 2, every dim >= 1; num_heads >= 1 dividing m of every (2-D)
//     parameter, not with flatten, not on Dion/AdamW/Lion; split_sizes only on Muon/NorMuon,
//     >= 2 positive sizes summing to m of every (2-D) parameter, not with num_heads > 1 or
//     flatten; flatten not on Dion/AdamW/Lion; nesterov only Muon/NorMuon; cautious_wd only
//     Muon/NorMuon/AdamW/Lion; non-default adjust_lr / orthogonalizer only on the megabatch
//     family.
//   * at least one parameter.
absl::Status ValidateGroup(const GroupConfig& config, const std::vector<ParamShape>& shapes);

// lr / weight_decay overrides: as CheckStepKnob.
absl::Status ValidateStepOptions(const StepOptions& options);

}  // namespace diond::optim

#endif  // DIOND_KERNELS_OPTIM_VALIDATION_H_
