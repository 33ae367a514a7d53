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
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("lr and weight_decay only")));
}

}  // namespace
}  // namespace diond::rpc

namespace diond::rpc {
namespace {

v1::CreateSessionRequest OneGroup(v1::Bf16Matmul engine) {
  v1::CreateSessionRequest req;
  v1::ParameterGroup* g = req.add_groups();
  g->set_name("g");
  g->set_algorithm(v1::ALGORITHM_MUON);
  g->set_precision(v1::PRECISION_BF16_REFERENCE);
  g->set_bf16_matmul(engine);
  return req;
}

TEST(SpecFromProto, Bf16MatmulEngine) {
  const std::pair<v1::Bf16Matmul, optim::Bf16MatmulEngine> cases[] = {
      {v1::BF16_MATMUL_UNSPECIFIED, optim::Bf16MatmulEngine::kAuto},
      {v1::BF16_MATMUL_AUTO, optim::Bf16MatmulEngine::kAuto},
      {v1::BF16_MATMUL_FLOAT32_GEMM, optim::Bf16MatmulEngine::kFloat32Gemm},
      {v1::BF16_MATMUL_ONEDNN, optim::Bf16MatmulEngine::kOneDnn}};
  for (const auto& [wire, want] : cases) {
    auto spec = SpecFromProto(OneGroup(wire));
    ASSERT_THAT(spec.status(), IsOk());
    ASSERT_EQ(spec->groups.size(), 1u);
    EXPECT_EQ(spec->groups[0].config.bf16_matmul, want) << wire;
  }
  EXPECT_THAT(SpecFromProto(OneGroup(static_cast<v1::Bf16Matmul>(7))).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("bf16_matmul 7")));
}

}  // namespace
}  // namespace diond::rpc
