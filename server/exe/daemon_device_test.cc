// The device wiring of the daemon (issue 10 item 6): the selected device reaches the compute
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

}  // namespace
}  // namespace diond::server
