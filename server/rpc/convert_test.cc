#include "server/rpc/convert.h"

#include <cmath>
#include <limits>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

// Found by hyperparameters_fuzz: a message with a valid lr and an invalid beta1 was refused, but
// the lr had already been written into the group's options.
TEST(ApplyHyperparameters, ARefusedMessageChangesNothing) {
  optim::Hyperparams h = optim::DefaultHyperparams(optim::AlgorithmKind::kAdamW);
  const optim::Hyperparams before = h;
  v1::Hyperparameters m;
  m.set_lr(0.5);
  m.set_mu(0.5);
  m.set_beta1(std::numeric_limits<double>::quiet_NaN());
  EXPECT_THAT(ApplyHyperparameters(m, &h),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("beta1")));
  EXPECT_EQ(h.lr, before.lr);
  EXPECT_EQ(h.mu, before.mu);
  EXPECT_EQ(h.beta1, before.beta1);

  v1::Hyperparameters bad_enum;
  bad_enum.set_lr(0.25);
  bad_enum.set_orthogonalizer(static_cast<v1::Orthogonalizer>(99));
  EXPECT_THAT(ApplyHyperparameters(bad_enum, &h), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(h.lr, before.lr);
}

TEST(ApplyHyperparameters, AnAcceptedMessageSetsExactlyItsFields) {
  optim::Hyperparams h = optim::DefaultHyperparams(optim::AlgorithmKind::kMuon);
  const optim::Hyperparams before = h;
  v1::Hyperparameters m;
  m.set_lr(0.125);
  m.set_nesterov(true);
  ASSERT_THAT(ApplyHyperparameters(m, &h), IsOk());
  EXPECT_EQ(h.lr, 0.125);
  EXPECT_TRUE(h.nesterov);
  EXPECT_EQ(h.mu, before.mu);
  EXPECT_EQ(h.weight_decay, before.weight_decay);
}

TEST(HyperparameterChangeFromProto, OnlyLrAndWeightDecay) {
  v1::SetHyperparametersRequest req;
  req.set_group("g");
  req.mutable_hyperparameters()->set_lr(0.5);
  auto c = HyperparameterChangeFromProto(req);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->group, "g");
  EXPECT_EQ(c->lr, 0.5);
  EXPECT_FALSE(c->weight_decay.has_value());
  req.mutable_hyperparameters()->set_beta1(0.5);
  EXPECT_THAT(HyperparameterChangeFromProto(req).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("lr and weight_decay only")));
}

}  // namespace
}  // namespace diond::rpc
