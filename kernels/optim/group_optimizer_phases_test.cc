// GroupOptimizer's three-phase step (Stage, WriteStagedParams, CommitStagedState or
// DiscardStagedStep), which server/session uses to keep a Step transactional while it computes
// on a trainer's memory: the phases together give Step's bits, and a discard leaves the state
// and the step count as they were.
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optim/group_optimizer.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;

std::vector<float> Values(uint32_t seed, size_t n) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

class PhasesTest : public ::testing::TestWithParam<AlgorithmKind> {};

TEST_P(PhasesTest, PhasesEqualStepAndDiscardChangesNoState) {
  GroupConfig cfg;
  cfg.algorithm = GetParam();
  cfg.hyperparams = DefaultHyperparams(cfg.algorithm);
  const std::vector<ParamShape> shapes = {{16, 24}, {16, 24}, {24, 8}};
  auto a = *CreateGroupOptimizer(cfg, shapes);  // stepped with Step()
  auto b = *CreateGroupOptimizer(cfg, shapes);  // stepped in phases, with discarded attempts
  auto ctx = *kernels::Context::Create(kernels::ContextOptions{});
  std::vector<std::vector<float>> pa, pb, g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t n = static_cast<size_t>(shapes[i][0] * shapes[i][1]);
    pa.push_back(Values(10 + i, n));
    pb.push_back(pa.back());
    g.push_back({});
  }
  auto ptrs = [](std::vector<std::vector<float>>& v) {
    std::vector<float*> p;
    for (auto& x : v) p.push_back(x.data());
    return p;
  };
  for (int step = 1; step <= 3; ++step) {
    std::vector<const float*> gp;
    for (size_t i = 0; i < shapes.size(); ++i) {
      g[i] = Values(100 * step + i, pa[i].size());
      gp.push_back(g[i].data());
    }
    ASSERT_THAT(a->Step(*ctx, ptrs(pa), gp), IsOk());

    // An attempt that is dropped after the weights were written: the state and the step count
    // stay; the weights (the caller's memory) are restored by the caller here.
    const auto weights_before = pb;
    std::vector<std::vector<float>> state_before;
    for (size_t i = 0; i < shapes.size(); ++i) {
      for (const std::string& s : b->StateNames()) {
        auto shape = *b->StateShape(i, s);
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        state_before.emplace_back(static_cast<size_t>(n));
        ASSERT_THAT(b->GetState(i, s, absl::MakeSpan(state_before.back())), IsOk());
      }
    }
    ASSERT_THAT(b->Stage(*ctx, ptrs(pb), gp), IsOk());
    EXPECT_EQ(pb, weights_before) << "Stage wrote the parameters";
    b->WriteStagedParams(ptrs(pb));
    EXPECT_NE(pb, weights_before) << "WriteStagedParams wrote nothing";
    b->DiscardStagedStep();
    EXPECT_EQ(b->steps_taken(), step - 1);
    size_t k = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      for (const std::string& s : b->StateNames()) {
        std::vector<float> now(state_before[k].size());
        ASSERT_THAT(b->GetState(i, s, absl::MakeSpan(now)), IsOk());
        EXPECT_EQ(now, state_before[k])
            << "state '" << s << "' of parameter " << i << " changed by a discarded step";
        ++k;
      }
    }
    pb = weights_before;

    // The same step again, committed: bit-identical to Step().
    ASSERT_THAT(b->Stage(*ctx, ptrs(pb), gp), IsOk());
    b->WriteStagedParams(ptrs(pb));
    EXPECT_EQ(b->staged_update_norm(), a->last_update_norm());
    b->CommitStagedState();
    EXPECT_EQ(b->steps_taken(), step);
    EXPECT_EQ(b->last_update_norm(), a->last_update_norm());
    EXPECT_EQ(pb, pa) << "step " << step;
    for (size_t i = 0; i < shapes.size(); ++i) {
      for (const std::string& s : a->StateNames()) {
        auto shape = *a->StateShape(i, s);
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        std::vector<float> sa(static_cast<size_t>(n)), sb(static_cast<size_t>(n));
        ASSERT_THAT(a->GetState(i, s, absl::MakeSpan(sa)), IsOk());
        ASSERT_THAT(b->GetState(i, s, absl::MakeSpan(sb)), IsOk());
        EXPECT_EQ(sa, sb) << "state '" << s << "' of parameter " << i << " after step " << step;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryAlgorithm, PhasesTest,
                         ::testing::Values(AlgorithmKind::kMuon, AlgorithmKind::kNorMuon,
                                           AlgorithmKind::kDion, AlgorithmKind::kDion2,
                                           AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW,
                                           AlgorithmKind::kLion));

}  // namespace
}  // namespace diond::optim
