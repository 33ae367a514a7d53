// kernels::StepGraph (kernels/graph.h) driving GroupOptimizer::Stage on the TEST backend in strict
// mode, whose stream capture is emulated: a captured graph is the closures of the captured ops,
// with their arguments as they were given, and a launch queues them again. A device-side scalar
// record is read when the work runs. So a replay that used the scalars of the step it was
// captured in (instead of the record uploaded for this step) would compute other bits, and a
// signature that missed a changed pointer would write into the wrong buffers: both fail the
// bit-for-bit comparison with an eager twin below, stepped on another stream of the same device
// with a learning rate and weight decay that change every step.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/cpu/test_util.h"
#include "kernels/device_runtime.h"
#include "kernels/graph.h"
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
using kernels::StepGraph;
using kernels::testing::RandomVector;
using ::testing::HasSubstr;

constexpr Device kDev{DeviceType::kTest, 0};

kernels::GraphHooks TestHooks() {
  kernels::GraphHooks h;
  const kernels::DeviceRuntime& rt = kernels::DeviceRuntimeFor(kDev.type);
  h.begin_capture = rt.begin_capture;
  h.end_capture = rt.end_capture;
  h.launch = rt.launch_graph;
  h.destroy = rt.destroy_graph;
  return h;
}

int64_t Numel(const ParamShape& s) { return testing::Numel(s); }
::testing::AssertionResult SameBits(const std::vector<float>& got, const std::vector<float>& want) {
  return testing::SameBits(got, want, "graph", "eager");
}

// One side of the comparison: a stream context, an optimizer, device parameters and gradients
// (the same buffers every step: the gradients are overwritten in place, as a session's staging).
struct Side {
  std::unique_ptr<kernels::testing::HostTestStreamContext> sc;
  std::unique_ptr<GroupOptimizer> opt;
  std::vector<Buffer> x, g;
  Context& ctx() { return sc->ctx(); }

  void Init(const GroupConfig& cfg, const std::vector<ParamShape>& shapes) {
    auto sc_or = kernels::testing::HostTestStreamContext::Create(kDev);
    ASSERT_THAT(sc_or.status(), IsOk());
    sc = std::move(*sc_or);
    auto opt_or = CreateGroupOptimizer(ctx(), cfg, shapes);
    ASSERT_THAT(opt_or.status(), IsOk());
    opt = std::move(*opt_or);
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t n = Numel(shapes[i]);
      x.push_back(Upload(RandomVector(static_cast<size_t>(n), 100 + static_cast<int>(i))));
      g.push_back(Upload(std::vector<float>(static_cast<size_t>(n), 0.0f)));
    }
  }
  Buffer Upload(const std::vector<float>& v) {
    auto b = ctx().Allocate(kernels::DType::kF32, {static_cast<int64_t>(v.size())});
    EXPECT_THAT(b.status(), IsOk());
    Write(v, *b);
    return std::move(*b);
  }
  void Write(const std::vector<float>& v, Buffer& b) {
    EXPECT_THAT(kernels::CopyFromHost(
                    ctx(), kernels::MakeView(v.data(), {static_cast<int64_t>(v.size())}), b.view()),
                IsOk());
  }
  std::vector<float> Read(const Buffer& b) {
    const int64_t n = b.NumElements();
    std::vector<float> v(static_cast<size_t>(n));
    EXPECT_THAT(kernels::CopyToHost(ctx(), b.view(), kernels::MakeView(v.data(), {n})), IsOk());
    return v;
  }
  std::vector<float*> Params() {
    std::vector<float*> p;
    for (Buffer& b : x) p.push_back(b.As<float>());
    return p;
  }
  std::vector<const float*> Grads(const std::vector<bool>& has) {
    std::vector<const float*> p;
    for (size_t i = 0; i < g.size(); ++i) p.push_back(has[i] ? g[i].As<float>() : nullptr);
    return p;
  }
};

struct Case {
  const char* name;
  AlgorithmKind kind;
  bool in_place;
};

