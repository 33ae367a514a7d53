// GPU only (label `gpu`; skips without a CUDA device): a real sticky error through the CUDA
// plugin. A Fill into an address no allocation holds faults on the device (an illegal address,
// which loses the context for the rest of the process: hence a binary of its own); the plugin
// must then report it at the stream's wait, through device_health (what the daemon asks after
// every step to turn its health NOT_SERVING), and refuse every later entry with the same
// message (docs/GPU.md "Errors"). Never run here: this machine has no GPU.
#include <cstdint>
#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/context.h"
#include "kernels/device_runtime.h"
#include "kernels/ops.h"
#include "kernels/plugin/plugin_backend.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

constexpr Device kDev{DeviceType::kCuda, 0};

TEST(CudaLostContext, AnIllegalAddressIsNoticedByTheHealthEntryAndRefusesEverything) {
  absl::Status reg = RegisterCudaOps(DIOND_CUDA_PLUGIN);
  if (!reg.ok()) GTEST_SKIP() << "no CUDA device for the GPU test: " << reg;
  auto stream = DeviceRuntimeFor(kDev.type).create_stream(kDev);
  ASSERT_THAT(stream.status(), IsOk());
  ContextOptions o;
  o.device = kDev;
  o.stream = *stream;
  auto ctx = Context::Create(o);
  ASSERT_THAT(ctx.status(), IsOk());
  // Healthy first, and a real allocation works.
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).health(kDev), IsOk());
  auto ok = (*ctx)->Allocate(DType::kF32, {1024});
  ASSERT_THAT(ok.status(), IsOk());
  ASSERT_THAT(Fill(**ctx, 1.0f, ok->view()), IsOk());
  ASSERT_THAT(Synchronize(**ctx), IsOk());

  // 1 MiB of floats at 2^46 (64 TiB): far above any allocation of this process.
  void* bogus = reinterpret_cast<void*>(uintptr_t{1} << 46);
  const TensorView bad(bogus, ContiguousLayout(DType::kF32, {int64_t{1} << 18}), kDev);
  const absl::Status launched = Fill(**ctx, 2.0f, bad);  // the launch itself succeeds
  const absl::Status waited = Synchronize(**ctx);        // the fault shows at the wait
  EXPECT_FALSE(launched.ok() && waited.ok()) << "the Fill into unmapped memory did not fault";
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).health(kDev),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("context is lost")));
  // Every entry is refused from now on, with the same reason.
  EXPECT_FALSE((*ctx)->Allocate(DType::kF32, {16}).ok());  // Context::Allocate: no memory
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).last_allocation_error(), HasSubstr("context is lost"));
  EXPECT_THAT(Fill(**ctx, 3.0f, ok->view()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("context is lost")));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).memory_stats(kDev).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("context is lost")));
}

}  // namespace
}  // namespace diond::kernels
