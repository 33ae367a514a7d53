// GPU only (label `gpu`): a one-rank NCCL communicator through the CUDA plugin's C ABI. Creates
// it (unique id through an in-memory store), all-reduces a small device buffer, checks it.
// Skips without the plugin, a driver or a device.
#include "server/comm/nccl_communicator.h"

#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "server/comm/memory_store.h"

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

}  // namespace
}  // namespace diond::comm
