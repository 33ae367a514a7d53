// Dion's qr_method (ALGORITHMS.md §9.4 step 6, §10): which orthonormalization of P the rule runs
// at each step. The parameter update does not reveal it (every branch yields the Q-factor of P
// up to column signs), so these tests look at the orthonormalized P itself, which a step reports
// through StepOptions::capture, and compare it bit for bit with the kernel each branch must use
// on the same input P = (M + G)·Q.
#include <cmath>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/optim/validation.h"

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using kernels::testing::RandomVector;  // N(0, 1) from a seed (kernels/cpu/test_util.h)
using ::testing::HasSubstr;

constexpr int64_t kM = 64, kN = 48;  // tall: P = M·Q is a×r = 64×12 at rank_fraction 0.25
constexpr int64_t kR = 12;

GroupConfig Dion(QrMethod method, int64_t warmup = 150) {
  GroupConfig cfg;
  cfg.algorithm = AlgorithmKind::kDion;
  cfg.hyperparams = DefaultHyperparams(AlgorithmKind::kDion);
  cfg.hyperparams.rank_fraction = 0.25;  // r = 12: the step has a compact form (P, Q_new)
  cfg.hyperparams.qr_method = method;
  cfg.hyperparams.cqr_warmup_steps = warmup;
  cfg.seed = 7;
  return cfg;
}

struct DionRun {
  std::unique_ptr<GroupOptimizer> opt;
  std::vector<float> x;
};

DionRun Make(const GroupConfig& cfg, const std::vector<float>* q0 = nullptr) {
  auto opt = CreateGroupOptimizer(cfg, {{kM, kN}});
  EXPECT_THAT(opt.status(), IsOk());
  DionRun r{std::move(*opt), RandomVector(kM * kN, 1)};
  if (q0 != nullptr) {
    EXPECT_THAT(r.opt->SetState(0, "Q", *q0), IsOk());
  }
  return r;
}

// P = (M + G)·Q from the optimizer's current state, computed as the rule computes it.
std::vector<float> PreQr(const kernels::Context& ctx, const GroupOptimizer& opt,
                         const std::vector<float>& g) {
  std::vector<float> m(kM * kN), q(kN * kR), p(kM * kR);
  EXPECT_THAT(opt.GetState(0, "momentum", absl::MakeSpan(m)), IsOk());
  EXPECT_THAT(opt.GetState(0, "Q", absl::MakeSpan(q)), IsOk());
  for (size_t i = 0; i < m.size(); ++i) m[i] = m[i] + g[i];
  EXPECT_THAT(kernels::Gemm(ctx, kernels::GemmParams{}, kernels::MakeView(m.data(), {1, kM, kN}),
                            kernels::MakeView(q.data(), {1, kN, kR}),
                            kernels::MakeView(p.data(), {1, kM, kR})),
              IsOk());
  return p;
}

// One step; returns the orthonormalized P the step used.
std::vector<float> StepP(const kernels::Context& ctx, DionRun* r, const std::vector<float>& g,
                         std::optional<int64_t> step = std::nullopt) {
  StepCapture cap;
  StepOptions o;
  o.capture = &cap;
  o.step = step;
  float* xp = r->x.data();
  const float* gp = g.data();
  EXPECT_THAT(r->opt->Step(ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1), o), IsOk());
  EXPECT_EQ(cap.payload.size(), 1u);
  if (cap.payload.empty()) return {};
  return std::vector<float>(cap.payload[0].begin(), cap.payload[0].begin() + kM * kR);
}

std::vector<float> Householder(const kernels::Context& ctx, const std::vector<float>& p) {
  std::vector<float> q(p.size());
  EXPECT_THAT(kernels::ThinQr(ctx, kernels::MakeView(p.data(), {kM, kR}),
                              kernels::MakeView(q.data(), {kM, kR})),
              IsOk());
  return q;
}

absl::StatusOr<std::vector<float>> Cholesky(const kernels::Context& ctx,
                                            const std::vector<float>& p) {
  std::vector<float> q(p.size());
  absl::Status s = kernels::CholeskyQr(ctx, kernels::MakeView(p.data(), {kM, kR}),
                                       kernels::MakeView(q.data(), {kM, kR}));
  if (!s.ok()) return s;
  return q;
}

