// GroupOptimizer's step in parts (BeginStagedStep, one StagePart per disjoint subset of the
// parameters, then WriteStagedParams and CommitStagedState), as a step overlapped with backward
// uses it: for every algorithm in both precisions, parts that come in another order than the
// parameters and split shape buckets give one Stage's parameters, state, step count and update
// norm bit for bit, on a CPU context and on the strict TEST device. A failing part changes
// nothing, a parameter in two parts is refused, and a parameter in no part is left alone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/cpu/test_util.h"
#include "kernels/device_runtime.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/optim/testing/same_bits.h"
#include "kernels/optim/testing/strict_device.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using kernels::Buffer;
using kernels::Context;
using kernels::Device;
using kernels::DeviceType;
using kernels::testing::RandomVector;
using ::testing::HasSubstr;
using testing::Numel;
using testing::SameBits;

constexpr Device kDev{DeviceType::kTest, 0};

struct Case {
  std::string name;
  GroupConfig config;
  std::vector<ParamShape> shapes;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

GroupConfig Base(AlgorithmKind k, Precision p) {
  GroupConfig c;
  c.algorithm = k;
  c.hyperparams = DefaultHyperparams(k);
  c.hyperparams.lr = 0.02;
  c.precision = p;
  c.seed = 7;
  return c;
}

// Three shape buckets, interleaved: A = {0, 2, 4}, B = {1, 5}, C = {3}.
std::vector<Case> AllCases() {
  const ParamShape a = {16, 24}, b = {24, 16}, c = {8, 8};
  std::vector<Case> v;
  for (Precision p : {Precision::kFp32, Precision::kBf16Reference}) {
    const std::string ps(PrecisionName(p));
    for (AlgorithmKind k : {AlgorithmKind::kMuon, AlgorithmKind::kNorMuon, AlgorithmKind::kDion,
                            AlgorithmKind::kDion2, AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW,
                            AlgorithmKind::kLion}) {
      if (p == Precision::kBf16Reference && !HasBf16Path(k)) continue;
      const std::string an(AlgorithmName(k));
      GroupConfig cfg = Base(k, p);
      if (k == AlgorithmKind::kAdamW || k == AlgorithmKind::kLion) {
        v.push_back({an + "_" + ps, cfg, {a, {7}, a, {0, 3}, a, {7}}});
        continue;
      }
      if (k == AlgorithmKind::kDion) cfg.hyperparams.rank_fraction = 0.5;
      v.push_back({an + "_" + ps, cfg, {a, b, a, c, a, b}});
      if (k == AlgorithmKind::kMuon || k == AlgorithmKind::kNorMuon) {
        GroupConfig h = cfg;
        h.num_heads = 4;
        v.push_back({an + "_heads_" + ps, h, {a, {32, 8}, a, {32, 8}, a, {32, 8}}});
        GroupConfig s = cfg;
        s.split_sizes = {6, 10};
        v.push_back({an + "_split_" + ps, s, {a, {16, 8}, a, {16, 8}, a, {16, 8}}});
      }
      if (k == AlgorithmKind::kDion2 || k == AlgorithmKind::kNorDion2) {
        GroupConfig h = cfg;
        h.num_heads = 2;
        v.push_back({an + "_heads_" + ps, h, {a, b, a, c, a, b}});
      }
      if (k == AlgorithmKind::kDion) {
        for (QrMethod q : {QrMethod::kRcqr, QrMethod::kCqr}) {
          GroupConfig d = cfg;
          d.hyperparams.qr_method = q;
          d.hyperparams.cqr_warmup_steps = 1;
          d.hyperparams.rank_fraction = 0.25;
          v.push_back({an + "_" + std::string(QrMethodName(q)) + "_" + ps, d, {a, b, a, c, a, b}});
        }
      }
    }
  }
  return v;
}

// A step's parts, each the parameters it gives a gradient; a parameter in none has none.
using Parts = std::vector<std::vector<size_t>>;

struct Snapshot {
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> state;  // per parameter, per state name
  int64_t steps = 0;
  double norm = 0;
};

// Bitwise equality of two snapshots, naming the first difference.
::testing::AssertionResult SameSnapshot(const Snapshot& got, const Snapshot& want) {
  if (got.steps != want.steps) {
    return ::testing::AssertionFailure() << "steps_taken " << got.steps << " vs " << want.steps;
  }
  if (std::memcmp(&got.norm, &want.norm, sizeof(double)) != 0) {
    return ::testing::AssertionFailure() << "last_update_norm " << got.norm << " vs " << want.norm;
  }
  for (size_t i = 0; i < want.params.size(); ++i) {
    auto r = SameBits(got.params[i], want.params[i], "parts", "stage");
    if (!r) return r << " (parameter " << i << ")";
  }
  for (size_t i = 0; i < want.state.size(); ++i) {
    auto r = SameBits(got.state[i], want.state[i], "parts", "stage");
    if (!r) return r << " (state tensor " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

// A context on the CPU (two threads) or on the strict TEST device; buffers in its memory.
class PartsTest : public ::testing::Test {
 protected:
  void Open(bool device) {
    if (device) {
      ASSERT_THAT(device_.Open(kDev), IsOk());
      ctx_ = &device_.ctx();
      return;
    }
    kernels::ContextOptions o;
    o.num_threads = 2;
    auto c = Context::Create(o);
    ASSERT_THAT(c.status(), IsOk());
    cpu_ = std::move(*c);
    ctx_ = cpu_.get();
  }
  void TearDown() override {
    ctx_ = nullptr;
    device_.Close();
  }

  // At least one element, so that an empty parameter has a pointer too.
  Buffer Upload(const std::vector<float>& v) {
    const int64_t n = static_cast<int64_t>(v.size());
    auto b = ctx_->Allocate(kernels::DType::kF32, {std::max<int64_t>(n, 1)});
    EXPECT_THAT(b.status(), IsOk());
    const kernels::TensorView dst(
        b->As<float>(), kernels::ContiguousLayout(kernels::DType::kF32, {n}), b->device());
    EXPECT_THAT(kernels::CopyFromHost(*ctx_, kernels::MakeView(v.data(), {n}), dst), IsOk());
    return std::move(*b);
  }
  std::vector<float> Download(const float* p, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    const kernels::ConstTensorView src(p, kernels::ContiguousLayout(kernels::DType::kF32, {n}),
                                       ctx_->device());
    EXPECT_THAT(kernels::CopyToHost(*ctx_, src, kernels::MakeView(v.data(), {n})), IsOk());
    return v;
  }

  // An optimizer with its parameters (the same initial values for every side).
  struct Side {
    std::unique_ptr<GroupOptimizer> opt;
    std::vector<Buffer> x;
    std::vector<float*> params;
  };
  void MakeSide(const Case& c, Side* s) {
    auto o = CreateGroupOptimizer(*ctx_, c.config, c.shapes);
    ASSERT_THAT(o.status(), IsOk());
    s->opt = std::move(*o);
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      s->x.push_back(Upload(RandomVector(Numel(c.shapes[i]), 70 + static_cast<uint32_t>(i))));
      s->params.push_back(s->x.back().As<float>());
    }
  }
  Snapshot Snap(const Case& c, const Side& s) {
    Snapshot snap;
    snap.steps = s.opt->steps_taken();
    snap.norm = s.opt->last_update_norm();
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      snap.params.push_back(Download(s.params[i], Numel(c.shapes[i])));
      for (const std::string& name : s.opt->StateNames()) {
        if (s.opt->StateReleased(i)) {  // (compared as empty)
          snap.state.emplace_back();
          continue;
        }
        auto shape = s.opt->StateShape(i, name);
        EXPECT_THAT(shape.status(), IsOk());
        std::vector<float> st(static_cast<size_t>(Numel(*shape)));
        EXPECT_THAT(s.opt->GetState(*ctx_, i, name, absl::MakeSpan(st)), IsOk());
        snap.state.push_back(std::move(st));
      }
    }
    return snap;
  }
  // Gradients of `step` for every parameter.
  std::vector<Buffer> Grads(const Case& c, int step) {
    std::vector<Buffer> g;
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      g.push_back(Upload(RandomVector(Numel(c.shapes[i]), 100 * step + static_cast<uint32_t>(i))));
    }
    return g;
  }
  // grads[i] for the parameters in `which`, null for the others.
  static std::vector<const float*> Only(const std::vector<Buffer>& g,
                                        const std::vector<size_t>& which) {
    std::vector<const float*> p(g.size(), nullptr);
    for (size_t i : which) p[i] = g[i].As<float>();
    return p;
  }
  // One Stage with the union of `parts`, written and committed.
  static void StageOnce(const Context& ctx, Side& s, const std::vector<Buffer>& g,
                        const Parts& parts, const StepOptions& o) {
    std::vector<size_t> all;
    for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
    ASSERT_THAT(s.opt->Stage(ctx, s.params, Only(g, all), o), IsOk());
    s.opt->WriteStagedParams(s.params);
    s.opt->CommitStagedState();
  }

