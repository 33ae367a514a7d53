// The reference's options onto a GroupConfig: every row of the option table is read by its
// checkpoint key, so an option added to kernels/optim/options.def reaches the conformance tool
// with no other edit; the reference's own spellings and refusals.
#include "kernels/optim/conformance/reference_options.h"

#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optim/option_table.h"
#include "kernels/optim/testing/option_values.h"

namespace diond::optim::conformance {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ReferenceOptions, EveryRowIsReadByItsCheckpointKey) {
  for (const OptionRow& row : OptionTable()) {
    const OptionValue want = optim::testing::NonDefault(row);
    nlohmann::json v;
    switch (row.type) {
      case OptionType::kDouble:
        v = want.number;
        break;
      case OptionType::kInt:
        v = static_cast<double>(want.integer);  // the reference writes Python numbers
        break;
      case OptionType::kBool:
        v = want.integer != 0;
        break;
      case OptionType::kEnum:
        v = std::string(row.enum_names[static_cast<size_t>(want.integer)]);
        break;
    }
    GroupConfig cfg;
    cfg.hyperparams = DefaultHyperparams(AlgorithmKind::kMuon);
    ASSERT_THAT(ApplyReferenceHyperparams({{std::string(row.member), v}}, &cfg), IsOk())
        << row.member;
    EXPECT_EQ(row.get(cfg.hyperparams), want) << row.member;
  }
}

TEST(ReferenceOptions, TheReferencesOwnSpellings) {
  GroupConfig cfg;
  cfg.hyperparams = DefaultHyperparams(AlgorithmKind::kAdamW);
  ASSERT_THAT(ApplyReferenceHyperparams({{"betas", {0.5, 0.75}},
                                         {"use_polar_express", false},
                                         {"adjust_lr", nullptr},
                                         {"flatten", true}},
                                        &cfg),
              IsOk());
  EXPECT_EQ(cfg.hyperparams.beta1, 0.5);
  EXPECT_EQ(cfg.hyperparams.beta2, 0.75);
  EXPECT_EQ(cfg.hyperparams.orthogonalizer, Orthogonalizer::kNewtonSchulz5);
  EXPECT_EQ(cfg.hyperparams.adjust_lr, AdjustLr::kNone);
  EXPECT_TRUE(cfg.flatten);
}

TEST(ReferenceOptions, WhatCannotBeHonouredIsRefused) {
  GroupConfig cfg;
  EXPECT_THAT(ApplyReferenceHyperparams({{"use_gram_newton_schulz", true}}, &cfg),
              StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(ApplyReferenceHyperparams({{"power_iters", 2}}, &cfg),
              StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(ApplyReferenceHyperparams({{"no_such_option", 1}}, &cfg),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("no_such_option")));
  EXPECT_THAT(ApplyReferenceHyperparams({{"rank_multiple_of", 2.5}}, &cfg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an integer")));
  EXPECT_THAT(ApplyReferenceHyperparams({{"qr_method", "householder"}}, &cfg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("householder")));
  EXPECT_THAT(ApplyReferenceHyperparams({{"lr", "fast"}}, &cfg),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr is not a number")));
  EXPECT_THAT(ApplyReferenceGroupOptions({{"split_sizes", "3"}}, &cfg),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace diond::optim::conformance