// max |PᵀP − I| and max |P·Pᵀ − U·Uᵀ| for U the Householder Q-factor of `pre` (same span).
void ExpectOrthonormalBasisOf(const kernels::Context& ctx, const std::vector<float>& p,
                              const std::vector<float>& pre, double tol) {
  const std::vector<float> u = Householder(ctx, pre);
  double ortho = 0, span = 0;
  for (int64_t i = 0; i < kR; ++i) {
    for (int64_t j = 0; j < kR; ++j) {
      double d = 0;
      for (int64_t k = 0; k < kM; ++k) d += double(p[k * kR + i]) * p[k * kR + j];
      ortho = std::max(ortho, std::abs(d - (i == j ? 1.0 : 0.0)));
    }
  }
  for (int64_t i = 0; i < kM; ++i) {
    for (int64_t j = 0; j < kM; ++j) {
      double a = 0, b = 0;
      for (int64_t k = 0; k < kR; ++k) {
        a += double(p[i * kR + k]) * p[j * kR + k];
        b += double(u[i * kR + k]) * u[j * kR + k];
      }
      span = std::max(span, std::abs(a - b));
    }
  }
  EXPECT_LT(ortho, tol);
  EXPECT_LT(span, tol);
}

// An initial Q whose singular values spread over 5 decades: P = G·Q is then so ill-conditioned
// that the float32 Cholesky factorization of PᵀP fails (the reference's cqr fallback case).
std::vector<float> IllConditionedQ() {
  std::vector<float> a = RandomVector(kN * kR, 11), b = RandomVector(kR * kR, 12);
  std::vector<float> u(a.size()), v(b.size());
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  EXPECT_THAT(kernels::ThinQr(ctx, kernels::MakeView(a.data(), {kN, kR}),
                              kernels::MakeView(u.data(), {kN, kR})),
              IsOk());
  EXPECT_THAT(kernels::ThinQr(ctx, kernels::MakeView(b.data(), {kR, kR}),
                              kernels::MakeView(v.data(), {kR, kR})),
              IsOk());
  std::vector<float> q(kN * kR, 0.0f);
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t j = 0; j < kR; ++j) {
      double s = 0;
      for (int64_t k = 0; k < kR; ++k) {
        s += double(u[i * kR + k]) * std::pow(10.0, -5.0 * k / (kR - 1)) * v[j * kR + k];
      }
      q[i * kR + j] = static_cast<float>(7.0 * s);
    }
  }
  return q;
}

TEST(DionQrMethod, QrIsHouseholderQrAtEveryStep) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  DionRun r = Make(Dion(QrMethod::kQr));
  for (uint32_t t = 1; t <= 3; ++t) {
    const std::vector<float> g = RandomVector(kM * kN, 100 + t);
    const std::vector<float> pre = PreQr(ctx, *r.opt, g);
    EXPECT_EQ(StepP(ctx, &r, g), Householder(ctx, pre)) << "step " << t;
  }
}

TEST(DionQrMethod, RcqrIsTheRandomizedCholeskyQrAndHonoursTheOversampling) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  GroupConfig big = Dion(QrMethod::kRcqr);
  big.hyperparams.rcqr_oversample = 16.0;  // a sketch of 256 rows instead of 128
  DionRun r = Make(Dion(QrMethod::kRcqr)), r16 = Make(big);
  const std::vector<float> g = RandomVector(kM * kN, 101);
  const std::vector<float> pre = PreQr(ctx, *r.opt, g);
  const std::vector<float> p = StepP(ctx, &r, g), p16 = StepP(ctx, &r16, g);
  // Not the Householder or the Cholesky factor, and the sketch size matters...
  EXPECT_NE(p, Householder(ctx, pre));
  EXPECT_NE(p, *Cholesky(ctx, pre));
  EXPECT_NE(p, p16);
  // ...but an orthonormal basis of the same column space.
  ExpectOrthonormalBasisOf(ctx, p, pre, 1e-5);
  ExpectOrthonormalBasisOf(ctx, p16, pre, 1e-5);
}

