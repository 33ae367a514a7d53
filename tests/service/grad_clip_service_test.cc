// The daemon-side global-norm gradient clip (StepRequest.max_grad_norm; docs/DATA_PLANE.md
// "Gradient clip") against the real daemon over POSIX shared memory. The reference is computed
// here: the norm in double over the gradients the step reads, coef = max / (norm + 1e-6), and a
// session without the clip given the gradients already multiplied by (float)coef.
//  - Muon, AdamW, Dion2 (and an AdamW vector group beside each): 3 steps, the clip engaged,
//    not engaged, and engaged over a gradient_scale, give the reference's weights, state and
//    update norms bit for bit, and grad_norm the norm computed here;
//  - params_without_grad are not in the norm (their gradient bytes are huge here);
//  - an overlapped step with the clip equals the synchronous step with it, bit for bit;
//  - a max_grad_norm that is NaN, negative or infinite is INVALID_ARGUMENT and changes nothing;
//    a world of one (REPLICATED, AVERAGE) clips as a local session does (worlds of two:
//    tests/world/world_clip_test.cc);
//  - a device session (TEST device) clips by the device's norms: the same checks, grad_norm
//    within 1e-6, synchronous and overlapped (over CUDA regions:
//    tests/service/overlap_device_service_test.cc);
//  - a NaN gradient under SKIP and ERROR behaves as without the clip.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;
using optim::AlgorithmKind;

struct StepArgs {
  double max_grad_norm = 0;
  double gradient_scale = 0;
  std::vector<int32_t> without;
  bool asynchronous = false;
  bool overlap = false;
};
StepArgs Clip(double max) {
  StepArgs a;
  a.max_grad_norm = max;
  return a;
}
StepArgs Without(double max, std::vector<int32_t> without) {
  StepArgs a = Clip(max);
  a.without = std::move(without);
  return a;
}

grpc::Status ClipStep(v1::Optimizer::Stub& stub, const std::string& id, int64_t t,
                      const StepArgs& a, v1::StepResponse* resp) {
  v1::StepRequest req;
  req.set_session_id(id);
  req.set_step_index(t);
  req.set_max_grad_norm(a.max_grad_norm);
  req.set_gradient_scale(a.gradient_scale);
  for (int32_t i : a.without) req.add_params_without_grad(i);
  req.set_asynchronous(a.asynchronous);
  req.set_overlap(a.overlap);
  return stub.Step(Ctx().get(), req, resp);
}

using GradSet = std::vector<std::vector<float>>;

// The total L2 norm of `g` without the parameters in `without`, summed in double element by
// element (an order of its own, not the daemon's).
double Norm(const GradSet& g, const std::vector<int32_t>& without = {}) {
  double s = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    bool skip = false;
    for (int32_t w : without) skip = skip || static_cast<size_t>(w) == i;
    if (skip) continue;
    for (float v : g[i]) s += static_cast<double>(v) * static_cast<double>(v);
  }
  return std::sqrt(s);
}

// torch's clip_grad_norm_: every gradient times (float)(max / (norm + 1e-6)) when that is < 1.
GradSet Clipped(const GradSet& g, double max, double norm) {
  const double coef = max / (norm + 1e-6);
  if (coef >= 1.0) return g;
  const float c = static_cast<float>(coef);
  GradSet out = g;
  for (auto& t : out) {
    for (float& v : t) v *= c;
  }
  return out;
}

GradSet Times(const GradSet& g, float f) {
  GradSet out = g;
  for (auto& t : out) {
    for (float& v : t) v *= f;
  }
  return out;
}

void ExpectNear12(double got, double want) {
  EXPECT_NEAR(got, want, 1e-12 * want) << "grad_norm";
  EXPECT_GT(got, 0.0);
}