class StepGraphRules : public ::testing::TestWithParam<Case> {
 protected:
  kernels::testing::ScopedHostTestDevice device_{/*strict=*/true};
};

TEST_P(StepGraphRules, ReplaysEqualTheEagerStepBitForBitWithNewScalarsEachStep) {
  ASSERT_THAT(device_.status(), IsOk());
  const Case& c = GetParam();
  GroupConfig cfg;
  cfg.algorithm = c.kind;
  cfg.hyperparams = DefaultHyperparams(c.kind);
  cfg.hyperparams.weight_decay = 0.05;
  // Two parameters of one shape (one bucket) and one of another.
  const std::vector<ParamShape> shapes = {{12, 8}, {12, 8}, {6, 10}};
  Side graph, eager;
  graph.Init(cfg, shapes);
  eager.Init(cfg, shapes);
  ASSERT_FALSE(HasFailure());
  StepGraph sg(&graph.ctx(), TestHooks());
  const auto before = kernels::testing::GetHostTestDeviceCounters();
  std::vector<StepGraph::Mode> modes;
  constexpr int kSteps = 10;
  for (int step = 1; step <= kSteps; ++step) {
    // Parameter 1 has no gradient at step 5: another op sequence, so another graph.
    const std::vector<bool> has = {true, step != 5, true};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto v =
          RandomVector(static_cast<size_t>(Numel(shapes[i])), 1000 * step + static_cast<int>(i));
      graph.Write(v, graph.g[i]);
      eager.Write(v, eager.g[i]);
    }
    StepOptions opts;
    opts.lr = 0.02 / step;  // a schedule: new scalars every step
    opts.weight_decay = 0.01 * step;
    opts.in_place = c.in_place;
    auto gp = graph.Params();
    auto gg = graph.Grads(has);
    if (step == 1) {
      // The first step runs eagerly (the state and staging are made then).
      ASSERT_THAT(graph.opt->Stage(graph.ctx(), gp, gg, opts), IsOk());
      modes.push_back(StepGraph::Mode::kEager);
    } else {
      auto out = sg.Run([&] { return graph.opt->Stage(graph.ctx(), gp, gg, opts); });
      ASSERT_THAT(out.status(), IsOk());
      ASSERT_NE(out->mode, StepGraph::Mode::kEager) << out->reason << ": " << out->detail;
      EXPECT_GT(out->ops, 0);
      EXPECT_GT(out->records, 0);  // every rule here has a fused step with a record
      modes.push_back(out->mode);
    }
    graph.opt->WriteStagedParams(gp);
    graph.opt->CommitStagedState();
    auto ep = eager.Params();
    auto eg = eager.Grads(has);
    ASSERT_THAT(eager.opt->Stage(eager.ctx(), ep, eg, opts), IsOk());
    eager.opt->WriteStagedParams(ep);
    eager.opt->CommitStagedState();
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_TRUE(SameBits(graph.Read(graph.x[i]), eager.Read(eager.x[i])))
          << c.name << " step " << step << " parameter " << i;
      for (const std::string& name : StateNames(c.kind)) {
        auto shape = graph.opt->StateShape(i, name);
        ASSERT_THAT(shape.status(), IsOk());
        int64_t n = 1;
        for (int64_t d : *shape) n *= d;
        std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
        ASSERT_THAT(graph.opt->GetState(graph.ctx(), i, name, absl::MakeSpan(a)), IsOk());
        ASSERT_THAT(eager.opt->GetState(eager.ctx(), i, name, absl::MakeSpan(b)), IsOk());
        EXPECT_TRUE(SameBits(a, b)) << c.name << " step " << step << " " << name << " " << i;
      }
    }
    EXPECT_EQ(graph.opt->last_update_norm(), eager.opt->last_update_norm()) << "step " << step;
  }
  // Replays happened: an in-place step has one form (plus step 5's); a staged step alternates
  // between forms (each bucket's state and staging swap at each commit where every member took
  // part; at step 5 the first bucket's do not), so up to five graphs are captured: (A,A), (B,B),
  // step 5's, then (B,A) and (A,B) with the buckets out of phase.
  int captured = 0, replayed = 0;
  for (StepGraph::Mode m : modes) {
    captured += m == StepGraph::Mode::kCaptured;
    replayed += m == StepGraph::Mode::kReplayed;
  }
  EXPECT_EQ(captured + replayed, kSteps - 1);
  EXPECT_GE(replayed, 4) << c.name;
  EXPECT_LE(captured, 5) << c.name;
  EXPECT_EQ(sg.captures(), captured);
  EXPECT_EQ(sg.replays(), replayed);
  const auto after = kernels::testing::GetHostTestDeviceCounters();
  EXPECT_EQ(after.graph_launches - before.graph_launches, kSteps - 1);
  EXPECT_EQ(after.graphs_made - before.graphs_made, captured);
  EXPECT_GT(after.device_scalar_ops, before.device_scalar_ops);
  EXPECT_EQ(after.captures_invalidated, before.captures_invalidated);
}