TEST(DionQrMethod, CqrIsRcqrDuringTheWarmupThenCholeskyQr) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  DionRun cqr = Make(Dion(QrMethod::kCqr, /*warmup=*/2)), rcqr = Make(Dion(QrMethod::kRcqr));
  for (uint32_t t = 1; t <= 4; ++t) {
    const std::vector<float> g = RandomVector(kM * kN, 200 + t);
    const std::vector<float> pre = PreQr(ctx, *cqr.opt, g);
    const std::vector<float> p = StepP(ctx, &cqr, g);
    const std::vector<float> p_rcqr = StepP(ctx, &rcqr, g);
    absl::StatusOr<std::vector<float>> chol = Cholesky(ctx, pre);
    ASSERT_THAT(chol.status(), IsOk());
    if (t <= 2) {
      // The same sketch as the rcqr group (same seed, step and shape) and the same input at
      // step 1: the same bits; from step 2 on the inputs differ by rounding, so compare the
      // basis.
      if (t == 1) {
        EXPECT_EQ(p, p_rcqr);
      }
      EXPECT_NE(p, *chol) << "step " << t;
      ExpectOrthonormalBasisOf(ctx, p, pre, 1e-5);
    } else {
      EXPECT_EQ(p, *chol) << "step " << t;
    }
  }
}

TEST(DionQrMethod, TheWarmupCountsTheStepNumberThatTheCallerPasses) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  DionRun r = Make(Dion(QrMethod::kCqr, /*warmup=*/5));
  const std::vector<float> g = RandomVector(kM * kN, 301);
  const std::vector<float> pre = PreQr(ctx, *r.opt, g);
  // The first Step of this optimizer is step 6 of the run (e.g. a resumed session): past the
  // warm-up, so Cholesky QR.
  EXPECT_EQ(StepP(ctx, &r, g, /*step=*/6), *Cholesky(ctx, pre));
  StepOptions bad;
  bad.step = 0;
  float* xp = r.x.data();
  const float* gp = g.data();
  absl::Status s = r.opt->Step(ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1), bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("step number = 0"));
}

TEST(DionQrMethod, CqrFallsBackToRcqrWhenTheCholeskyFactorizationFails) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  const std::vector<float> q0 = IllConditionedQ();
  DionRun cqr = Make(Dion(QrMethod::kCqr, /*warmup=*/0), &q0);
  DionRun rcqr = Make(Dion(QrMethod::kRcqr), &q0);
  const std::vector<float> g = RandomVector(kM * kN, 401);
  const std::vector<float> pre = PreQr(ctx, *cqr.opt, g);
  // The premise: Cholesky QR fails on this P.
  ASSERT_EQ(Cholesky(ctx, pre).status().code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<float> p = StepP(ctx, &cqr, g);
  for (float v : p) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(p, StepP(ctx, &rcqr, g));  // the rcqr branch, same sketch
  EXPECT_NE(p, Householder(ctx, pre));
  ExpectOrthonormalBasisOf(ctx, p, pre, 1e-3);
}