class GradClip : public Overlap {
 protected:
  // Two sessions of `d` with the same initial weights: clip_ steps with the clip, ref_ without.
  void NewSessions(const SessionDesc& d) {
    clip_ = CreateShmSession(stub(), d.Request());
    ref_ = CreateShmSession(stub(), d.Request());
    ASSERT_NE(clip_, nullptr);
    ASSERT_NE(ref_, nullptr);
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::string w = FloatBytes(SyntheticValues(1, 0, i, d.Numel(i)));
      clip_->params_seg->Write(clip_->tensor(i).param_offset_bytes(), w);
      ref_->params_seg->Write(ref_->tensor(i).param_offset_bytes(), w);
    }
  }
  void ExpectSame(const v1::StepResponse& got, const v1::StepResponse& want) {
    ExpectSameResult(got, want);
    EXPECT_TRUE(Arena(*clip_) == Arena(*ref_)) << "the weights differ";
    EXPECT_TRUE(State(clip_->id) == State(ref_->id)) << "the state differs";
  }
  void CloseSessions() {
    EXPECT_TRUE(CloseSession(stub(), clip_->id).ok());
    EXPECT_TRUE(CloseSession(stub(), ref_->id).ok());
  }
  // Step 1 engaged, step 2 not (max above the norm), step 3 engaged over gradient_scale 0.5
  // (the gradients scaled, then clipped): grad_norm within `tolerance` of the norm here, and
  // the weights, state and update norms those of a session given the gradients clipped here
  // (by the norm here, or with `own_norm` by the daemon's grad_norm), bit for bit.
  void EqualsPreClipped(AlgorithmKind a, double tolerance, bool own_norm);
  // An overlapped step with the clip equals the synchronous one (grad_norm bit for bit, and
  // within `tolerance` of the norm computed here), over 4 steps.
  void OverlapEqualsSync(AlgorithmKind a, double tolerance);
  std::unique_ptr<ShmSession> clip_, ref_;
};

class GradClipAlgorithms : public GradClip, public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(GradClipAlgorithms, EqualsASessionGivenPreClippedGradients) {
  EqualsPreClipped(GetParam(), 1e-12, /*own_norm=*/false);
}

void GradClip::EqualsPreClipped(AlgorithmKind a, double tolerance, bool own_norm) {
  const SessionDesc d = Desc(a);
  NewSessions(d);
  const double factor[] = {0.25, 4.0, 0.5};
  for (int64_t t = 1; t <= 3; ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t);
    const GradSet g = Times(Grads(d, t), static_cast<float>(t));
    const GradSet read = t == 3 ? Times(g, 0.5f) : g;  // gradient_scale 0.5: exact
    const double norm = Norm(read);
    const double max = factor[t - 1] * norm;
    for (size_t i = 0; i < g.size(); ++i) clip_->WriteGrad(i, g[i]);
    v1::StepResponse got, want;
    StepArgs with = Clip(max);
    with.gradient_scale = t == 3 ? 0.5 : 0.0;
    grpc::Status s = ClipStep(stub(), clip_->id, t, with, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_NEAR(got.grad_norm(), norm, tolerance * norm);
    const GradSet ref = Clipped(read, max, own_norm ? got.grad_norm() : norm);
    if (t == 2) {
      EXPECT_EQ(ref, read);  // not engaged
    }
    for (size_t i = 0; i < g.size(); ++i) ref_->WriteGrad(i, ref[i]);
    ASSERT_TRUE(ClipStep(stub(), ref_->id, t, {}, &want).ok());
    EXPECT_EQ(want.grad_norm(), 0.0);  // no clip asked: none reported
    ExpectSame(got, want);
  }
  CloseSessions();
}

INSTANTIATE_TEST_SUITE_P(Algorithms, GradClipAlgorithms,
                         ::testing::Values(AlgorithmKind::kMuon, AlgorithmKind::kAdamW,
                                           AlgorithmKind::kDion2),
                         [](const auto& info) {
                           return std::string(optim::AlgorithmName(info.param));
                         });

TEST_F(GradClip, ParamsWithoutGradAreNotInTheNorm) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  NewSessions(d);
  const std::vector<int32_t> without = {1, 2};
  for (int64_t t = 1; t <= 2; ++t) {
    GradSet g = Grads(d, t);
    for (int32_t w : without) {
      for (float& v : g[static_cast<size_t>(w)]) v = 1e4f;  // would dominate the norm
    }
    const double norm = Norm(g, without);
    const double max = 0.3 * norm;
    const GradSet ref = Clipped(g, max, norm);
    for (size_t i = 0; i < g.size(); ++i) {
      clip_->WriteGrad(i, g[i]);
      ref_->WriteGrad(i, ref[i]);
    }
    v1::StepResponse got, want;
    ASSERT_TRUE(ClipStep(stub(), clip_->id, t, Without(max, without), &got).ok());
    ASSERT_TRUE(ClipStep(stub(), ref_->id, t, Without(0, without), &want).ok());
    ExpectNear12(got.grad_norm(), norm);
    ExpectSame(got, want);
  }
  CloseSessions();
}

class GradClipOverlap : public GradClip, public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(GradClipOverlap, EqualsTheSynchronousStepWithTheClip) {
  OverlapEqualsSync(GetParam(), 1e-12);
}