INSTANTIATE_TEST_SUITE_P(Rules, StepGraphRules,
                         ::testing::Values(Case{"adamw_in_place", AlgorithmKind::kAdamW, true},
                                           Case{"adamw_staged", AlgorithmKind::kAdamW, false},
                                           Case{"lion_in_place", AlgorithmKind::kLion, true},
                                           Case{"lion_staged", AlgorithmKind::kLion, false},
                                           Case{"muon", AlgorithmKind::kMuon, false},
                                           Case{"normuon", AlgorithmKind::kNorMuon, false}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.name);
                         });

class StepGraphTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_THAT(device_.Open(kDev), IsOk()); }
  Context& ctx() { return device_.ctx(); }
  std::vector<float> Read(const Buffer& b) {
    const int64_t n = b.NumElements();
    std::vector<float> v(static_cast<size_t>(n));
    EXPECT_THAT(kernels::CopyToHost(ctx(), b.view(), kernels::MakeView(v.data(), {n})), IsOk());
    return v;
  }
  testing::StrictTestDevice device_;
};

TEST_F(StepGraphTest, ARuleWithASyncPointRunsEagerlyAndTheRecordingChangedNothing) {
  GroupConfig cfg;
  cfg.algorithm = AlgorithmKind::kDion;
  cfg.hyperparams = DefaultHyperparams(AlgorithmKind::kDion);
  auto opt = CreateGroupOptimizer(ctx(), cfg, {{16, 12}});
  ASSERT_THAT(opt.status(), IsOk());
  auto x = ctx().Allocate(kernels::DType::kF32, {16 * 12});
  auto g = ctx().Allocate(kernels::DType::kF32, {16 * 12});
  ASSERT_TRUE(x.ok() && g.ok());
  ASSERT_THAT(kernels::Fill(ctx(), 0.5f, x->view()), IsOk());
  ASSERT_THAT(kernels::Fill(ctx(), 0.25f, g->view()), IsOk());
  std::vector<float> q_before(static_cast<size_t>(12 * 12));
  auto q_shape = (*opt)->StateShape(0, "Q");
  ASSERT_THAT(q_shape.status(), IsOk());
  q_before.resize(static_cast<size_t>((*q_shape)[0] * (*q_shape)[1]));
  ASSERT_THAT((*opt)->GetState(ctx(), 0, "Q", absl::MakeSpan(q_before)), IsOk());
  const auto before = kernels::testing::GetHostTestDeviceCounters();
  float* xp[] = {x->As<float>()};
  const float* gp[] = {g->As<float>()};
  StepGraph sg(&ctx(), TestHooks());
  auto out = sg.Run([&] { return (*opt)->Stage(ctx(), xp, gp, {}); });
  ASSERT_THAT(out.status(), IsOk());
  EXPECT_EQ(out->mode, StepGraph::Mode::kEager);
  EXPECT_EQ(out->reason, "sync_point");
  EXPECT_THAT(out->detail, HasSubstr("waits for the device"));
  EXPECT_EQ(sg.graphs(), 0u);
  const auto after = kernels::testing::GetHostTestDeviceCounters();
  EXPECT_EQ(after.graph_captures, before.graph_captures);  // no capture was begun
  EXPECT_EQ(after.graph_launches, before.graph_launches);
  // Nothing ran: the parameter and Q are as they were, and the eager step still works.
  EXPECT_EQ(Read(*x), std::vector<float>(16 * 12, 0.5f));
  std::vector<float> q_after(q_before.size());
  ASSERT_THAT((*opt)->GetState(ctx(), 0, "Q", absl::MakeSpan(q_after)), IsOk());
  EXPECT_TRUE(SameBits(q_after, q_before));
  ASSERT_THAT((*opt)->Stage(ctx(), xp, gp, {}), IsOk());
  (*opt)->WriteStagedParams(xp);
  (*opt)->CommitStagedState();
  EXPECT_GT((*opt)->last_update_norm(), 0.0);
}