  testing::StrictTestDevice device_;
  std::unique_ptr<Context> cpu_;
  Context* ctx_ = nullptr;
};

class EveryRule : public PartsTest, public ::testing::WithParamInterface<std::tuple<Case, bool>> {};

TEST_P(EveryRule, PartsInAnyOrderEqualOneStageBitForBit) {
  const Case& c = std::get<0>(GetParam());
  ASSERT_NO_FATAL_FAILURE(Open(std::get<1>(GetParam())));
  Side one, parts;
  ASSERT_NO_FATAL_FAILURE(MakeSide(c, &one));
  ASSERT_NO_FATAL_FAILURE(MakeSide(c, &parts));
  // Buckets A = {0, 2, 4}, B = {1, 5}, C = {3}. Step 1 stages A as [4, 0, 2] over three parts,
  // step 2 has no gradient for 1, 4 and 5, step 3 stages A as [2, 0, 4], and step 4 splits A over
  // two parts in member order.
  const std::vector<Parts> schedule = {
      {{4, 1}, {5, 0, 3}, {2}}, {{3}, {2, 0}}, {{1, 2}, {0, 3, 4, 5}}, {{0}, {5, 2, 4}, {3, 1}}};
  for (int step = 1; step <= static_cast<int>(schedule.size()); ++step) {
    const Parts& sp = schedule[static_cast<size_t>(step) - 1];
    const std::vector<Buffer> g = Grads(c, step);
    StepOptions o;
    if (step == 2) o.lr = 0.005;
    if (step == 3) o.step = 7;
    const Snapshot before = Snap(c, parts);
    // Steps 1 and 3 capture the compact updates (a world's owners): the parts' capture holds
    // one Stage's payloads.
    StepCapture capture_one, capture_parts;
    StepOptions o_parts = o;
    if (step % 2 == 1) {
      o.capture = &capture_one;
      o_parts.capture = &capture_parts;
    }
    ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, one, g, sp, o));
    ASSERT_THAT(parts.opt->BeginStagedStep(*ctx_, o_parts), IsOk());
    for (const auto& p : sp) ASSERT_THAT(parts.opt->StagePart(parts.params, Only(g, p)), IsOk());
    // Before the write, each staged new value (a world's owner sends it): one Stage's bits once
    // written. A parameter in no part has none; a step that does not capture may keep a compact
    // update in its place (a rule that defers its write).
    std::vector<std::vector<float>> staged(c.shapes.size());
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      bool in_a_part = false;
      for (const auto& p : sp) in_a_part = in_a_part || std::count(p.begin(), p.end(), i) > 0;
      Buffer dst = Upload(std::vector<float>(static_cast<size_t>(Numel(c.shapes[i])), 0.0f));
      const absl::Status s = parts.opt->CopyStagedParam(i, dst.As<float>());
      if (s.ok()) {
        EXPECT_TRUE(in_a_part) << "parameter " << i;
        staged[i] = Download(dst.As<float>(), Numel(c.shapes[i]));
      } else {
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_TRUE(!in_a_part || o_parts.capture == nullptr) << "parameter " << i << ": " << s;
      }
    }
    if (step == 4) {  // the device session's write: the norm's read-back queued, then summed
      parts.opt->WriteStagedParamsDeferringNorm(parts.params);
      ASSERT_THAT(kernels::Synchronize(*ctx_), IsOk());
      parts.opt->FinishStagedNorm();
    } else {
      parts.opt->WriteStagedParams(parts.params);
    }
    EXPECT_EQ(parts.opt->staged_update_norm(), one.opt->last_update_norm());
    parts.opt->CommitStagedState();
    ASSERT_EQ(capture_parts.payload.size(), capture_one.payload.size());
    for (size_t i = 0; i < capture_one.payload.size(); ++i) {
      EXPECT_TRUE(SameBits(capture_parts.payload[i], capture_one.payload[i]))
          << c.name << " step " << step << ": the capture of parameter " << i;
    }
    const Snapshot got = Snap(c, parts);
    EXPECT_TRUE(SameSnapshot(got, Snap(c, one))) << c.name << " step " << step;
    for (size_t i = 0; i < staged.size(); ++i) {
      if (!staged[i].empty()) {
        EXPECT_TRUE(SameBits(staged[i], got.params[i])) << c.name << " step " << step << " " << i;
      }
    }
    if (step == 2) {  // the parameters in no part, and their state, did not move
      const size_t names = parts.opt->StateNames().size();
      for (size_t i : {size_t{1}, size_t{4}, size_t{5}}) {
        EXPECT_TRUE(SameBits(got.params[i], before.params[i])) << "parameter " << i;
        for (size_t k = 0; k < names; ++k) {
          EXPECT_TRUE(SameBits(got.state[i * names + k], before.state[i * names + k]))
              << "state " << k << " of parameter " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Parts, EveryRule,
                         ::testing::Combine(::testing::ValuesIn(AllCases()), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Case, bool>>& i) {
                           return std::get<0>(i.param).name +
                                  (std::get<1>(i.param) ? "_test_device" : "_cpu");
                         });

// Arguments a step in parts refuses; a refused part changes nothing, and the step goes on to
// give one Stage's bits.
TEST_F(PartsTest, RefusedPartsChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Open(/*device=*/false));
  for (AlgorithmKind k : {AlgorithmKind::kMuon, AlgorithmKind::kDion2, AlgorithmKind::kAdamW}) {
    const Case c{std::string(AlgorithmName(k)),
                 Base(k, Precision::kFp32),
                 {{16, 24}, {24, 16}, {16, 24}, {8, 8}}};
    Side one, parts;
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &one));
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &parts));
    const std::vector<Buffer> g = Grads(c, 1);
    GroupOptimizer& opt = *parts.opt;
    EXPECT_THAT(opt.StagePart(parts.params, Only(g, {0})),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginStagedStep")));
    StepOptions bad;
    bad.in_place = true;
    EXPECT_THAT(opt.BeginStagedStep(*ctx_, bad), StatusIs(absl::StatusCode::kInvalidArgument));
    bad = {};
    bad.lr = -1;
    EXPECT_THAT(opt.BeginStagedStep(*ctx_, bad), StatusIs(absl::StatusCode::kInvalidArgument));
    const Snapshot initial = Snap(c, parts);

    ASSERT_THAT(opt.BeginStagedStep(*ctx_), IsOk());
    ASSERT_THAT(opt.StagePart(parts.params, Only(g, {2, 1})), IsOk());
    // Parameter 1 again, with one that is new: the whole part is refused.
    EXPECT_THAT(opt.StagePart(parts.params, Only(g, {0, 1})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameter 1")));
    std::vector<float*> null_param = parts.params;
    null_param[0] = nullptr;
    EXPECT_THAT(opt.StagePart(null_param, Only(g, {0})),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
    std::vector<const float*> alias = Only(g, {3});
    alias[3] = parts.params[3];
    EXPECT_THAT(opt.StagePart(parts.params, alias),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aliases")));
    EXPECT_THAT(opt.StagePart(parts.params, {}), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), initial)) << c.name << ": a part wrote";
    ASSERT_THAT(opt.StagePart(parts.params, Only(g, {3, 0})), IsOk());
    opt.WriteStagedParams(parts.params);
    EXPECT_THAT(opt.StagePart(parts.params, Only(g, {})),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    opt.CommitStagedState();
    ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, one, g, {{0, 1, 2, 3}}, {}));
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), Snap(c, one))) << c.name;

    // A discarded step in parts leaves the state and the step count; a released parameter
    // cannot be in a part.
    const Snapshot committed = Snap(c, parts);
    const std::vector<Buffer> g2 = Grads(c, 2);
    ASSERT_THAT(opt.BeginStagedStep(*ctx_), IsOk());
    ASSERT_THAT(opt.StagePart(parts.params, Only(g2, {1, 3})), IsOk());
    opt.DiscardStagedStep();
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), committed)) << c.name << ": a discard kept state";
    EXPECT_THAT(opt.StagePart(parts.params, Only(g2, {0})),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    ASSERT_THAT(opt.ReleaseState(*ctx_, {true, false, true, true}), IsOk());
    ASSERT_THAT(opt.BeginStagedStep(*ctx_), IsOk());
    EXPECT_THAT(opt.StagePart(parts.params, Only(g2, {1})),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("released")));
    // The step goes on without it (its bucket is now empty), as one Stage does.
    ASSERT_THAT(opt.StagePart(parts.params, Only(g2, {3, 0})), IsOk());
    ASSERT_THAT(opt.StagePart(parts.params, Only(g2, {2})), IsOk());
    opt.WriteStagedParams(parts.params);
    opt.CommitStagedState();
    ASSERT_THAT(one.opt->ReleaseState(*ctx_, {true, false, true, true}), IsOk());
    ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, one, g2, {{0, 2, 3}}, {}));
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), Snap(c, one))) << c.name << " after the release";
  }
}

