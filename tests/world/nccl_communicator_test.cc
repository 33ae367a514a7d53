// GPU only (label `gpu`): a one-rank NCCL communicator through the CUDA plugin's C ABI. Creates
// it (unique id through an in-memory store), all-reduces a small device buffer, checks it. Then
// the step path of a world device session (server/session/device_comm.h): a StepDeviceComm on a
// cuda:0 session Context queuing its collectives on the session's stream through that NCCL
// communicator (plugin ABI 2.1), whose inputs were written by ops still queued on the same stream
// (the stream must order them; no host wait comes between).
// Skips without the plugin, a driver or a device.
#include "server/comm/nccl_communicator.h"

#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/device.h"
#include "kernels/device_runtime.h"
#include "kernels/ops.h"
#include "kernels/plugin/plugin_backend.h"
#include "server/comm/gloo_communicator.h"
#include "server/comm/memory_store.h"
#include "server/session/device_comm.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;

TEST(NcclCommunicator, OneRankAllReduceOnTheDevice) {
  auto plugin = kernels::LoadCudaPlugin(DIOND_CUDA_PLUGIN);
  if (!plugin.ok()) GTEST_SKIP() << plugin.status();
  char err[256] = {0};
  if ((*plugin)->device_count(err, sizeof(err)) <= 0) GTEST_SKIP() << "no GPU: " << err;
  ASSERT_NE((*plugin)->nccl, nullptr);
  const DiondNcclApiV1* api = (*plugin)->nccl;

  MemoryKeyValueStore kv;
  NcclOptions o;
  o.prefix = "world/test/g1/";
  o.timeout = absl::Seconds(60);
  auto c = NcclCommunicator::Create(*plugin, &kv, o);
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_EQ((*c)->memory(), MemorySpace::kDevice);

  const size_t n = 1000;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  void* dev = nullptr;
  ASSERT_EQ(api->device_malloc(0, n * 4, &dev, err, sizeof(err)), 0) << err;
  ASSERT_EQ(api->copy_to_device(0, dev, host.data(), n * 4, err, sizeof(err)), 0) << err;
  ASSERT_THAT((*c)->AllReduceSum(absl::MakeSpan(static_cast<float*>(dev), n)), IsOk());
  ASSERT_THAT((*c)->Barrier(), IsOk());
  std::vector<float> back(n, -1.0f);
  ASSERT_EQ(api->copy_to_host(0, back.data(), dev, n * 4, err, sizeof(err)), 0) << err;
  api->device_free(0, dev);
  EXPECT_EQ(back, host);  // one rank: the sum is the input, exactly
  EXPECT_EQ((*c)->bytes_sent(), 0);
}

TEST(NcclCommunicator, AStepDeviceCommOrdersTheSessionStreamBeforeNccl) {
  auto plugin = kernels::LoadCudaPlugin(DIOND_CUDA_PLUGIN);
  if (!plugin.ok()) GTEST_SKIP() << plugin.status();
  char err[256] = {0};
  if ((*plugin)->device_count(err, sizeof(err)) <= 0) GTEST_SKIP() << "no GPU: " << err;
  ASSERT_THAT(kernels::RegisterCudaOps(DIOND_CUDA_PLUGIN), IsOk());
  const kernels::Device dev{kernels::DeviceType::kCuda, 0};
  auto stream = kernels::DeviceRuntimeFor(dev.type).create_stream(dev);
  ASSERT_THAT(stream.status(), IsOk());
  kernels::ContextOptions co;
  co.device = dev;
  co.stream = *stream;
  auto ctx = kernels::Context::Create(co);
  ASSERT_THAT(ctx.status(), IsOk());

  MemoryKeyValueStore kv;
  NcclOptions o;
  o.prefix = "world/test/g2/dev/";
  o.timeout = absl::Seconds(60);
  auto nccl = NcclCommunicator::Create(*plugin, &kv, o);
  ASSERT_THAT(nccl.status(), IsOk());
  GlooOptions go;
  go.prefix = "world/test/g2/gloo/";
  go.timeout = absl::Seconds(60);
  auto gloo = GlooCommunicator::Create(&kv, go);
  ASSERT_THAT(gloo.status(), IsOk());
  {
    session::StepDeviceComm c(ctx->get(), nullptr, std::shared_ptr<Communicator>(std::move(*gloo)),
                              std::shared_ptr<Communicator>(std::move(*nccl)));
    EXPECT_FALSE(c.staged());
    // Plugin ABI 2.1: the collectives are queued on the session's stream.
    EXPECT_TRUE(c.queued());
    EXPECT_EQ(c.backend(), "nccl+stream");
    const int64_t n = 1 << 22;  // 16 MiB: long enough for an unordered read to see it unwritten
    auto a = (*ctx)->Zeros(kernels::DType::kF32, {n});
    auto b = (*ctx)->Zeros(kernels::DType::kF32, {n});
    ASSERT_THAT(a.status(), IsOk());
    ASSERT_THAT(b.status(), IsOk());
    for (int round = 1; round <= 3; ++round) {
      // Queued on the session stream, and the collectives behind it on the same stream.
      ASSERT_THAT(kernels::Fill(**ctx, static_cast<float>(round), a->view()), IsOk());
      ASSERT_THAT(c.AllReduceSum(absl::MakeSpan(a->As<float>(), static_cast<size_t>(n))), IsOk());
      ASSERT_THAT(c.ReduceScatterSum(absl::MakeConstSpan(a->As<float>(), static_cast<size_t>(n)),
                                     absl::MakeSpan(b->As<float>(), static_cast<size_t>(n))),
                  IsOk());
      const std::vector<int64_t> counts = {n};
      ASSERT_THAT(c.AllGatherV(absl::MakeConstSpan(b->As<float>(), static_cast<size_t>(n)), counts,
                               absl::MakeSpan(a->As<float>(), static_cast<size_t>(n))),
                  IsOk());
      std::vector<float> back(static_cast<size_t>(n), -1.0f);
      ASSERT_THAT(kernels::CopyToHost(**ctx, a->cview(), kernels::MakeView(back.data(), {n})),
                  IsOk());
      size_t wrong = 0;
      for (float v : back) wrong += v != static_cast<float>(round) ? 1 : 0;
      EXPECT_EQ(wrong, 0u) << "round " << round << ": NCCL read the buffer before the session's "
                           << "Fill had run";
    }
    EXPECT_THAT(c.DeviceStatus(), IsOk());
  }
  ctx->reset();
  kernels::DeviceRuntimeFor(dev.type).destroy_stream(dev, *stream);
}

}  // namespace
}  // namespace diond::comm
