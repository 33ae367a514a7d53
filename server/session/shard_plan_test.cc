#include "server/session/shard_plan.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/optim/option_table.h"
#include "server/checkpoint/manifest.h"

namespace diond::session {
namespace {

using checkpoint::SpecFromJson;
using checkpoint::SpecToJson;

GroupSpec Group(const std::string& name, optim::AlgorithmKind kind) {
  GroupSpec g;
  g.name = name;
  g.config.algorithm = kind;
  g.config.hyperparams = optim::DefaultHyperparams(kind);
  return g;
}

// A GPT-2-like layout: per block 4 matrices of two shapes plus biases.
SessionSpec GptLike(int blocks) {
  SessionSpec s;
  s.groups = {Group("m", optim::AlgorithmKind::kMuon), Group("a", optim::AlgorithmKind::kAdamW)};
  for (int b = 0; b < blocks; ++b) {
    s.params.push_back({absl::StrCat("h", b, ".qkv"), {96, 32}, DType::kF32, "m"});
    s.params.push_back({absl::StrCat("h", b, ".proj"), {32, 32}, DType::kF32, "m"});
    s.params.push_back({absl::StrCat("h", b, ".fc"), {128, 32}, DType::kF32, "m"});
    s.params.push_back({absl::StrCat("h", b, ".out"), {32, 128}, DType::kF32, "m"});
    s.params.push_back({absl::StrCat("h", b, ".bias"), {32}, DType::kF32, "a"});
  }
  return s;
}

TEST(ShardPlan, WorldOfOneOwnsEverything) {
  auto p = ComputeShardPlan(GptLike(3), 1);
  ASSERT_TRUE(p.ok()) << p.status();
  for (int o : p->owner) EXPECT_EQ(o, 0);
  EXPECT_EQ(p->Owned(0).size(), 15u);
}

TEST(ShardPlan, DeterministicAndHashStable) {
  for (int w : {2, 3, 4}) {
    auto a = ComputeShardPlan(GptLike(4), w);
    auto b = ComputeShardPlan(GptLike(4), w);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->owner, b->owner);
    EXPECT_EQ(a->hash, b->hash);
    EXPECT_EQ(ShardPlanHashHex(a->hash).size(), 16u);
  }
}

TEST(ShardPlan, SameShapeBatchFollowsTheReferenceBlocks) {
  // 6 same-shape matrices over W = 4: per_rank = 2, blocks of 2 from the start rank (0).
  SessionSpec s;
  s.groups = {Group("m", optim::AlgorithmKind::kMuon)};
  for (int j = 0; j < 6; ++j) s.params.push_back({absl::StrCat("w", j), {8, 8}, DType::kF32, "m"});
  auto p = ComputeShardPlan(s, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->owner, (std::vector<int>{0, 0, 1, 1, 2, 2}));
}

TEST(ShardPlan, SingleMatricesSpreadOverRanks) {
  SessionSpec s;
  s.groups = {Group("m", optim::AlgorithmKind::kMuon)};
  for (int j = 0; j < 8; ++j) {
    s.params.push_back({absl::StrCat("w", j), {16, 8 + j}, DType::kF32, "m"});  // all distinct
  }
  for (int w : {2, 3, 4}) {
    auto p = ComputeShardPlan(s, w);
    ASSERT_TRUE(p.ok());
    std::set<int> used(p->owner.begin(), p->owner.end());
    EXPECT_EQ(static_cast<int>(used.size()), w) << "W=" << w;
  }
}

TEST(ShardPlan, BalancedByCost) {
  for (int w : {2, 3, 4}) {
    auto p = ComputeShardPlan(GptLike(12), w);
    ASSERT_TRUE(p.ok());
    double total = 0, most = 0;
    for (double l : p->load) {
      total += l;
      most = std::max(most, l);
    }
    // 12 blocks of each shape: every rank gets exactly its share of each batch when W | 12.
    EXPECT_LE(most, total / w * 1.10) << "W=" << w;
  }
}

TEST(ShardPlan, HashChangesWithEverythingThatMatters) {
  const SessionSpec base = GptLike(2);
  const uint64_t h = ComputeShardPlan(base, 2)->hash;
  EXPECT_NE(ComputeShardPlan(base, 3)->hash, h) << "world size";
  {
    SessionSpec s = base;
    s.params[1].shape = {32, 33};
    EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << "shape";
  }
  {
    SessionSpec s = base;
    s.params[0].name = "other";
    EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << "name";
  }
  {
    SessionSpec s = base;
    s.groups[0].config.hyperparams.lr = 0.02;
    EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << "lr";
  }
  {
    SessionSpec s = base;
    s.gradient_sync = GradientSync::kAverage;
    EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << "gradient sync";
  }
  {
    SessionSpec s = base;
    s.client_name = "another trainer";  // free text: not part of the plan
    EXPECT_EQ(ComputeShardPlan(s, 2)->hash, h);
  }
}

// The ranks must agree on every option: changing any one row's value (kernels/optim/options.def)
// changes the hash, so a row added to the table is in it with no other edit.
TEST(ShardPlan, EveryOptionOfTheTableIsInThePlan) {
  const SessionSpec base = GptLike(1);
  const uint64_t h = ComputeShardPlan(base, 2)->hash;
  for (const optim::OptionRow& row : optim::OptionTable()) {
    SessionSpec s = base;
    optim::Hyperparams& hp = s.groups[0].config.hyperparams;
    optim::OptionValue v = row.get(hp);
    switch (row.type) {
      case optim::OptionType::kDouble:
        v.number = v.number > 0 ? v.number / 2 : v.number + 0.125;
        break;
      case optim::OptionType::kEnum:
        v.integer = (v.integer + 1) % static_cast<int64_t>(row.enum_names.size());
        break;
      default:
        v.integer = v.integer == 0 ? 1 : v.integer + 1;
    }
    row.set(hp, v);
    ASSERT_NE(row.get(hp), row.get(base.groups[0].config.hyperparams)) << row.name;
    EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << row.name;
  }
}

// Dion's qr_method options change the numbers, so the ranks must agree on them, and a checkpoint
// must bring them back (older checkpoints, without the keys, load with the defaults).
TEST(ShardPlan, DionQrOptionsArePartOfThePlanAndOfCheckpoints) {
  SessionSpec base = GptLike(1);
  base.groups[0] = Group("m", optim::AlgorithmKind::kDion);
  const uint64_t h = ComputeShardPlan(base, 2)->hash;
  SessionSpec s = base;
  s.groups[0].config.hyperparams.qr_method = optim::QrMethod::kCqr;
  EXPECT_NE(ComputeShardPlan(s, 2)->hash, h) << "qr_method";
  s.groups[0].config.hyperparams.cqr_warmup_steps = 7;
  const uint64_t h2 = ComputeShardPlan(s, 2)->hash;
  EXPECT_NE(h2, ComputeShardPlan(base, 2)->hash);
  s.groups[0].config.hyperparams.rcqr_oversample = 2.5;
  EXPECT_NE(ComputeShardPlan(s, 2)->hash, h2) << "rcqr_oversample";

  absl::StatusOr<SessionSpec> back = SpecFromJson(SpecToJson(s));
  ASSERT_TRUE(back.ok()) << back.status();
  const optim::Hyperparams& hp = back->groups[0].config.hyperparams;
  EXPECT_EQ(hp.qr_method, optim::QrMethod::kCqr);
  EXPECT_EQ(hp.cqr_warmup_steps, 7);
  EXPECT_EQ(hp.rcqr_oversample, 2.5);

  std::string old = SpecToJson(base);
  for (const char* key : {"\"qr_method\"", "\"cqr_warmup_steps\"", "\"rcqr_oversample\""}) {
    const size_t at = old.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    const size_t end = old.find('\n', at);
    old.erase(at, end - at + 1);  // one "key": value, line (SpecToJson writes one per line)
  }
  back = SpecFromJson(old);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << old;
  EXPECT_EQ(back->groups[0].config.hyperparams.qr_method, optim::QrMethod::kRcqr);
  EXPECT_EQ(back->groups[0].config.hyperparams.cqr_warmup_steps, 150);
  EXPECT_EQ(back->groups[0].config.hyperparams.rcqr_oversample, 1.25);
}

// bf16_matmul changes bf16_reference's numbers: part of the plan when set (the default's text
// and hash are unchanged), and of checkpoints (older ones, without the key, load as auto).
TEST(ShardPlan, Bf16MatmulIsPartOfThePlanAndOfCheckpoints) {
  SessionSpec base = GptLike(1);
  base.groups[0].config.precision = optim::Precision::kBf16Reference;
  const uint64_t h = ComputeShardPlan(base, 2)->hash;
  SessionSpec s = base;
  s.groups[0].config.bf16_matmul = optim::Bf16MatmulEngine::kFloat32Gemm;
  const uint64_t hf = ComputeShardPlan(s, 2)->hash;
  EXPECT_NE(hf, h);
  s.groups[0].config.bf16_matmul = optim::Bf16MatmulEngine::kOneDnn;
  EXPECT_NE(ComputeShardPlan(s, 2)->hash, h);
  EXPECT_NE(ComputeShardPlan(s, 2)->hash, hf);

  absl::StatusOr<SessionSpec> back = SpecFromJson(SpecToJson(s));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->groups[0].config.bf16_matmul, optim::Bf16MatmulEngine::kOneDnn);

  std::string old = SpecToJson(s);
  const size_t at = old.find("\"bf16_matmul\"");
  ASSERT_NE(at, std::string::npos);
  old.erase(at, old.find('\n', at) - at + 1);
  back = SpecFromJson(old);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << old;
  EXPECT_EQ(back->groups[0].config.bf16_matmul, optim::Bf16MatmulEngine::kAuto);

  std::string bad = SpecToJson(s);
  const size_t v = bad.find("\"onednn\"");
  ASSERT_NE(v, std::string::npos);
  bad.replace(v, 8, "\"mkldnn\"");
  EXPECT_FALSE(SpecFromJson(bad).ok());
}

TEST(ShardPlan, UnknownGroupAndBadWorldSize) {
  SessionSpec s = GptLike(1);
  EXPECT_FALSE(ComputeShardPlan(s, 0).ok());
  s.params[0].group = "nope";
  EXPECT_FALSE(ComputeShardPlan(s, 2).ok());
}

}  // namespace
}  // namespace diond::session
