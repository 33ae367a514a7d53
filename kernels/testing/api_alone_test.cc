// The ops API target on its own, linked WITHOUT the CPU backend (kernels/CMakeLists.txt:
// kernels_api_alone_test depends on diond::kernels_api only). It proves that the API builds and
// links without kernels/cpu, that no backend means no Context, and that the dispatcher's
// validation runs before (and instead of) any backend call.
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
using ::diond::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::RecordingBackend;

TEST(KernelsApiAlone, NoCpuBackendIsLinked) {
  EXPECT_EQ(FindOpsBackend(DeviceType::kCpu), nullptr);
  ContextOptions o;  // the CPU
  EXPECT_THAT(Context::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no ops backend")));
}

class TestDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_THAT(RecordingBackend::Install(/*target=*/nullptr), IsOk());
    ContextOptions o;
    o.device = Device{DeviceType::kTest, 0};
    auto c = Context::Create(o);
    ASSERT_THAT(c.status(), IsOk());
    ctx_ = *std::move(c);
    RecordingBackend::ClearLog();
  }
  void TearDown() override {
    ctx_.reset();
    RecordingBackend::Uninstall();
  }
  TensorView View(Buffer& b) { return b.view(); }
  std::unique_ptr<Context> ctx_;
};

TEST_F(TestDevice, ValidArgumentsReachTheTableInvalidOnesDoNot) {
  auto a = ctx_->Allocate(DType::kF32, {4, 3});
  auto b = ctx_->Allocate(DType::kF32, {3, 5});
  auto c = ctx_->Allocate(DType::kF32, {4, 5});
  auto bad = ctx_->Allocate(DType::kF32, {4, 6});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && bad.ok());
  EXPECT_THAT(RecordingBackend::Log(), ElementsAre("allocate", "allocate", "allocate", "allocate"));
  EXPECT_EQ(ctx_->allocation_count(), 4);
  RecordingBackend::ClearLog();

  // A shape error is caught by the API: the backend is never called.
  EXPECT_THAT(Gemm(*ctx_, {}, a->cview(), b->cview(), bad->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("want [4, 5]")));
  EXPECT_TRUE(RecordingBackend::Log().empty());

  // Valid arguments are handed to the table (which, with no target, answers UNIMPLEMENTED).
  EXPECT_THAT(Gemm(*ctx_, {}, a->cview(), b->cview(), c->view()),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("gemm")));
  EXPECT_THAT(RecordingBackend::Log(), ElementsAre("gemm"));
}

TEST_F(TestDevice, ViewsOfAnotherDeviceAreRefused) {
  std::vector<float> host(12);
  auto out = ctx_->Allocate(DType::kF32, {12});
  ASSERT_TRUE(out.ok());
  RecordingBackend::ClearLog();
  // MakeView labels host memory as the CPU's: not this context's device.
  EXPECT_THAT(Copy(*ctx_, MakeView(host.data(), {12}), out->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device")));
  EXPECT_TRUE(RecordingBackend::Log().empty());
}

TEST_F(TestDevice, BuffersFreeThroughTheBackend) {
  {
    auto b = ctx_->Allocate(DType::kBf16, {8, 8});
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->device().type, DeviceType::kTest);
    EXPECT_EQ(b->view().device().type, DeviceType::kTest);
    EXPECT_GE(ctx_->bytes_in_use(), 128);
  }
  EXPECT_THAT(RecordingBackend::Log(), ElementsAre("allocate", "deallocate"));
  EXPECT_EQ(ctx_->bytes_in_use(), 0);
  EXPECT_THAT(ctx_->Allocate(DType::kF32, {-1, 2}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
}

TEST(KernelsApiAlone, RegistryRefusesIncompleteTables) {
  OpsBackend t;  // every entry null
  t.name = "incomplete";
  EXPECT_THAT(RegisterOpsBackend(DeviceType::kTest, &t),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null entry")));
  OpsBackend v = RecordingBackend::Table();
  v.version = kOpsBackendVersion + 1;
  EXPECT_THAT(RegisterOpsBackend(DeviceType::kTest, &v),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version")));
  EXPECT_EQ(FindOpsBackend(DeviceType::kTest), nullptr);
}

}  // namespace
}  // namespace diond::kernels
