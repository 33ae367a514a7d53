#include "kernels/device.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::kernels {
namespace {

using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ParseDeviceRequest, AcceptsTheDocumentedForms) {
  EXPECT_EQ(ParseDeviceRequest("auto")->mode, DeviceRequest::Mode::kAuto);
  EXPECT_EQ(ParseDeviceRequest("cpu")->mode, DeviceRequest::Mode::kCpu);
  auto c = ParseDeviceRequest("cuda:3");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->mode, DeviceRequest::Mode::kCuda);
  EXPECT_EQ(c->cuda_index, 3);
  EXPECT_EQ(ParseDeviceRequest("cuda")->cuda_index, 0);
}

TEST(ParseDeviceRequest, RejectsOtherTextNamingIt) {
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", "", "CPU"}) {
    EXPECT_THAT(ParseDeviceRequest(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(std::string("'") + bad)))
        << bad;
  }
}

TEST(SelectDevice, CpuNeverLoadsThePlugin) {
  auto d = SelectDevice({DeviceRequest::Mode::kCpu, 0}, "/nonexistent/libdiond_cuda.so");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->type, DeviceType::kCpu);
  EXPECT_FALSE(d->cuda_plugin_loaded);
  EXPECT_TRUE(d->fallback_reason.empty());
}

TEST(SelectDevice, AutoWithMissingPluginFallsBackToCpuAndSaysWhy) {
  // The plugin is loaded at most once per process, so this test owns that first load.
  auto d = SelectDevice({}, "/nonexistent/libdiond_cuda.so");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->type, DeviceType::kCpu);
  EXPECT_THAT(d->fallback_reason, HasSubstr("/nonexistent/libdiond_cuda.so"));
  auto c = SelectDevice({DeviceRequest::Mode::kCuda, 0}, "/nonexistent/libdiond_cuda.so");
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA plugin")));
}

}  // namespace
}  // namespace diond::kernels