TEST_F(StepGraphTest, AByValueScalarIsPartOfTheSignatureSoAChangeCapturesAgain) {
  auto b = ctx().Allocate(kernels::DType::kF32, {8});
  ASSERT_THAT(b.status(), IsOk());
  StepGraph sg(&ctx(), TestHooks(), StepGraph::Options{/*capacity=*/2, /*host_copies=*/false});
  float value = 1.0f;
  auto phase = [&] { return kernels::Fill(ctx(), value, b->view()); };
  for (float v : {1.0f, 1.0f, 2.0f, 3.0f, 2.0f}) {
    value = v;
    auto out = sg.Run(phase);
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_EQ(Read(*b), std::vector<float>(8, v));
    EXPECT_EQ(out->records, 0);
  }
  // 1 captured, 1 replayed, 2 and 3 captured (1 dropped: capacity 2), 2 replayed.
  EXPECT_EQ(sg.captures(), 3);
  EXPECT_EQ(sg.replays(), 2);
  EXPECT_EQ(sg.graphs(), 2u);
}

TEST_F(StepGraphTest, APhaseThatIssuesOtherOpsUnderCaptureIsNotKept) {
  auto b = ctx().Allocate(kernels::DType::kF32, {8});
  ASSERT_THAT(b.status(), IsOk());
  StepGraph sg(&ctx(), TestHooks());
  const int64_t launches = kernels::testing::GetHostTestDeviceCounters().graph_launches;
  int calls = 0;
  // Not re-runnable: its second run (the capture) fills once more than its first.
  auto phase = [&]() -> absl::Status {
    ++calls;
    for (int i = 0; i < calls; ++i) DIOND_RETURN_IF_ERROR(kernels::Fill(ctx(), 4.0f, b->view()));
    return absl::OkStatus();
  };
  auto out = sg.Run(phase);
  ASSERT_THAT(out.status(), IsOk());
  EXPECT_EQ(out->mode, StepGraph::Mode::kEager);
  EXPECT_EQ(out->reason, "capture_failed");
  EXPECT_THAT(out->detail, HasSubstr("other ops under capture"));
  EXPECT_EQ(sg.graphs(), 0u);
  EXPECT_EQ(kernels::testing::GetHostTestDeviceCounters().graph_launches, launches);
}

