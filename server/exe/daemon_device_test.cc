// The device wiring of the daemon: the selected device reaches the compute
// only when an ops backend exists for it; otherwise the start-up line says the steps run on the
// CPU. A GPU host is emulated with a SelectedDevice of type kCuda (no GPU is needed).
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "server/exe/daemon.h"

namespace diond::server {
namespace {

TEST(DaemonDevice, AGpuWithoutAnOpsBackendComputesOnTheCpuAndSaysSo) {
  kernels::SelectedDevice gpu;
  gpu.type = kernels::DeviceType::kCuda;
  gpu.index = 1;
  gpu.name = "NVIDIA H200";
  ASSERT_EQ(kernels::FindOpsBackend(kernels::DeviceType::kCuda), nullptr);
  const kernels::Device compute = kernels::ComputeDevice(gpu);
  EXPECT_EQ(compute.type, kernels::DeviceType::kCpu);
  EXPECT_EQ(DeviceLabel(compute.type, compute.index), "cpu");
  EXPECT_EQ(DescribeDevice(gpu, compute),
            "device NVIDIA H200; steps run on the cpu: this build has no ops backend for "
            "cuda:1 yet");
}

TEST(DaemonDevice, TheCpuIsItsOwnComputeDevice) {
  kernels::SelectedDevice cpu;
  cpu.name = "cpu (2 threads)";
  cpu.fallback_reason = "no CUDA plugin";
  const kernels::Device compute = kernels::ComputeDevice(cpu);
  EXPECT_EQ(compute.type, kernels::DeviceType::kCpu);
  EXPECT_EQ(DescribeDevice(cpu, compute), "device cpu (2 threads) (no GPU in use: no CUDA plugin)");
}

TEST(DaemonDevice, ADeviceComputeDeviceIsNamedWithWhyOrHow) {
  kernels::SelectedDevice gpu;
  gpu.type = kernels::DeviceType::kCuda;
  gpu.name = "NVIDIA H200";
  EXPECT_EQ(DescribeDevice(gpu, kernels::Device{kernels::DeviceType::kCuda, 0}),
            "device NVIDIA H200; steps run on cuda:0 (device sessions: state and staging in "
            "device memory)");
  // The daemon's reason (e.g. the rules do not run on a device context yet) replaces the default.
  EXPECT_EQ(DescribeDevice(gpu, kernels::Device{kernels::DeviceType::kCpu, 0},
                           "steps run on the cpu: why"),
            "device NVIDIA H200; steps run on the cpu: why");
  EXPECT_EQ(DeviceLabel(kernels::DeviceType::kTest, 0), "test-device:0");
}

}  // namespace
}  // namespace diond::server