// Compressed Dion's replica average in parts: each part averages its own sub-batches of P and R.
// The average here is elementwise, as the ranks' all-reduce is (each element the mean of the
// ranks' same element, whatever the batch), so parts in any order give one Stage's bits; and the
// average is applied (without it the result differs), once per part and shape bucket for each of
// P and R.
TEST_F(PartsTest, CompressedDionAveragesPerPart) {
  for (bool device : {false, true}) {
    ASSERT_NO_FATAL_FAILURE(Open(device));
    for (const Case& c : AllCases()) {
      if (c.config.algorithm != AlgorithmKind::kDion) continue;
      SCOPED_TRACE(c.name + (device ? " on the TEST device" : " on the CPU"));
      Side one, parts, plain;
      ASSERT_NO_FATAL_FAILURE(MakeSide(c, &one));
      ASSERT_NO_FATAL_FAILURE(MakeSide(c, &parts));
      ASSERT_NO_FATAL_FAILURE(MakeSide(c, &plain));
      int calls = 0;
      StepOptions o;
      o.replica_average = [&calls](absl::Span<float> v) {
        ++calls;
        for (float& e : v) e = 0.5f * (e + 0.25f);  // the mean with a replica holding 0.25
        return absl::OkStatus();
      };
      // Buckets A = {0, 2, 4}, B = {1, 5}, C = {3}: six sub-batches in three parts.
      const Parts sp = {{4, 1}, {5, 0, 3}, {2}};
      for (int step = 1; step <= 2; ++step) {
        const std::vector<Buffer> g = Grads(c, step);
        ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, one, g, sp, o));
        ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, plain, g, sp, {}));
        calls = 0;
        ASSERT_THAT(parts.opt->BeginStagedStep(*ctx_, o), IsOk());
        for (const auto& p : sp) {
          ASSERT_THAT(parts.opt->StagePart(parts.params, Only(g, p)), IsOk());
        }
        parts.opt->WriteStagedParams(parts.params);
        parts.opt->CommitStagedState();
        EXPECT_EQ(calls, 2 * 6) << "step " << step;
        const Snapshot got = Snap(c, parts);
        EXPECT_TRUE(SameSnapshot(got, Snap(c, one))) << "step " << step;
        EXPECT_FALSE(SameBits(got.params[0], Snap(c, plain).params[0])) << "step " << step;
      }
      // The average belongs to its step: the next step in parts without one does not call it.
      calls = 0;
      const std::vector<Buffer> g = Grads(c, 3);
      ASSERT_THAT(parts.opt->BeginStagedStep(*ctx_), IsOk());
      ASSERT_THAT(parts.opt->StagePart(parts.params, Only(g, {0, 1})), IsOk());
      parts.opt->DiscardStagedStep();
      EXPECT_EQ(calls, 0);
    }
    TearDown();
  }
}