// A phase of host <-> device copies (a device session's reads and write-back): refused by
// default; with Options::host_copies captured once and replayed, each replay copying the host
// memory's bytes of that moment (a captured copy names the address, not the values).
TEST_F(StepGraphTest, HostCopiesAreCapturedOnlyWhenAllowedAndReplayReadsTheCurrentBytes) {
  constexpr int64_t kN = 256;
  struct Pinned {
    float* p = static_cast<float*>(std::aligned_alloc(4096, 4096));
    ~Pinned() { std::free(p); }
  } in, out;
  ASSERT_NE(in.p, nullptr);
  ASSERT_NE(out.p, nullptr);
  ASSERT_THAT(kernels::DeviceRuntimeFor(kDev.type).host_register(kDev, in.p, 4096), IsOk());
  ASSERT_THAT(kernels::DeviceRuntimeFor(kDev.type).host_register(kDev, out.p, 4096), IsOk());
  auto b = ctx().Allocate(kernels::DType::kF32, {kN});
  ASSERT_THAT(b.status(), IsOk());
  // in -> device, x2 on the device, device -> out.
  auto phase = [&]() -> absl::Status {
    DIOND_RETURN_IF_ERROR(kernels::CopyFromHostAsync(
        ctx(), kernels::MakeView(static_cast<const float*>(in.p), {kN}), b->view()));
    DIOND_RETURN_IF_ERROR(kernels::Axpby(ctx(), 2.0f, b->view(), 0.0f, b->view(), b->view()));
    return kernels::CopyToHostAsync(ctx(), b->view(), kernels::MakeView(out.p, {kN}));
  };
  {
    StepGraph refusing(&ctx(), TestHooks());
    auto r = refusing.Run(phase);
    ASSERT_THAT(r.status(), IsOk());
    EXPECT_EQ(r->mode, StepGraph::Mode::kEager);
    EXPECT_EQ(r->reason, "sync_point");
    EXPECT_THAT(r->detail, HasSubstr("copy_from_host_async (it reads or writes host memory)"));
  }
  StepGraph sg(&ctx(), TestHooks(), StepGraph::Options{4, /*host_copies=*/true});
  const auto before = kernels::testing::GetHostTestDeviceCounters();
  for (int step = 1; step <= 4; ++step) {
    for (int64_t i = 0; i < kN; ++i) in.p[i] = static_cast<float>(step * 1000 + i);
    std::fill(out.p, out.p + kN, -1.0f);
    auto r = sg.Run(phase);
    ASSERT_THAT(r.status(), IsOk());
    ASSERT_NE(r->mode, StepGraph::Mode::kEager) << r->reason << ": " << r->detail;
    EXPECT_EQ(r->mode, step == 1 ? StepGraph::Mode::kCaptured : StepGraph::Mode::kReplayed);
    EXPECT_EQ(r->records, 0);
    ASSERT_THAT(kernels::Synchronize(ctx()), IsOk());
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(out.p[i], 2.0f * static_cast<float>(step * 1000 + i)) << "step " << step;
    }
  }
  const auto after = kernels::testing::GetHostTestDeviceCounters();
  EXPECT_EQ(after.graph_launches - before.graph_launches, 4);
  // The replayed copies are copies (as a GPU's memcpy nodes), one each way per launch.
  EXPECT_EQ(after.async_copies_to_device - before.async_copies_to_device, 4);
  EXPECT_EQ(after.async_copies_to_host - before.async_copies_to_host, 4);
  // Another host buffer is another signature: a new capture, never a replay into the old one.
  EXPECT_EQ(sg.graphs(), 1u);
  sg.Clear();
  EXPECT_EQ(sg.graphs(), 0u);
  auto again = sg.Run(phase);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->mode, StepGraph::Mode::kCaptured);
  ASSERT_THAT(kernels::Synchronize(ctx()), IsOk());
  ASSERT_THAT(kernels::DeviceRuntimeFor(kDev.type).host_unregister(kDev, in.p), IsOk());
  ASSERT_THAT(kernels::DeviceRuntimeFor(kDev.type).host_unregister(kDev, out.p), IsOk());
}

