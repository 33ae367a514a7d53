// Every update rule on a device Context (the kernel side of device sessions): GroupOptimizer with
// its state, staging and scratch, and the caller's parameters and gradients, in the memory of the
// host-memory TEST backend (kernels/testing/host_device_backend.h) in STRICT mode, where any host
// read or write of that memory outside an op or an explicit copy faults (SIGSEGV). The TEST
// backend runs the CPU's arithmetic, so each result must equal the same rule on the CPU context
// bit for bit: parameters, every state tensor, the update norm and the capture payloads, over
// several steps (one without a gradient), for every algorithm, both precisions and the variants
// (split_sizes, num_heads, flatten, Dion's qr methods, replica averaging, captured updates,
// released state, the three-phase step).
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/cpu/test_util.h"
#include "kernels/engine_choice.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/optim/orthogonalize.h"
#include "kernels/optim/testing/same_bits.h"
#include "kernels/optim/testing/strict_device.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using kernels::Buffer;
using kernels::Context;
using kernels::Device;
using kernels::DeviceType;
using kernels::testing::RandomVector;  // N(0, 1) from a seed (kernels/cpu/test_util.h)
using ::testing::HasSubstr;

constexpr Device kDev{DeviceType::kTest, 0};

int64_t Numel(const ParamShape& s) { return testing::Numel(s); }
::testing::AssertionResult SameBits(const std::vector<float>& got, const std::vector<float>& want) {
  return testing::SameBits(got, want, "device", "cpu");
}

class StrictDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_THAT(device_.Open(kDev), IsOk());
    dev_ = &device_.ctx();
    cpu_ = Context::CpuDefault(1);
  }
  void TearDown() override {
    dev_ = nullptr;
    device_.Close();
  }
  testing::StrictTestDevice device_;

  // A device buffer holding `v` (uploaded with the public copy).
  Buffer Upload(const std::vector<float>& v) {
    auto b = dev_->Allocate(kernels::DType::kF32, {static_cast<int64_t>(v.size())});
    EXPECT_THAT(b.status(), IsOk());
    EXPECT_THAT(
        kernels::CopyFromHost(*dev_, kernels::MakeView(v.data(), {static_cast<int64_t>(v.size())}),
                              b->view()),
        IsOk());
    return std::move(*b);
  }
  std::vector<float> Download(const Buffer& b) {
    const int64_t n = b.NumElements();
    std::vector<float> v(static_cast<size_t>(n));
    const kernels::ConstTensorView flat(
        b.data(), kernels::ContiguousLayout(kernels::DType::kF32, {n}), b.device());
    EXPECT_THAT(kernels::CopyToHost(*dev_, flat, kernels::MakeView(v.data(), {n})), IsOk());
    return v;
  }

  Context* dev_ = nullptr;
  std::unique_ptr<Context> cpu_;
};

// ---- the guard itself ----------------------------------------------------------------------

using StrictDeviceDeathTest = StrictDevice;

TEST_F(StrictDeviceDeathTest, HostAccessOfStrictDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto b = dev_->Allocate(kernels::DType::kF32, {16});
  ASSERT_THAT(b.status(), IsOk());
  // Through the ops and the explicit copies the memory works...
  ASSERT_THAT(kernels::Fill(*dev_, 3.0f, b->view()), IsOk());
  std::vector<float> host(16);
  ASSERT_THAT(kernels::CopyToHost(*dev_, b->view(), kernels::MakeView(host.data(), {16})), IsOk());
  EXPECT_EQ(host, std::vector<float>(16, 3.0f));
  // ...but a host read or write outside them dies at once.
  float* p = b->As<float>();
  EXPECT_DEATH(
      {
        volatile float v = *p;
        (void)v;
      },
      "");
  EXPECT_DEATH(*static_cast<volatile float*>(p) = 1.0f, "");
  // A lenient-mode allocation (strict off) is plain host memory.
  kernels::testing::SetHostTestDeviceStrict(false);
  auto lenient = dev_->Allocate(kernels::DType::kF32, {4});
  ASSERT_THAT(lenient.status(), IsOk());
  lenient->As<float>()[0] = 2.0f;
  EXPECT_EQ(lenient->As<float>()[0], 2.0f);
}