TEST(DionQrMethod, SquarePUsesHouseholderQrUnderRcqrAndCholeskyQrUnderCqr) {
  auto ctx_ptr = kernels::Context::CpuDefault();
  const kernels::Context& ctx = *ctx_ptr;
  // 48x48 at rank 1.0: P is 48x48 (a == r).
  for (QrMethod m : {QrMethod::kRcqr, QrMethod::kCqr}) {
    GroupConfig cfg = Dion(m, /*warmup=*/0);
    cfg.hyperparams.rank_fraction = 1.0;
    auto opt = CreateGroupOptimizer(cfg, {{48, 48}});
    ASSERT_THAT(opt.status(), IsOk());
    std::vector<float> q(48 * 48), p(48 * 48), want(48 * 48);
    const std::vector<float> g = RandomVector(48 * 48, 501);
    ASSERT_THAT((*opt)->GetState(0, "Q", absl::MakeSpan(q)), IsOk());
    ASSERT_THAT(kernels::Gemm(ctx, kernels::GemmParams{}, kernels::MakeView(g.data(), {1, 48, 48}),
                              kernels::MakeView(q.data(), {1, 48, 48}),
                              kernels::MakeView(p.data(), {1, 48, 48})),
                IsOk());
    if (m == QrMethod::kRcqr) {
      ASSERT_THAT(kernels::ThinQr(ctx, kernels::MakeView(p.data(), {48, 48}),
                                  kernels::MakeView(want.data(), {48, 48})),
                  IsOk());
    } else {
      ASSERT_THAT(kernels::CholeskyQr(ctx, kernels::MakeView(p.data(), {48, 48}),
                                      kernels::MakeView(want.data(), {48, 48})),
                  IsOk());
    }
    // No compact form at full rank, so compare the new Q instead: the column-normalized Gᵀ·P,
    // determined bit for bit by P.
    std::vector<float> x = RandomVector(48 * 48, 1);
    float* xp = x.data();
    const float* gp = g.data();
    ASSERT_THAT((*opt)->Step(ctx, absl::MakeSpan(&xp, 1), absl::MakeSpan(&gp, 1)), IsOk());
    std::vector<float> q_new(48 * 48), r(48 * 48);
    ASSERT_THAT((*opt)->GetState(0, "Q", absl::MakeSpan(q_new)), IsOk());
    kernels::GemmParams gr;
    gr.trans_a = kernels::Trans::kYes;
    ASSERT_THAT(kernels::Gemm(ctx, gr, kernels::MakeView(g.data(), {1, 48, 48}),
                              kernels::MakeView(want.data(), {1, 48, 48}),
                              kernels::MakeView(r.data(), {1, 48, 48})),
                IsOk());
    std::vector<float> norms(48);
    ASSERT_THAT(
        kernels::AxisNorms(ctx, kernels::MakeView(r.data(), {1, 48, 48}), kernels::Axis::kCols,
                           kernels::NormType::kL2, kernels::MakeView(norms.data(), {48})),
        IsOk());
    const float eps = static_cast<float>(cfg.hyperparams.epsilon);
    for (int64_t i = 0; i < 48; ++i) {
      for (int64_t c = 0; c < 48; ++c) r[i * 48 + c] = r[i * 48 + c] / (norms[c] + eps);
    }
    EXPECT_EQ(q_new, r) << QrMethodName(m);
  }
}

TEST(DionQrMethod, ValidationNamesTheOption) {
  auto expect_bad = [](const GroupConfig& cfg, const ParamShape& shape, const char* what) {
    absl::Status s = ValidateGroup(cfg, {shape});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(s.message(), HasSubstr(what));
  };
  GroupConfig c = Dion(QrMethod::kRcqr);
  c.hyperparams.cqr_warmup_steps = -1;
  expect_bad(c, {kM, kN}, "cqr_warmup_steps = -1");
  for (double os : {0.0, -1.0, 17.0, std::nan("")}) {
    c = Dion(QrMethod::kRcqr);
    c.hyperparams.rcqr_oversample = os;
    expect_bad(c, {kM, kN}, "rcqr_oversample");
  }
  // 1024x512 at rank 1.0: r = 512, but oversample 0.1 gives a sketch of 128 rows.
  c = Dion(QrMethod::kCqr);
  c.hyperparams.rank_fraction = 1.0;
  c.hyperparams.rcqr_oversample = 0.1;
  expect_bad(c, {1024, 512}, "sketch of 128 rows");
  c.hyperparams.qr_method = QrMethod::kQr;  // no sketch needed
  EXPECT_THAT(ValidateGroup(c, {{1024, 512}}), IsOk());
  // The options belong to Dion only.
  for (AlgorithmKind k : {AlgorithmKind::kMuon, AlgorithmKind::kDion2, AlgorithmKind::kAdamW}) {
    GroupConfig o;
    o.algorithm = k;
    o.hyperparams = DefaultHyperparams(k);
    o.hyperparams.qr_method = QrMethod::kCqr;
    expect_bad(o, {kM, kN}, "qr_method = cqr");
    o.hyperparams = DefaultHyperparams(k);
    o.hyperparams.cqr_warmup_steps = 3;
    expect_bad(o, {kM, kN}, "cqr_warmup_steps");
    o.hyperparams = DefaultHyperparams(k);
    o.hyperparams.rcqr_oversample = 2.0;
    expect_bad(o, {kM, kN}, "rcqr_oversample");
  }
  EXPECT_EQ(*ParseQrMethod("cqr"), QrMethod::kCqr);
  EXPECT_EQ(*ParseQrMethod("qr"), QrMethod::kQr);
  EXPECT_EQ(*ParseQrMethod("rcqr"), QrMethod::kRcqr);
  EXPECT_THAT(ParseQrMethod("householder").status().message(), HasSubstr("'householder'"));
}

}  // namespace
}  // namespace diond::optim