// Pageable host memory cannot be captured (CUDA stages such a copy synchronously and refuses it
// under capture; the TEST backend refuses a copy outside a host_register'ed range): the capture
// fails, the phase runs eagerly, and nothing of the failed capture ran.
TEST_F(StepGraphTest, ACopyOfPageableHostMemoryFailsTheCaptureWithNothingRun) {
  std::vector<float> pageable(64, 3.0f);
  auto b = ctx().Allocate(kernels::DType::kF32, {64});
  ASSERT_THAT(b.status(), IsOk());
  ASSERT_THAT(kernels::Fill(ctx(), 7.0f, b->view()), IsOk());
  StepGraph sg(&ctx(), TestHooks(), StepGraph::Options{4, /*host_copies=*/true});
  const auto before = kernels::testing::GetHostTestDeviceCounters();
  auto r = sg.Run([&] {
    return kernels::CopyFromHostAsync(ctx(), kernels::MakeView(pageable.data(), {64}), b->view());
  });
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->mode, StepGraph::Mode::kEager);
  EXPECT_EQ(r->reason, "capture_failed");
  EXPECT_THAT(r->detail, HasSubstr("pageable"));
  const auto after = kernels::testing::GetHostTestDeviceCounters();
  EXPECT_EQ(after.captures_invalidated - before.captures_invalidated, 1);
  EXPECT_EQ(after.graph_launches, before.graph_launches);
  EXPECT_EQ(Read(*b), std::vector<float>(64, 7.0f));
}

TEST_F(StepGraphTest, ABackendWithoutCaptureIsUnsupported) {
  auto b = ctx().Allocate(kernels::DType::kF32, {4});
  ASSERT_THAT(b.status(), IsOk());
  StepGraph sg(&ctx(), kernels::GraphHooks{});
  auto out = sg.Run([&] { return kernels::Fill(ctx(), 1.0f, b->view()); });
  ASSERT_THAT(out.status(), IsOk());
  EXPECT_EQ(out->mode, StepGraph::Mode::kEager);
  EXPECT_EQ(out->reason, "unsupported");
}

TEST_F(StepGraphTest, ASyncPointUnderCaptureInvalidatesTheEmulatedCapture) {
  // The TEST backend's emulation itself: a synchronous entry on a capturing stream is refused
  // and the capture ends in an error (cudaStreamCaptureModeGlobal's behaviour).
  ASSERT_THAT(kernels::DeviceRuntimeFor(kDev.type).begin_capture(kDev, device_.stream()), IsOk());
  std::vector<float> host(4);
  auto b = ctx().Allocate(kernels::DType::kF32, {4});
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_THAT(kernels::CopyToHost(ctx(), b->view(), kernels::MakeView(host.data(), {4})),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("capturing")));
  EXPECT_THAT(kernels::DeviceRuntimeFor(kDev.type).end_capture(kDev, device_.stream()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("invalidated")));
}

TEST_F(StepGraphTest, CallersCannotSetDeviceScalars) {
  auto b = ctx().Allocate(kernels::DType::kF32, {4});
  ASSERT_THAT(b.status(), IsOk());
  kernels::AdamWParams p;
  p.lr = 0.1f;
  p.scalars_on_device = reinterpret_cast<const kernels::AdamWScalarRecord*>(b->data());
  EXPECT_THAT(kernels::AdamWStep(ctx(), p, b->cview(), b->view(), b->view(), b->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scalars_on_device")));
  kernels::ApplyUpdateParams a;
  a.scalars_on_device = reinterpret_cast<const kernels::ApplyUpdateScalarRecord*>(b->data());
  EXPECT_THAT(kernels::ApplyUpdate(ctx(), a, b->cview(), b->cview(), b->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scalars_on_device")));
}

// ThinQr runs on cuSOLVER, which does not document stream capture: a phase with it runs eagerly.
TEST_F(StepGraphTest, ThinQrIsNeverCaptured) {
  auto a = ctx().Zeros(kernels::DType::kF32, {8, 4});
  auto q = ctx().Allocate(kernels::DType::kF32, {8, 4});
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(q.status(), IsOk());
  StepGraph sg(&ctx(), TestHooks());
  const int64_t captures = kernels::testing::GetHostTestDeviceCounters().graph_captures;
  auto phase = [&]() { return kernels::ThinQr(ctx(), a->cview(), q->view()); };
  auto r = sg.Run(phase);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->mode, StepGraph::Mode::kEager);
  EXPECT_THAT(r->detail, HasSubstr("thin_qr (its library, cuSOLVER, does not document"));
  EXPECT_EQ(kernels::testing::GetHostTestDeviceCounters().graph_captures, captures);
}

}  // namespace
}  // namespace diond::optim
