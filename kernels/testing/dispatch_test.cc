// Dispatch through the backend table: a Context on the fake device kTest runs the public ops
// through the TEST-ONLY recording backend, which forwards to the CPU backend's table. The results
// must equal the same ops on a CPU Context bit for bit, and the log must name each op once (the
// CPU kernels' internal helpers do not re-enter the dispatcher).
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/ops.h"
#include "kernels/testing/recording_backend.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::testing::ElementsAre;
using testing::RecordingBackend;

class Dispatch : public ::testing::Test {
 protected:
  void SetUp() override {
    const OpsBackend* cpu = FindOpsBackend(DeviceType::kCpu);
    ASSERT_NE(cpu, nullptr);  // registered by linking diond::ops
    EXPECT_STREQ(cpu->name, "cpu");
    ASSERT_THAT(RecordingBackend::Install(cpu), IsOk());
    ContextOptions o;
    o.device = Device{DeviceType::kTest, 0};
    o.num_threads = 2;
    auto c = Context::Create(o);
    ASSERT_THAT(c.status(), IsOk());
    test_ = *std::move(c);
    cpu_ = Context::CpuDefault(2);
  }
  void TearDown() override {
    test_.reset();
    RecordingBackend::Uninstall();
  }
  // A buffer on `ctx` holding `values`.
  Buffer Make(const Context& ctx, const std::vector<int64_t>& shape,
              const std::vector<float>& values) {
    auto b = ctx.Allocate(DType::kF32, shape);
    EXPECT_THAT(b.status(), IsOk());
    std::memcpy(b->data(), values.data(), values.size() * sizeof(float));
    return *std::move(b);
  }
  std::unique_ptr<Context> test_, cpu_;
};

std::vector<float> Values(int64_t n, float seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(seed + 0.37f * static_cast<float>(i));
  return v;
}

std::vector<float> Read(const Buffer& b) {
  std::vector<float> v(static_cast<size_t>(b.NumElements()));
  std::memcpy(v.data(), b.data(), b.bytes());
  return v;
}

TEST_F(Dispatch, GemmQrAndAdamWGoThroughTheTableAndMatchTheCpu) {
  std::vector<float> results[2];
  std::vector<std::string> log;
  const Context* ctxs[2] = {test_.get(), cpu_.get()};
  for (int i = 0; i < 2; ++i) {
    const Context& ctx = *ctxs[i];
    Buffer a = Make(ctx, {6, 4}, Values(24, 1.0f));
    Buffer b = Make(ctx, {4, 3}, Values(12, 2.0f));
    Buffer c = Make(ctx, {6, 3}, Values(18, 3.0f));
    Buffer q = Make(ctx, {6, 4}, Values(24, 0.0f));
    Buffer g = Make(ctx, {6, 3}, Values(18, 4.0f));
    auto m = ctx.Zeros(DType::kF32, {6, 3});
    auto v = ctx.Zeros(DType::kF32, {6, 3});
    ASSERT_TRUE(m.ok() && v.ok());
    if (i == 0) RecordingBackend::ClearLog();
    GemmParams gp;
    gp.alpha = 0.5f;
    gp.beta = 1.0f;
    ASSERT_THAT(Gemm(ctx, gp, a.cview(), b.cview(), c.view()), IsOk());
    ASSERT_THAT(ThinQr(ctx, a.cview(), q.view()), IsOk());
    AdamWParams ap;
    ap.lr = 0.01f;
    ap.weight_decay = 0.1f;
    ASSERT_THAT(AdamWStep(ctx, ap, g.cview(), c.view(), m->view(), v->view()), IsOk());
    if (i == 0) log = RecordingBackend::Log();
    results[i] = Read(c);
    const std::vector<float> qv = Read(q);
    results[i].insert(results[i].end(), qv.begin(), qv.end());
  }
  // ThinQr's scratch (its tau vector) is the one allocation, through the test backend too.
  EXPECT_THAT(log, ElementsAre("gemm", "thin_qr", "allocate", "adamw_step"));
  ASSERT_EQ(results[0].size(), results[1].size());
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4), 0);
}

TEST_F(Dispatch, ScratchBlocksComeFromTheBackendAllocator) {
  Buffer a = Make(*test_, {64, 32}, Values(64 * 32, 5.0f));
  Buffer q = Make(*test_, {64, 32}, Values(64 * 32, 0.0f));
  RecordingBackend::ClearLog();
  const int64_t before = test_->allocation_count();
  // ThinQr takes its tau vector from the context's scratch arena: the first call reserves a
  // block through the backend, a second call reuses it.
  ASSERT_THAT(ThinQr(*test_, a.cview(), q.view()), IsOk());
  EXPECT_THAT(RecordingBackend::Log(), ElementsAre("thin_qr", "allocate"));
  EXPECT_EQ(test_->allocation_count(), before + 1);
  RecordingBackend::ClearLog();
  ASSERT_THAT(ThinQr(*test_, a.cview(), q.view()), IsOk());
  EXPECT_THAT(RecordingBackend::Log(), ElementsAre("thin_qr"));
  EXPECT_EQ(test_->allocation_count(), before + 1);
}

TEST(ComputeDevice, FollowsTheRegistry) {
  SelectedDevice gpu;
  gpu.type = DeviceType::kCuda;
  gpu.index = 3;
  EXPECT_EQ(ComputeDevice(gpu), (Device{DeviceType::kCpu, 0}));  // no CUDA ops backend
  // Once a backend is registered for the GPU's type, the GPU itself is the compute device.
  ASSERT_THAT(RegisterOpsBackend(DeviceType::kCuda, &RecordingBackend::Table()), IsOk());
  EXPECT_EQ(ComputeDevice(gpu), (Device{DeviceType::kCuda, 3}));
  UnregisterOpsBackendForTest(DeviceType::kCuda);
  EXPECT_EQ(ComputeDevice(SelectedDevice{}), (Device{DeviceType::kCpu, 0}));
}

}  // namespace
}  // namespace diond::kernels
