// Steps 2..N allocate nothing (an allocation per step costs time and, on a device, a sync): for
// every algorithm and both precisions, a GroupOptimizer made on a Context and stepped on it makes
// no allocation through that Context after its first step (Context::allocation_count counts Buffers
// and scratch-arena blocks).
//
// Memory a rule takes from the C++ heap (std::vector temporaries) bypasses the Context, so this
// binary also counts large heap allocations (>= 64 KiB) with a replaced global operator new, and
// expects none in steps 2..N from any rule (Dion's temporaries are scratch-arena memory too).
//
// AdamW and Lion step in place (no staging, UpdateRule::InPlace): even their first step allocates
// nothing.
//
// The same holds on a device Context (StepAllocationOnDevice): the host-memory TEST backend in
// strict mode, with the parameters and gradients in its memory.
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"
#include "kernels/testing/recording_backend.h"

namespace {
std::atomic<int64_t> g_large_news{0};
constexpr size_t kLarge = size_t{64} << 10;
}  // namespace

void* operator new(size_t n) {
  if (n >= kLarge) g_large_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace diond::optim {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using kernels::testing::RandomVector;  // N(0, 1) from a seed (kernels/cpu/test_util.h)
using ::testing::HasSubstr;

// Rules that run in place on the caller's parameters: they stage nothing.
bool InPlace(AlgorithmKind k) { return k == AlgorithmKind::kAdamW || k == AlgorithmKind::kLion; }

struct Case {
  AlgorithmKind kind;
  Precision precision;
};

class StepAllocation : public ::testing::TestWithParam<Case> {};

TEST_P(StepAllocation, StepsAfterTheFirstAllocateNothingThroughTheContext) {
  const Case c = GetParam();
  const std::string name(AlgorithmName(c.kind));
  auto ctx = kernels::Context::CpuDefault(2);
  GroupConfig cfg;
  cfg.algorithm = c.kind;
  cfg.precision = c.precision;
  cfg.hyperparams = DefaultHyperparams(c.kind);
  if (c.kind == AlgorithmKind::kDion) cfg.hyperparams.rank_fraction = 0.25;
  // Two parameters of one shape (a megabatch) and one of another, each large enough that the
  // rules' temporaries are "large" (>= 64 KiB).
  const std::vector<ParamShape> shapes = {{128, 192}, {128, 192}, {192, 96}};
  auto opt = CreateGroupOptimizer(*ctx, cfg, shapes);
  ASSERT_THAT(opt.status(), IsOk());
  std::vector<std::vector<float>> x, g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    x.push_back(RandomVector(static_cast<size_t>(shapes[i][0] * shapes[i][1]), 1 + i));
    g.push_back(RandomVector(x.back().size(), 100 + i));
  }
  std::vector<float*> xp;
  std::vector<const float*> gp;
  for (size_t i = 0; i < shapes.size(); ++i) {
    xp.push_back(x[i].data());
    gp.push_back(g[i].data());
  }
  const int64_t at_create = ctx->allocation_count();
  EXPECT_GT(at_create, 0) << "the state is allocated through the Context";
  ASSERT_THAT((*opt)->Step(*ctx, xp, gp), IsOk());
  const int64_t after_first = ctx->allocation_count();
  if (InPlace(c.kind)) {
    EXPECT_EQ(after_first, at_create) << name << " steps in place: no staging, no scratch";
  } else {
    EXPECT_GT(after_first, at_create) << "the first step allocates its staging through the Context";
  }
  const int64_t heap_before = g_large_news.load();
  for (int step = 2; step <= 5; ++step) {
    // Step 3 gives one parameter no gradient: the staging is sized for all of them anyway.
    std::vector<const float*> grads = gp;
    if (step == 3) grads[1] = nullptr;
    ASSERT_THAT((*opt)->Step(*ctx, xp, grads), IsOk()) << "step " << step;
  }
  EXPECT_EQ(ctx->allocation_count(), after_first) << name
                                                  << ": steps 2..5 allocated through "
                                                     "the Context";
  const int64_t heap = g_large_news.load() - heap_before;
  EXPECT_EQ(heap, 0) << name << " (" << PrecisionName(c.precision)
                     << "): large heap allocations in steps 2..5";
}

TEST(StepAllocation, AContextOnAnotherDeviceIsRefused) {
  // The state lives on the creating context's device (the CPU); a Step on a context of another
  // device (the test-only kTest backend) fails before touching anything.
  ASSERT_THAT(kernels::testing::RecordingBackend::Install(
                  kernels::FindOpsBackend(kernels::DeviceType::kCpu)),
              IsOk());
  kernels::ContextOptions o;
  o.device = kernels::Device{kernels::DeviceType::kTest, 0};
  auto other = kernels::Context::Create(o);
  ASSERT_THAT(other.status(), IsOk());
  auto ctx = kernels::Context::CpuDefault(1);
  GroupConfig cfg;
  cfg.algorithm = AlgorithmKind::kAdamW;
  cfg.hyperparams = DefaultHyperparams(AlgorithmKind::kAdamW);
  auto opt = CreateGroupOptimizer(*ctx, cfg, {{4, 4}});
  ASSERT_THAT(opt.status(), IsOk());
  std::vector<float> x(16, 1.0f), g(16, 0.5f);
  float* xp[] = {x.data()};
  const float* gp[] = {g.data()};
  EXPECT_THAT((*opt)->Step(**other, xp, gp),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  EXPECT_EQ(x, std::vector<float>(16, 1.0f));
  EXPECT_EQ((*opt)->steps_taken(), 0);
  other->reset();
  kernels::testing::RecordingBackend::Uninstall();
  EXPECT_THAT((*opt)->Step(*ctx, xp, gp), IsOk());
  EXPECT_NE(x, std::vector<float>(16, 1.0f));
}

class StepAllocationOnDevice : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { ASSERT_THAT(device_.status(), IsOk()); }
  kernels::testing::ScopedHostTestDevice device_{/*strict=*/true};
};

TEST_P(StepAllocationOnDevice, StepsAfterTheFirstAllocateNothingThroughTheContext) {
  const Case c = GetParam();
  const std::string name(AlgorithmName(c.kind));
  kernels::ContextOptions o;
  o.device = kernels::Device{kernels::DeviceType::kTest, 0};
  o.num_threads = 1;
  auto ctx = kernels::Context::Create(o);
  ASSERT_THAT(ctx.status(), IsOk());
  GroupConfig cfg;
  cfg.algorithm = c.kind;
  cfg.precision = c.precision;
  cfg.hyperparams = DefaultHyperparams(c.kind);
  if (c.kind == AlgorithmKind::kDion) cfg.hyperparams.rank_fraction = 0.25;
  const std::vector<ParamShape> shapes = {{64, 96}, {64, 96}, {96, 48}};
  auto opt = CreateGroupOptimizer(**ctx, cfg, shapes);
  ASSERT_THAT(opt.status(), IsOk());
  // Parameters and gradients in device memory, uploaded once (these allocations are the test's).
  std::vector<kernels::Buffer> x, g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = shapes[i][0] * shapes[i][1];
    for (auto* list : {&x, &g}) {
      const std::vector<float> v =
          RandomVector(static_cast<size_t>(n), 1 + i + (list == &g ? 100 : 0));
      auto b = (*ctx)->Allocate(kernels::DType::kF32, {n});
      ASSERT_THAT(b.status(), IsOk());
      ASSERT_THAT(kernels::CopyFromHost(**ctx, kernels::MakeView(v.data(), {n}), b->view()),
                  IsOk());
      list->push_back(std::move(*b));
    }
  }
  std::vector<float*> xp;
  std::vector<const float*> gp;
  for (size_t i = 0; i < shapes.size(); ++i) {
    xp.push_back(x[i].As<float>());
    gp.push_back(g[i].As<float>());
  }
  const int64_t at_create = (*ctx)->allocation_count();
  ASSERT_THAT((*opt)->Step(**ctx, xp, gp), IsOk());
  const int64_t after_first = (*ctx)->allocation_count();
  if (InPlace(c.kind)) {
    EXPECT_EQ(after_first, at_create) << name << " steps in place";
  }
  for (int step = 2; step <= 4; ++step) {
    std::vector<const float*> grads = gp;
    if (step == 3) grads[1] = nullptr;
    ASSERT_THAT((*opt)->Step(**ctx, xp, grads), IsOk()) << "step " << step;
  }
  EXPECT_EQ((*ctx)->allocation_count(), after_first)
      << name << " (" << PrecisionName(c.precision)
      << "): steps 2..4 allocated through the device Context";
  opt->reset();
  x.clear();
  g.clear();
}

std::vector<Case> AllCases() {
  std::vector<Case> v;
  for (AlgorithmKind k :
       {AlgorithmKind::kMuon, AlgorithmKind::kNorMuon, AlgorithmKind::kDion, AlgorithmKind::kDion2,
        AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW, AlgorithmKind::kLion}) {
    for (Precision p : {Precision::kFp32, Precision::kBf16Reference}) v.push_back({k, p});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(EveryAlgorithm, StepAllocation, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(AlgorithmName(info.param.kind)) + "_" +
                                  std::string(PrecisionName(info.param.precision));
                         });

INSTANTIATE_TEST_SUITE_P(EveryAlgorithm, StepAllocationOnDevice, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(AlgorithmName(info.param.kind)) + "_" +
                                  std::string(PrecisionName(info.param.precision));
                         });

}  // namespace
}  // namespace diond::optim