// The update norm adds one float Σ(Δx)² per parameter in double, in parameter order whichever
// part staged it. Here parameter 0 has a gradient and the others, tiny and without one, only
// decay: their Σ are near the last bit of the total, so adding them in another order (smallest
// first) shows.
TEST_F(PartsTest, TheNormAddsParametersInTheirOrder) {
  ASSERT_NO_FATAL_FAILURE(Open(/*device=*/false));
  for (AlgorithmKind k : {AlgorithmKind::kMuon, AlgorithmKind::kAdamW}) {
    const Case c{std::string(AlgorithmName(k)), Base(k, Precision::kFp32),
                 std::vector<ParamShape>(8, ParamShape{4, 4})};
    Side one, parts;
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &one));
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &parts));
    for (size_t i = 1; i < c.shapes.size(); ++i) {  // x_i ~ 2^-20 .. 2^-22
      std::vector<float> v = RandomVector(16, 30 + static_cast<uint32_t>(i));
      for (float& e : v) e = std::ldexp(e, -20 - static_cast<int>(i % 3));
      one.x[i] = Upload(v);
      parts.x[i] = Upload(v);
      one.params[i] = one.x[i].As<float>();
      parts.params[i] = parts.x[i].As<float>();
    }
    const Buffer zero = Upload(std::vector<float>(16, 0.0f));
    for (int step = 1; step <= 4; ++step) {
      std::vector<const float*> g(c.shapes.size(), zero.As<float>());
      const std::vector<Buffer> g0 = Grads(c, step);
      g[0] = g0[0].As<float>();
      ASSERT_THAT(one.opt->Stage(*ctx_, one.params, g), IsOk());
      one.opt->WriteStagedParams(one.params);
      one.opt->CommitStagedState();
      ASSERT_THAT(parts.opt->BeginStagedStep(*ctx_), IsOk());
      for (size_t p = c.shapes.size(); p-- > 0;) {  // one part per parameter, the last first
        std::vector<const float*> part(c.shapes.size(), nullptr);
        part[p] = g[p];
        ASSERT_THAT(parts.opt->StagePart(parts.params, part), IsOk());
      }
      parts.opt->WriteStagedParams(parts.params);
      parts.opt->CommitStagedState();
      EXPECT_TRUE(SameSnapshot(Snap(c, parts), Snap(c, one))) << c.name << " step " << step;
    }
  }
}