void GradClip::OverlapEqualsSync(AlgorithmKind a, double tolerance) {
  const SessionDesc d = Desc(a);
  NewPair(d);
  const double factor[] = {0.2, 3.0, 0.6, 0.5};
  for (int64_t t = 1; t <= 4; ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t);
    GradSet g = Times(Grads(d, t), static_cast<float>(t));
    if (t == 4) {
      // w4's squares sum to 144; each other parameter's to about 0.2 ulp(144). Summed in the
      // parameters' order the small ones add up to more than half an ulp before 144 comes;
      // in this step's ringing order (w2, w3, w4, ...) each is lost against 144 alone.
      for (size_t i = 0; i < g.size(); ++i) {
        const double q = 0.2 * std::ldexp(1.0, -45);
        const float c =
            i == 4 ? 1.0f : static_cast<float>(std::sqrt(q / static_cast<double>(g[i].size())));
        for (float& v : g[i]) v = c;
      }
    }
    const double max = factor[t - 1] * Norm(g);
    for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, g[i]);
    v1::StepResponse want, queued, got;
    ASSERT_TRUE(ClipStep(stub(), sync_->id, t, Clip(max), &want).ok());
    StepArgs overlapped = Clip(max);
    overlapped.asynchronous = overlapped.overlap = true;
    grpc::Status q = ClipStep(stub(), ov_->id, t, overlapped, &queued);
    ASSERT_TRUE(q.ok()) << q.error_message();
    EXPECT_TRUE(queued.queued());
    Backward(t, g, RingOrder(t));
    grpc::Status w = WaitStep(stub(), ov_->id, &got);
    ASSERT_TRUE(w.ok()) << w.error_message();
    ExpectSameResult(got, want);
    EXPECT_EQ(got.grad_norm(), want.grad_norm());  // bit for bit
    EXPECT_NEAR(got.grad_norm(), Norm(g), tolerance * Norm(g));
    ExpectSameSessions();
    EXPECT_TRUE(bells_.AwaitWeights(static_cast<int>(kBuckets.size()), t));
  }
  CloseBoth();
}

INSTANTIATE_TEST_SUITE_P(Algorithms, GradClipOverlap,
                         ::testing::Values(AlgorithmKind::kMuon, AlgorithmKind::kAdamW,
                                           AlgorithmKind::kDion2),
                         [](const auto& info) {
                           return std::string(optim::AlgorithmName(info.param));
                         });

TEST_F(GradClip, BadMaxGradNormIsRefusedWithNothingChanged) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  NewSessions(d);
  const GradSet g = Grads(d, 1);
  for (size_t i = 0; i < g.size(); ++i) {
    clip_->WriteGrad(i, g[i]);
    ref_->WriteGrad(i, g[i]);
  }
  const std::string arena = Arena(*clip_);
  const TensorMap state = State(clip_->id);
  const double bad[] = {std::nan(""), -1.0, std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity(), -1e-300};
  for (double b : bad) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "max_grad_norm " << b << ", asynchronous " << async);
      v1::StepResponse resp;
      StepArgs a = Clip(b);
      a.asynchronous = async;
      grpc::Status s = ClipStep(stub(), clip_->id, 1, a, &resp);
      EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_TRUE(absl::StrContains(s.error_message(), "max_grad_norm")) << s.error_message();
    }
  }
  EXPECT_TRUE(Arena(*clip_) == arena);
  EXPECT_TRUE(State(clip_->id) == state);
  // Step 1 is still the next step, and max_grad_norm 0 is no clip.
  v1::StepResponse got, want;
  ASSERT_TRUE(ClipStep(stub(), clip_->id, 1, Clip(0), &got).ok());
  ASSERT_TRUE(ClipStep(stub(), ref_->id, 1, {}, &want).ok());
  EXPECT_EQ(got.grad_norm(), 0.0);
  ExpectSame(got, want);
  CloseSessions();
}

TEST_F(GradClip, AWorldOfOneClipsAsALocalSession) {
  for (v1::GradientSync sync : {v1::GRADIENT_SYNC_REPLICATED, v1::GRADIENT_SYNC_AVERAGE}) {
    SCOPED_TRACE(v1::GradientSync_Name(sync));
    const SessionDesc d = Desc(AlgorithmKind::kMuon);
    v1::CreateSessionRequest req = d.Request();
    req.set_world_key(absl::StrCat("grad-clip-world-of-one-", sync));
    req.set_gradient_sync(sync);
    NewSessions(d);
    auto w = CreateShmSession(stub(), req);
    ASSERT_NE(w, nullptr);
    for (size_t i = 0; i < d.params.size(); ++i) {
      w->params_seg->Write(w->tensor(i).param_offset_bytes(),
                           FloatBytes(SyntheticValues(1, 0, i, d.Numel(i))));
    }
    for (int64_t t = 1; t <= 2; ++t) {
      const GradSet g = Times(Grads(d, t), 4.0f);
      for (size_t i = 0; i < g.size(); ++i) {
        w->WriteGrad(i, g[i]);
        clip_->WriteGrad(i, g[i]);
      }
      v1::StepResponse got, want;
      ASSERT_TRUE(ClipStep(stub(), w->id, t, Clip(1.0), &got).ok());
      ASSERT_TRUE(ClipStep(stub(), clip_->id, t, Clip(1.0), &want).ok());
      EXPECT_GT(want.grad_norm(), 1.0);
      EXPECT_EQ(got.grad_norm(), want.grad_norm());
      EXPECT_TRUE(Arena(*w) == Arena(*clip_)) << "the weights differ";
    }
    EXPECT_TRUE(CloseSession(stub(), w->id).ok());
    CloseSessions();
  }
}

