// GPU-only (ctest label `gpu`): with the CUDA plugin built, `--device=cuda:0` must find a GPU.
// Skips cleanly when no device (or no driver) is present, as on the CI machines.
#include "gtest/gtest.h"
#include "kernels/device.h"

namespace diond::kernels {
namespace {

TEST(GpuDevice, PluginFindsAndNamesGpu0) {
  auto d = SelectDevice({DeviceRequest::Mode::kCuda, 0}, DIOND_CUDA_PLUGIN);
  if (!d.ok()) {
    GTEST_SKIP() << "no GPU here: " << d.status().message();
  }
  EXPECT_EQ(d->type, DeviceType::kCuda);
  EXPECT_EQ(d->index, 0);
  EXPECT_TRUE(d->cuda_plugin_loaded);
  EXPECT_NE(d->name.find("cuda:0"), std::string::npos) << d->name;
}

}  // namespace
}  // namespace diond::kernels
