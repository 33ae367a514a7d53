// Compact updates (StepOptions::capture, CapturedUpdateSize, ApplyCapturedUpdate): what a daemon
// world exchanges instead of whole matrices for Dion (P, Q_new) and Dion2/NorDion2 (selected
// slices and indices). A worker that applies the owner's payload to its copy of the parameter
// must end with the owner's bits, and capturing must not change the owner's numbers.
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/optim/group_optimizer.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using kernels::testing::RandomVector;  // N(0, 1) from a seed (kernels/cpu/test_util.h)

int64_t Numel(const ParamShape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

struct Case {
  const char* name;
  AlgorithmKind kind;
  ParamShape shape;
  double rank_fraction = 1.0;
  int64_t num_heads = 1;
};

class CapturedUpdate : public ::testing::TestWithParam<Case> {};

TEST_P(CapturedUpdate, NonOwnerReproducesTheOwnerBitForBit) {
  const Case& c = GetParam();
  GroupConfig cfg;
  cfg.algorithm = c.kind;
  cfg.hyperparams = DefaultHyperparams(c.kind);
  cfg.hyperparams.rank_fraction = c.rank_fraction;
  cfg.hyperparams.weight_decay = 0.1;
  cfg.num_heads = c.num_heads;
  const int64_t size = CapturedUpdateSize(cfg, c.shape);
  ASSERT_GT(size, 0);
  EXPECT_LT(size, Numel(c.shape));
  // Three same-shape parameters (one batch); parameter 1 has no gradient this step.
  const size_t n = static_cast<size_t>(Numel(c.shape));
  auto owner = CreateGroupOptimizer(cfg, {c.shape, c.shape, c.shape});
  auto plain = CreateGroupOptimizer(cfg, {c.shape, c.shape, c.shape});
  ASSERT_TRUE(owner.ok() && plain.ok());
  auto ctx = kernels::Context::CpuDefault();
  std::vector<std::vector<float>> x = {RandomVector(n, 1), RandomVector(n, 2), RandomVector(n, 3)};
  std::vector<std::vector<float>> y = x;        // the plain (non-capturing) run
  std::vector<std::vector<float>> replica = x;  // a non-owner's copy
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> g = {RandomVector(n, 10 * step), RandomVector(n, 10 * step + 1),
                                         RandomVector(n, 10 * step + 2)};
    StepCapture cap;
    StepOptions opts;
    opts.lr = 0.02 * step;
    opts.capture = &cap;
    ASSERT_THAT((*owner)->Step(*ctx, {x[0].data(), x[1].data(), x[2].data()},
                               {g[0].data(), nullptr, g[2].data()}, opts),
                IsOk());
    StepOptions plain_opts = opts;
    plain_opts.capture = nullptr;
    ASSERT_THAT((*plain)->Step(*ctx, {y[0].data(), y[1].data(), y[2].data()},
                               {g[0].data(), nullptr, g[2].data()}, plain_opts),
                IsOk());
    // The plain run of Dion2/NorDion2 writes the parameters at commit (UpdateRule::
    // DefersParamWrite), the capturing one stages them: same parameters (below) and the same
    // update norm up to the order of its double sum.
    const double a = (*owner)->last_update_norm(), b = (*plain)->last_update_norm();
    EXPECT_GT(a, 0.0);
    EXPECT_NEAR(b, a, 1e-6 * a) << "step " << step;
    ASSERT_EQ(cap.payload.size(), 3u);
    EXPECT_TRUE(cap.payload[1].empty()) << "no gradient, no payload";
    for (size_t p : {0u, 2u}) {
      EXPECT_EQ(x[p], y[p]) << "capturing changed the numbers, step " << step;
      ASSERT_EQ(static_cast<int64_t>(cap.payload[p].size()), size);
      ASSERT_THAT(
          ApplyCapturedUpdate(*ctx, cfg, c.shape, plain_opts, cap.payload[p], replica[p].data()),
          IsOk());
      ASSERT_EQ(replica[p], x[p]) << "parameter " << p << ", step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, CapturedUpdate,
    ::testing::Values(Case{"DionTall", AlgorithmKind::kDion, {64, 48}, 0.25},
                      Case{"DionWide", AlgorithmKind::kDion, {40, 96}, 0.25},
                      Case{"Dion2Rows", AlgorithmKind::kDion2, {48, 80}},
                      Case{"Dion2Cols", AlgorithmKind::kDion2, {80, 48}},
                      Case{"Dion2Heads", AlgorithmKind::kDion2, {64, 32}, 1.0, 4},
                      Case{"NorDion2", AlgorithmKind::kNorDion2, {64, 48}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(CapturedUpdate, SizesAndRefusals) {
  GroupConfig dion;
  dion.algorithm = AlgorithmKind::kDion;
  dion.hyperparams = DefaultHyperparams(AlgorithmKind::kDion);
  EXPECT_EQ(CapturedUpdateSize(dion, {64, 48}), 0) << "rank fraction 1: P, Q are larger";
  dion.hyperparams.rank_fraction = 0.25;
  EXPECT_EQ(CapturedUpdateSize(dion, {64, 48}), 12 * (64 + 48));
  GroupConfig d2;
  d2.algorithm = AlgorithmKind::kDion2;
  d2.hyperparams = DefaultHyperparams(AlgorithmKind::kDion2);
  EXPECT_EQ(CapturedUpdateSize(d2, {48, 80}), 12 * (80 + 1));  // k = 12 rows + indices
  GroupConfig muon;
  muon.algorithm = AlgorithmKind::kMuon;
  EXPECT_EQ(CapturedUpdateSize(muon, {64, 48}), 0);
  auto ctx = kernels::Context::CpuDefault();
  std::vector<float> x(48 * 80, 1.0f);
  std::vector<float> bad(static_cast<size_t>(12 * 81), 0.0f);
  bad[0] = 48.0f;  // out of range (48 rows)
  EXPECT_FALSE(ApplyCapturedUpdate(*ctx, d2, {48, 80}, {}, bad, x.data()).ok());
  EXPECT_EQ(x, std::vector<float>(48 * 80, 1.0f)) << "nothing written";
  EXPECT_FALSE(ApplyCapturedUpdate(*ctx, d2, {48, 80}, {}, std::vector<float>(5), x.data()).ok());
}

}  // namespace
}  // namespace diond::optim