// A device daemon (diond_testdevice: the TEST backend; sessions over shm). The norms are the
// device's, each gradient's f32 FrobeniusNorm: grad_norm is within 1e-6 of the norm in double
// here, and the weights, state and update norms equal those of a device session given the
// gradients already multiplied by (float)coef of the daemon's own grad_norm, bit for bit.
class GradClipDevice : public GradClip, public ::testing::WithParamInterface<AlgorithmKind> {
 protected:
  static void SetUpTestSuite() {
    daemon_ = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY,
                                  {"--compute_threads=1", "--overlap_bucket_timeout=60s"})
                  .release();
  }
};

TEST_P(GradClipDevice, EqualsASessionGivenTheGradientsItClipped) {
  EqualsPreClipped(GetParam(), 1e-6, /*own_norm=*/true);
}

TEST_P(GradClipDevice, AnOverlappedStepEqualsTheSynchronousOne) {
  OverlapEqualsSync(GetParam(), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Algorithms, GradClipDevice,
                         ::testing::Values(AlgorithmKind::kMuon, AlgorithmKind::kAdamW,
                                           AlgorithmKind::kDion2),
                         [](const auto& info) {
                           return std::string(optim::AlgorithmName(info.param));
                         });

// A NaN in one gradient: the total is NaN, and the non-finite policy decides as without the
// clip (SKIP: nothing changes; ERROR: the same error, nothing changes, a retry applies).
TEST_F(GradClip, ANanGradientBehavesAsWithoutTheClip) {
  for (v1::NonFinitePolicy p : {v1::NON_FINITE_POLICY_SKIP, v1::NON_FINITE_POLICY_ERROR}) {
    SCOPED_TRACE(v1::NonFinitePolicy_Name(p));
    const SessionDesc d = Desc(AlgorithmKind::kMuon, p);
    NewSessions(d);
    GradSet g = Grads(d, 1);
    g[3][5] = std::nanf("");
    for (size_t i = 0; i < g.size(); ++i) {
      clip_->WriteGrad(i, g[i]);
      ref_->WriteGrad(i, g[i]);
    }
    const std::string arena = Arena(*clip_);
    const TensorMap state = State(clip_->id);
    v1::StepResponse got, want;
    grpc::Status s = ClipStep(stub(), clip_->id, 1, Clip(1.0), &got);
    grpc::Status r = ClipStep(stub(), ref_->id, 1, {}, &want);
    EXPECT_EQ(s.error_code(), r.error_code());
    EXPECT_EQ(s.error_message(), r.error_message());
    if (p == v1::NON_FINITE_POLICY_SKIP) {
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_TRUE(got.skipped());
      EXPECT_TRUE(std::isnan(got.grad_norm())) << got.grad_norm();
    } else {
      EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << s.error_message();
    }
    EXPECT_TRUE(Arena(*clip_) == arena);
    EXPECT_TRUE(State(clip_->id) == state);
    if (p == v1::NON_FINITE_POLICY_ERROR) {
      // The finite retry of step 1 applies, clipped.
      g[3][5] = 0.5f;
      const double norm = Norm(g);
      const GradSet ref = Clipped(g, 0.5 * norm, norm);
      for (size_t i = 0; i < g.size(); ++i) {
        clip_->WriteGrad(i, g[i]);
        ref_->WriteGrad(i, ref[i]);
      }
      ASSERT_TRUE(ClipStep(stub(), clip_->id, 1, Clip(0.5 * norm), &got).ok());
      ASSERT_TRUE(ClipStep(stub(), ref_->id, 1, {}, &want).ok());
      ExpectNear12(got.grad_norm(), norm);
      ExpectSame(got, want);
    }
    CloseSessions();
  }
}

}  // namespace
}  // namespace diond::service_testing