// A part that fails in the middle of its computation (the TEST device's pool is exhausted when
// it reaches its second bucket, after the rule ran on its first) changes nothing; retried, the
// step gives one Stage's bits.
TEST_F(PartsTest, APartThatFailsMidwayChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Open(/*device=*/true));
  for (AlgorithmKind k :
       {AlgorithmKind::kMuon, AlgorithmKind::kNorMuon, AlgorithmKind::kDion, AlgorithmKind::kDion2,
        AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW, AlgorithmKind::kLion}) {
    GroupConfig cfg = Base(k, Precision::kFp32);
    cfg.hyperparams.rank_fraction = 0.5;
    const Case c{std::string(AlgorithmName(k)), cfg, {{16, 24}, {24, 16}, {16, 24}, {8, 8}}};
    Side one, parts;
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &one));
    ASSERT_NO_FATAL_FAILURE(MakeSide(c, &parts));
    const std::vector<Buffer> g = Grads(c, 1);
    ASSERT_NO_FATAL_FAILURE(StageOnce(*ctx_, one, g, {{0, 1, 2, 3}}, {}));
    const Snapshot initial = Snap(c, parts);
    GroupOptimizer& opt = *parts.opt;
    ASSERT_THAT(opt.BeginStagedStep(*ctx_), IsOk());
    ASSERT_THAT(opt.StagePart(parts.params, Only(g, {0})), IsOk());  // bucket A's staging
    // No more device memory: bucket A's member 2 is computed, bucket C's staging cannot be had.
    auto stats = kernels::DeviceRuntimeFor(kDev.type).memory_stats(kDev);
    ASSERT_THAT(stats.status(), IsOk());
    kernels::testing::ResetHostTestDevice(stats->in_use + 1);
    EXPECT_THAT(opt.StagePart(parts.params, Only(g, {3, 2})),
                StatusIs(absl::StatusCode::kResourceExhausted))
        << c.name;
    const auto counters = kernels::testing::GetHostTestDeviceCounters();
    EXPECT_GT(counters.ops + counters.deferred, 0) << c.name << ": the rule ran on bucket A";
    kernels::testing::ResetHostTestDevice(0);
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), initial)) << c.name << ": the failed part wrote";
    ASSERT_THAT(opt.StagePart(parts.params, Only(g, {3, 2})), IsOk());
    ASSERT_THAT(opt.StagePart(parts.params, Only(g, {1})), IsOk());
    opt.WriteStagedParams(parts.params);
    opt.CommitStagedState();
    EXPECT_TRUE(SameSnapshot(Snap(c, parts), Snap(c, one))) << c.name;
  }
}

}  // namespace
}  // namespace diond::optim