TEST_F(StrictDevice, HostDeviceCopiesAreValidated) {
  auto b = dev_->Allocate(kernels::DType::kF32, {2, 3});
  ASSERT_THAT(b.status(), IsOk());
  std::vector<float> h(6, 1.5f), back(6, 0.0f);
  ASSERT_THAT(kernels::CopyFromHost(*dev_, kernels::MakeView(h.data(), {2, 3}), b->view()), IsOk());
  ASSERT_THAT(kernels::CopyToHost(*dev_, b->view(), kernels::MakeView(back.data(), {2, 3})),
              IsOk());
  EXPECT_EQ(back, h);
  // Wrong shape, wrong side, wrong dtype: INVALID_ARGUMENT naming the argument.
  EXPECT_THAT(kernels::CopyFromHost(*dev_, kernels::MakeView(h.data(), {6}), b->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dst")));
  EXPECT_THAT(kernels::CopyToHost(*dev_, b->view(), b->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host_dst")));
  EXPECT_THAT(kernels::CopyFromHost(*dev_, kernels::MakeView(h.data(), {2, 3}),
                                    kernels::MakeView(back.data(), {2, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dst")));
  std::vector<kernels::BFloat16> hb(6);
  EXPECT_THAT(kernels::CopyToHost(*dev_, b->view(), kernels::MakeView(hb.data(), {2, 3})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  EXPECT_EQ(back, h);
  // On the CPU context both are plain copies.
  std::vector<float> c(6, 0.0f);
  ASSERT_THAT(kernels::CopyFromHost(*cpu_, kernels::MakeView(h.data(), {2, 3}),
                                    kernels::MakeView(c.data(), {2, 3})),
              IsOk());
  EXPECT_EQ(c, h);
}

// ---- the orthogonalizer ----------------------------------------------------------------------

TEST_F(StrictDevice, OrthogonalizeMatchesTheCpuBitForBit) {
  for (auto method : {kernels::OrthoMethod::kPolarExpress, kernels::OrthoMethod::kNewtonSchulz5}) {
    for (auto precision :
         {kernels::OrthoPrecision::kFp32, kernels::OrthoPrecision::kBf16Reference}) {
      for (auto mm : {kernels::Bf16Matmul::kReferenceF32Gemm, kernels::Bf16Matmul::kOneDnnBf16}) {
        if (precision == kernels::OrthoPrecision::kFp32 &&
            mm != kernels::Bf16Matmul::kReferenceF32Gemm) {
          continue;
        }
        // oneDNN's bf16 matmul needs the AVX-512 core (kernels/engine_choice.h).
        if (mm == kernels::Bf16Matmul::kOneDnnBf16 && !kernels::CpuHasOneDnnBf16Matmul()) continue;
        for (const std::vector<int64_t>& shape :
             std::vector<std::vector<int64_t>>{{2, 24, 40}, {40, 24}, {16, 16}, {1, 9}, {9, 1}}) {
          kernels::OrthogonalizeOptions o;
          o.method = method;
          o.precision = precision;
          o.bf16_matmul = mm;
          const int64_t n = Numel(shape);
          const std::vector<float> in = RandomVector(static_cast<size_t>(n), 5);
          std::vector<float> want(in.size());
          const auto layout = kernels::ContiguousLayout(kernels::DType::kF32, shape);
          ASSERT_THAT(kernels::Orthogonalize(*cpu_, o, kernels::ConstTensorView(in.data(), layout),
                                             kernels::TensorView(want.data(), layout)),
                      IsOk());
          Buffer din = Upload(in);
          auto dout = dev_->Allocate(kernels::DType::kF32, shape);
          ASSERT_THAT(dout.status(), IsOk());
          ASSERT_THAT(
              kernels::Orthogonalize(*dev_, o, kernels::ConstTensorView(din.data(), layout, kDev),
                                     dout->view()),
              IsOk());
          EXPECT_TRUE(SameBits(Download(*dout), want))
              << "method " << static_cast<int>(method) << " precision "
              << static_cast<int>(precision) << " matmul " << static_cast<int>(mm) << " shape "
              << layout.DebugString();
        }
      }
    }
  }
}

// ---- every rule through GroupOptimizer --------------------------------------------------------

struct RuleCase {
  std::string name;
  GroupConfig config;
  std::vector<ParamShape> shapes;
  bool capture = false;
  bool replica_average = false;
};

GroupConfig Base(AlgorithmKind k, Precision p) {
  GroupConfig c;
  c.algorithm = k;
  c.hyperparams = DefaultHyperparams(k);
  c.hyperparams.lr = 0.02;
  c.precision = p;
  c.seed = 11;
  return c;
}

std::vector<RuleCase> AllRuleCases() {
  std::vector<RuleCase> v;
  const std::vector<ParamShape> mixed = {{24, 40}, {24, 40}, {40, 16}};
  for (Precision p : {Precision::kFp32, Precision::kBf16Reference}) {
    const std::string ps(PrecisionName(p));
    for (AlgorithmKind k : {AlgorithmKind::kMuon, AlgorithmKind::kNorMuon, AlgorithmKind::kDion,
                            AlgorithmKind::kDion2, AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW,
                            AlgorithmKind::kLion}) {
      if (p == Precision::kBf16Reference && !HasBf16Path(k)) continue;
      const std::string an(AlgorithmName(k));
      GroupConfig c = Base(k, p);
      if (k == AlgorithmKind::kDion) c.hyperparams.rank_fraction = 0.5;
      if (k == AlgorithmKind::kAdamW || k == AlgorithmKind::kLion) {
        v.push_back({an + "_" + ps, c, {{24, 40}, {24, 40}, {7}, {0, 3}}});
        GroupConfig cw = c;
        cw.hyperparams.cautious_wd = true;
        v.push_back({an + "_cautious_" + ps, cw, mixed});
        continue;
      }
      v.push_back({an + "_" + ps, c, mixed});
      if (k == AlgorithmKind::kMuon || k == AlgorithmKind::kNorMuon) {
        GroupConfig cs = c;
        cs.split_sizes = {8, 16};
        cs.hyperparams.nesterov = true;
        v.push_back({an + "_split_" + ps, cs, {{24, 40}, {24, 40}}});
        GroupConfig ch = c;
        ch.num_heads = 4;
        v.push_back({an + "_heads_" + ps, ch, {{32, 24}}});
        GroupConfig cf = c;
        cf.flatten = true;
        cf.hyperparams.orthogonalizer = Orthogonalizer::kNewtonSchulz5;
        v.push_back({an + "_flatten_ns5_" + ps, cf, {{4, 6, 5}, {4, 6, 5}}});
      }
      if (k == AlgorithmKind::kDion2 || k == AlgorithmKind::kNorDion2) {
        RuleCase rc{an + "_capture_" + ps, c, {{32, 64}, {64, 32}}, true};
        v.push_back(rc);
        GroupConfig ch = c;
        ch.num_heads = 2;
        v.push_back({an + "_heads_" + ps, ch, {{32, 48}}});
      }
      if (k == AlgorithmKind::kDion) {
        for (QrMethod q : {QrMethod::kQr, QrMethod::kRcqr, QrMethod::kCqr}) {
          GroupConfig cq = c;
          cq.hyperparams.qr_method = q;
          cq.hyperparams.cqr_warmup_steps = 1;
          cq.hyperparams.rank_fraction = 0.25;
          RuleCase rc{an + "_" + std::string(QrMethodName(q)) + "_capture_" + ps,
                      cq,
                      {{64, 48}, {64, 48}, {32, 96}},
                      true};
          v.push_back(rc);
        }
        RuleCase ra{an + "_replica_average_" + ps, c, {{32, 48}, {48, 32}}, false, true};
        v.push_back(ra);
      }
    }
  }
  return v;
}

class DeviceRules : public StrictDevice, public ::testing::WithParamInterface<RuleCase> {};

TEST_P(DeviceRules, StepsMatchTheCpuBitForBit) {
  const RuleCase& rc = GetParam();
  auto dev_opt = CreateGroupOptimizer(*dev_, rc.config, rc.shapes);
  auto cpu_opt = CreateGroupOptimizer(*cpu_, rc.config, rc.shapes);
  ASSERT_THAT(dev_opt.status(), IsOk());
  ASSERT_THAT(cpu_opt.status(), IsOk());
  GroupOptimizer& d = **dev_opt;
  GroupOptimizer& c = **cpu_opt;
  const size_t np = rc.shapes.size();
  std::vector<std::vector<float>> hx(np);
  std::vector<Buffer> dx;
  for (size_t i = 0; i < np; ++i) {
    hx[i] = RandomVector(static_cast<size_t>(Numel(rc.shapes[i])), 70 + static_cast<uint32_t>(i));
    hx[i].reserve(1);  // a non-null pointer for an empty parameter too
    dx.push_back(Upload(hx[i]));
  }
  // A replica average that is not the identity (the mean of this replica and a fixed other one
  // whose values are 0.5 times ours), run on host memory in both cases.
  auto average = [](absl::Span<float> v) {
    for (float& e : v) e = (e + 0.5f * e) * 0.5f;
    return absl::OkStatus();
  };
  for (int step = 1; step <= 4; ++step) {
    std::vector<std::vector<float>> hg(np);
    std::vector<Buffer> dg;
    std::vector<float*> dp, hp;
    std::vector<const float*> dgp, hgp;
    for (size_t i = 0; i < np; ++i) {
      hg[i] =
          RandomVector(hx[i].size(), 100 * static_cast<uint32_t>(step) + static_cast<uint32_t>(i));
      hg[i].reserve(1);
      dg.push_back(Upload(hg[i]));
      dp.push_back(dx[i].As<float>());
      hp.push_back(hx[i].data());
      // Step 2: parameter 1 has no gradient (its state must not move; AdamW's step_dev stays).
      const bool none = step == 2 && np > 1;
      dgp.push_back(none && i == 1 ? nullptr : dg[i].As<float>());
      hgp.push_back(none && i == 1 ? nullptr : hg[i].data());
    }
    StepOptions o;
    StepCapture dcap, ccap;
    StepOptions oc = o;
    if (rc.capture) {
      o.capture = &dcap;
      oc.capture = &ccap;
    }
    if (rc.replica_average) {
      o.replica_average = average;
      oc.replica_average = average;
    }
    if (step == 3) {  // an lr override and, on the staged path, the three phases
      o.lr = oc.lr = 0.005;
      ASSERT_THAT(d.Stage(*dev_, dp, dgp, o), IsOk());
      d.WriteStagedParams(dp);
      d.CommitStagedState();
      ASSERT_THAT(c.Stage(*cpu_, hp, hgp, oc), IsOk());
      c.WriteStagedParams(hp);
      c.CommitStagedState();
    } else {
      ASSERT_THAT(d.Step(*dev_, dp, dgp, o), IsOk()) << "step " << step;
      ASSERT_THAT(c.Step(*cpu_, hp, hgp, oc), IsOk()) << "step " << step;
    }
    EXPECT_EQ(d.last_update_norm(), c.last_update_norm()) << "step " << step;
    for (size_t i = 0; i < np; ++i) {
      EXPECT_TRUE(SameBits(Download(dx[i]), hx[i]))
          << rc.name << " step " << step << " param " << i;
    }
    if (rc.capture) {
      ASSERT_EQ(dcap.payload.size(), ccap.payload.size());
      for (size_t i = 0; i < np; ++i) {
        EXPECT_TRUE(SameBits(dcap.payload[i], ccap.payload[i]))
            << rc.name << " step " << step << " capture " << i;
      }
    }
  }
  EXPECT_EQ(d.StateFloats(), c.StateFloats());
  for (size_t i = 0; i < np; ++i) {
    for (const std::string& name : d.StateNames()) {
      auto shape = d.StateShape(i, name);
      ASSERT_THAT(shape.status(), IsOk());
      int64_t n = 1;
      for (int64_t e : *shape) n *= e;
      std::vector<float> ds(static_cast<size_t>(n)), cs(static_cast<size_t>(n));
      ASSERT_THAT(d.GetState(*dev_, i, name, absl::MakeSpan(ds)), IsOk());
      ASSERT_THAT(c.GetState(i, name, absl::MakeSpan(cs)), IsOk());
      EXPECT_TRUE(SameBits(ds, cs)) << rc.name << " state " << name << " of " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryRule, DeviceRules, ::testing::ValuesIn(AllRuleCases()),
                         [](const ::testing::TestParamInfo<RuleCase>& i) { return i.param.name; });

// ---- sync points (docs/KERNELS.md §4.3) ------------------------------------------------------

// The TEST backend counts every entry that hands a value to the host (copies, top-k, all-zero
// checks, stream synchronizations). A step of Muon, NorMuon, AdamW or Lion has exactly one: the
// read-back of the update norms (the orthogonalizer keeps its scalars on the device; AdamW's
// step_dev is advanced on the device and mirrored on the host).
TEST_F(StrictDevice, StepsHaveOnlyTheListedSyncPoints) {
  struct Want {
    AlgorithmKind kind;
    Precision precision;
    int64_t syncs;
  };
  const std::vector<ParamShape> shapes = {{24, 40}, {24, 40}, {40, 16}};
  for (const Want& w : {Want{AlgorithmKind::kMuon, Precision::kFp32, 1},
                        Want{AlgorithmKind::kMuon, Precision::kBf16Reference, 1},
                        Want{AlgorithmKind::kNorMuon, Precision::kFp32, 1},
                        Want{AlgorithmKind::kNorMuon, Precision::kBf16Reference, 1},
                        Want{AlgorithmKind::kLion, Precision::kFp32, 1},
                        Want{AlgorithmKind::kAdamW, Precision::kFp32, 1}}) {
    auto opt = CreateGroupOptimizer(*dev_, Base(w.kind, w.precision), shapes);
    ASSERT_THAT(opt.status(), IsOk());
    std::vector<Buffer> x, g;
    std::vector<float*> xp;
    std::vector<const float*> gp;
    for (size_t i = 0; i < shapes.size(); ++i) {
      x.push_back(Upload(RandomVector(static_cast<size_t>(Numel(shapes[i])), 1)));
      g.push_back(Upload(RandomVector(static_cast<size_t>(Numel(shapes[i])), 2)));
      xp.push_back(x.back().As<float>());
      gp.push_back(g.back().As<float>());
    }
    for (int step = 1; step <= 2; ++step) {
      const int64_t before = kernels::testing::GetHostTestDeviceCounters().syncs;
      ASSERT_THAT((*opt)->Step(*dev_, xp, gp), IsOk());
      EXPECT_EQ(kernels::testing::GetHostTestDeviceCounters().syncs - before, w.syncs)
          << AlgorithmName(w.kind) << " " << PrecisionName(w.precision) << " step " << step;
    }
  }
}

// WriteStagedParamsDeferringNorm: the Σ(Δx)² read-back is queued, not waited for; after the
// caller's one wait, FinishStagedNorm gives the same norm (and the same parameters and state)
// as WriteStagedParams, bit for bit, with one sync point less.
TEST_F(StrictDevice, ADeferredNormIsTheSameNormWithoutItsWait) {
  for (AlgorithmKind kind : {AlgorithmKind::kMuon, AlgorithmKind::kAdamW}) {
    GroupConfig c = Base(kind, Precision::kFp32);
    const std::vector<ParamShape> shapes = {{16, 24}, {16, 24}, {8, 8}};
    auto a = CreateGroupOptimizer(*dev_, c, shapes);
    auto b = CreateGroupOptimizer(*dev_, c, shapes);
    ASSERT_THAT(a.status(), IsOk());
    ASSERT_THAT(b.status(), IsOk());
    std::vector<Buffer> xa, xb, g;
    std::vector<float*> pa, pb;
    std::vector<const float*> gp;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto v = RandomVector(static_cast<size_t>(Numel(shapes[i])), 30 + i);
      xa.push_back(Upload(v));
      xb.push_back(Upload(v));
      g.push_back(Upload(RandomVector(static_cast<size_t>(Numel(shapes[i])), 40 + i)));
      pa.push_back(xa.back().As<float>());
      pb.push_back(xb.back().As<float>());
      gp.push_back(g.back().As<float>());
    }
    for (int step = 1; step <= 3; ++step) {
      ASSERT_THAT((*a)->Stage(*dev_, pa, gp), IsOk());
      int64_t before = kernels::testing::GetHostTestDeviceCounters().syncs;
      (*a)->WriteStagedParams(pa);
      const int64_t eager_syncs = kernels::testing::GetHostTestDeviceCounters().syncs - before;
      (*a)->CommitStagedState();
      ASSERT_THAT((*b)->Stage(*dev_, pb, gp), IsOk());
      before = kernels::testing::GetHostTestDeviceCounters().syncs;
      (*b)->WriteStagedParamsDeferringNorm(pb);
      EXPECT_EQ(kernels::testing::GetHostTestDeviceCounters().syncs - before, 0)
          << AlgorithmName(kind) << " step " << step << ": the read-back is only queued";
      EXPECT_EQ(eager_syncs, 1) << AlgorithmName(kind);
      ASSERT_THAT(kernels::Synchronize(*dev_), IsOk());
      (*b)->FinishStagedNorm();
      EXPECT_EQ((*b)->staged_update_norm(), (*a)->last_update_norm()) << AlgorithmName(kind);
      (*b)->CommitStagedState();
      EXPECT_EQ((*b)->last_update_norm(), (*a)->last_update_norm());
      EXPECT_GT((*b)->last_update_norm(), 0.0);
      for (size_t i = 0; i < shapes.size(); ++i) {
        EXPECT_TRUE(SameBits(Download(xb[i]), Download(xa[i])))
            << AlgorithmName(kind) << " step " << step << " parameter " << i;
      }
    }
  }
}

// Dion judges each matrix's momentum all-zero from one read-back per bucket (the matrices' L1
// norms in one copy), not one per matrix: with Householder QR (no Cholesky branches) a step has
// two sync points whatever the bucket size, the all-zero flags and the update norms
// (docs/GPU.md, "Sync points"). A bucket with all-zero matrices (zero gradient, zero momentum)
// next to non-zero ones gives the CPU's numbers bit for bit.
TEST_F(StrictDevice, DionReadsTheAllZeroFlagsBackOncePerBucket) {
  for (int64_t matrices : {1, 3, 6}) {
    GroupConfig c = Base(AlgorithmKind::kDion, Precision::kFp32);
    c.hyperparams.rank_fraction = 0.5;
    c.hyperparams.qr_method = QrMethod::kQr;
    const std::vector<ParamShape> shapes(static_cast<size_t>(matrices), ParamShape{24, 40});
    auto d = CreateGroupOptimizer(*dev_, c, shapes);
    auto h = CreateGroupOptimizer(*cpu_, c, shapes);
    ASSERT_THAT(d.status(), IsOk());
    ASSERT_THAT(h.status(), IsOk());
    std::vector<Buffer> dx, dg;
    std::vector<std::vector<float>> hx, hg;
    std::vector<float*> dxp, hxp;
    std::vector<const float*> dgp, hgp;
    for (int64_t i = 0; i < matrices; ++i) {
      hx.push_back(RandomVector(24 * 40, static_cast<uint32_t>(10 + i)));
      // Every other matrix has a zero gradient (so a zero momentum at the first step).
      hg.push_back(i % 2 == 1 ? std::vector<float>(24 * 40, 0.0f)
                              : RandomVector(24 * 40, static_cast<uint32_t>(50 + i)));
    }
    for (int64_t i = 0; i < matrices; ++i) {
      dx.push_back(Upload(hx[static_cast<size_t>(i)]));
      dg.push_back(Upload(hg[static_cast<size_t>(i)]));
    }
    for (int64_t i = 0; i < matrices; ++i) {
      dxp.push_back(dx[static_cast<size_t>(i)].As<float>());
      dgp.push_back(dg[static_cast<size_t>(i)].As<float>());
      hxp.push_back(hx[static_cast<size_t>(i)].data());
      hgp.push_back(hg[static_cast<size_t>(i)].data());
    }
    for (int step = 1; step <= 2; ++step) {
      const int64_t before = kernels::testing::GetHostTestDeviceCounters().syncs;
      ASSERT_THAT((*d)->Step(*dev_, dxp, dgp), IsOk());
      EXPECT_EQ(kernels::testing::GetHostTestDeviceCounters().syncs - before, 2)
          << matrices << " matrices, step " << step;
      ASSERT_THAT((*h)->Step(*cpu_, hxp, hgp), IsOk());
      for (int64_t i = 0; i < matrices; ++i) {
        EXPECT_TRUE(SameBits(Download(dx[static_cast<size_t>(i)]), hx[static_cast<size_t>(i)]))
            << matrices << " matrices, step " << step << ", matrix " << i;
      }
    }
  }
}

// ---- state access, release and captured updates on the device --------------------------------

TEST_F(StrictDevice, StateAccessNeedsTheDeviceContext) {
  GroupConfig c = Base(AlgorithmKind::kAdamW, Precision::kFp32);
  auto opt = CreateGroupOptimizer(*dev_, c, {{4, 4}, {3}});
  ASSERT_THAT(opt.status(), IsOk());
  std::vector<float> m(16);
  EXPECT_THAT((*opt)->GetState(0, kStateMomentum, absl::MakeSpan(m)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("Context")));
  EXPECT_THAT((*opt)->GetState(*cpu_, 0, kStateMomentum, absl::MakeSpan(m)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  EXPECT_THAT((*opt)->ReleaseState({true, false}), StatusIs(absl::StatusCode::kFailedPrecondition));
  const std::vector<float> set = RandomVector(16, 3);
  ASSERT_THAT((*opt)->SetState(*dev_, 0, kStateMomentum, set), IsOk());
  ASSERT_THAT((*opt)->GetState(*dev_, 0, kStateMomentum, absl::MakeSpan(m)), IsOk());
  EXPECT_EQ(m, set);
  // Release parameter 1; parameter 0 keeps its state (copied on the device).
  ASSERT_THAT((*opt)->ReleaseState(*dev_, {true, false}), IsOk());
  EXPECT_TRUE((*opt)->StateReleased(1));
  ASSERT_THAT((*opt)->GetState(*dev_, 0, kStateMomentum, absl::MakeSpan(m)), IsOk());
  EXPECT_EQ(m, set);
  float step_dev = -1.0f;
  ASSERT_THAT((*opt)->GetState(*dev_, 0, kStateStepDev, absl::MakeSpan(&step_dev, 1)), IsOk());
  EXPECT_EQ(step_dev, 0.0f);
  Buffer x = Upload(RandomVector(16, 4)), g = Upload(RandomVector(16, 5));
  float* xp[] = {x.As<float>(), nullptr};
  const float* gp[] = {g.As<float>(), nullptr};
  ASSERT_THAT((*opt)->Step(*dev_, xp, gp), IsOk());
  ASSERT_THAT((*opt)->GetState(*dev_, 0, kStateStepDev, absl::MakeSpan(&step_dev, 1)), IsOk());
  EXPECT_EQ(step_dev, 1.0f);
  EXPECT_EQ((*opt)->StateFloats(), 16 + 16 + 1);
}

// AdamW's step count is advanced on the device and mirrored on the host: SetState, a discarded
// stage and a released parameter must leave both in step, so the bias corrections (which depend
// on the count) give the CPU's bits.
TEST_F(StrictDevice, AdamWStepCountFollowsSetStateDiscardAndRelease) {
  GroupConfig c = Base(AlgorithmKind::kAdamW, Precision::kFp32);
  const std::vector<ParamShape> shapes = {{6, 5}, {6, 5}, {4}};
  auto d = CreateGroupOptimizer(*dev_, c, shapes);
  auto h = CreateGroupOptimizer(*cpu_, c, shapes);
  ASSERT_THAT(d.status(), IsOk());
  ASSERT_THAT(h.status(), IsOk());
  std::vector<std::vector<float>> hx, hg;
  std::vector<Buffer> dx, dg;
  for (size_t i = 0; i < shapes.size(); ++i) {
    hx.push_back(
        RandomVector(static_cast<size_t>(Numel(shapes[i])), 20 + static_cast<uint32_t>(i)));
    hg.push_back(RandomVector(hx.back().size(), 30 + static_cast<uint32_t>(i)));
    dx.push_back(Upload(hx.back()));
    dg.push_back(Upload(hg.back()));
  }
  auto pointers = [&](std::vector<float*>* dp, std::vector<const float*>* dgp,
                      std::vector<float*>* hp, std::vector<const float*>* hgp) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const bool released = (*d)->StateReleased(i);
      dp->push_back(dx[i].As<float>());
      hp->push_back(hx[i].data());
      dgp->push_back(released ? nullptr : dg[i].As<float>());
      hgp->push_back(released ? nullptr : hg[i].data());
    }
  };
  // The independent expectation for parameter 1: the AdamW op itself at steps 8 and 9.
  std::vector<float> want1 = hx[1], m1(want1.size(), 0.0f), v1(want1.size(), 0.0f);
  for (int64_t step : {8, 9}) {
    kernels::AdamWParams ap;
    ap.lr = static_cast<float>(c.hyperparams.lr);
    ap.beta1 = static_cast<float>(c.hyperparams.beta1);
    ap.beta2 = static_cast<float>(c.hyperparams.beta2);
    ap.epsilon = static_cast<float>(c.hyperparams.epsilon);
    ap.weight_decay = static_cast<float>(c.hyperparams.weight_decay);
    ap.step = step;
    const int64_t n = static_cast<int64_t>(want1.size());
    ASSERT_THAT(
        kernels::AdamWStep(*cpu_, ap, kernels::MakeView(hg[1].data(), {n}),
                           kernels::MakeView(want1.data(), {n}), kernels::MakeView(m1.data(), {n}),
                           kernels::MakeView(v1.data(), {n})),
        IsOk());
  }
  const float seven = 7.0f;
  ASSERT_THAT((*d)->SetState(*dev_, 1, kStateStepDev, absl::MakeConstSpan(&seven, 1)), IsOk());
  ASSERT_THAT((*h)->SetState(1, kStateStepDev, absl::MakeConstSpan(&seven, 1)), IsOk());
  {
    std::vector<float*> dp, hp;
    std::vector<const float*> dgp, hgp;
    pointers(&dp, &dgp, &hp, &hgp);
    // A staged step that is dropped: nothing advances.
    ASSERT_THAT((*d)->Stage(*dev_, dp, dgp), IsOk());
    (*d)->DiscardStagedStep();
    for (int step = 0; step < 2; ++step) {
      ASSERT_THAT((*d)->Step(*dev_, dp, dgp), IsOk());
      ASSERT_THAT((*h)->Step(*cpu_, hp, hgp), IsOk());
    }
  }
  ASSERT_THAT((*d)->ReleaseState(*dev_, {true, false, true}), IsOk());
  ASSERT_THAT((*h)->ReleaseState({true, false, true}), IsOk());
  {
    std::vector<float*> dp, hp;
    std::vector<const float*> dgp, hgp;
    pointers(&dp, &dgp, &hp, &hgp);
    ASSERT_THAT((*d)->Step(*dev_, dp, dgp), IsOk());
    ASSERT_THAT((*h)->Step(*cpu_, hp, hgp), IsOk());
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(SameBits(Download(dx[i]), hx[i])) << "param " << i;
  }
  EXPECT_TRUE(SameBits(Download(dx[1]), want1)) << "param 1 stepped at 8 and 9";
  for (size_t i : {size_t{0}, size_t{2}}) {
    float ds = 0, hs = 0;
    ASSERT_THAT((*d)->GetState(*dev_, i, kStateStepDev, absl::MakeSpan(&ds, 1)), IsOk());
    ASSERT_THAT((*h)->GetState(i, kStateStepDev, absl::MakeSpan(&hs, 1)), IsOk());
    EXPECT_EQ(ds, hs);
    EXPECT_EQ(ds, 3.0f);
  }
}

TEST_F(StrictDevice, DionInitialQIsTheCpuOne) {
  GroupConfig c = Base(AlgorithmKind::kDion, Precision::kFp32);
  c.hyperparams.rank_fraction = 0.5;
  auto d = CreateGroupOptimizer(*dev_, c, {{16, 24}});
  auto h = CreateGroupOptimizer(*cpu_, c, {{16, 24}});
  ASSERT_THAT(d.status(), IsOk());
  ASSERT_THAT(h.status(), IsOk());
  auto shape = (*d)->StateShape(0, kStateQ);
  ASSERT_THAT(shape.status(), IsOk());
  std::vector<float> dq(static_cast<size_t>(Numel(*shape))), hq(dq.size());
  ASSERT_THAT((*d)->GetState(*dev_, 0, kStateQ, absl::MakeSpan(dq)), IsOk());
  ASSERT_THAT((*h)->GetState(0, kStateQ, absl::MakeSpan(hq)), IsOk());
  EXPECT_TRUE(SameBits(dq, hq));
  EXPECT_NE(hq, std::vector<float>(hq.size(), 0.0f));
}

TEST_F(StrictDevice, CapturedUpdatesApplyOnTheDevice) {
  for (AlgorithmKind k : {AlgorithmKind::kDion, AlgorithmKind::kDion2, AlgorithmKind::kNorDion2}) {
    GroupConfig c = Base(k, Precision::kFp32);
    c.hyperparams.rank_fraction = 0.25;
    const ParamShape shape = {64, 48};
    ASSERT_GT(CapturedUpdateSize(c, shape), 0);
    auto owner = CreateGroupOptimizer(*cpu_, c, {shape});
    ASSERT_THAT(owner.status(), IsOk());
    std::vector<float> x = RandomVector(64 * 48, 9), g = RandomVector(64 * 48, 10);
    const std::vector<float> before = x;
    StepCapture cap;
    StepOptions o;
    o.capture = &cap;
    float* xp[] = {x.data()};
    const float* gp[] = {g.data()};
    ASSERT_THAT((*owner)->Step(*cpu_, xp, gp, o), IsOk());
    // A non-owner on the device reproduces the owner's step from the payload.
    Buffer dx = Upload(before);
    ASSERT_THAT(ApplyCapturedUpdate(*dev_, c, shape, {}, cap.payload[0], dx.As<float>()), IsOk());
    EXPECT_TRUE(SameBits(Download(dx), x)) << AlgorithmName(k);
  }
}

}  // namespace
}  // namespace diond::optim
