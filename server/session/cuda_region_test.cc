// The daemon side of CUDA regions, in process on the TEST backend's emulation of the plugin's
// handoff block (kernels/testing/host_device_backend.h): the trainer's UUID mapped to the
// daemon's device (FAILED_PRECONDITION with both UUIDs for an unknown GPU or one that is not the
// compute device, nothing opened), the handle opened and checked against the region's range,
// the region bound to a device session (a host session refuses it) and released on
// UnregisterRegion, with the session, and when a new trainer attaches; the weights moved in and
// out of it by SetState / GetState / a new trainer through the device session's explicit copies;
// the streamed host paths refused; no leaks (counts).
#include "server/memory/cuda_region.h"

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"
#include "server/session/session.h"

namespace diond::session {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;
namespace kt = ::diond::kernels::testing;

constexpr kernels::Device kDev0{kernels::DeviceType::kTest, 0};
constexpr kernels::Device kDev1{kernels::DeviceType::kTest, 1};

memory::GpuUuid Uuid(int device) {
  const auto u = kt::HostTestDeviceUuid(device);
  memory::GpuUuid g;
  std::copy(u.begin(), u.end(), g.begin());
  return g;
}

class CudaRegionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kernels::UnregisterOpsBackendForTest(kernels::DeviceType::kTest);
    ASSERT_THAT(kernels::RegisterPluginOps(kernels::DeviceType::kTest, kt::HostTestDeviceOps()),
                IsOk());
    live_ = memory::CudaRegion::LiveCount();
    counters_ = kt::GetHostTestHandoffCounters();
  }
  void TearDown() override {
    EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
    const auto now = kt::GetHostTestHandoffCounters();
    EXPECT_EQ(now.ipc_open_now, counters_.ipc_open_now);
    EXPECT_EQ(now.vmm_mapped_now, counters_.vmm_mapped_now);
    for (void* p : allocations_) kt::HostTestDeviceOps()->deallocate(0, nullptr, p, 0);
    kernels::UnregisterOpsBackendForTest(kernels::DeviceType::kTest);
  }
  void* Alloc(size_t bytes) {
    char err[128] = {0};
    DiondOpsCall call{0, nullptr, err, sizeof(err)};
    void* p = nullptr;
    EXPECT_EQ(kt::HostTestDeviceOps()->allocate(&call, bytes, &p), DIOND_OPS_OK) << err;
    allocations_.push_back(p);
    return p;
  }
  std::vector<uint8_t> Handle(void* p) {
    std::vector<uint8_t> h(DIOND_CUDA_IPC_HANDLE_BYTES);
    EXPECT_TRUE(kt::HostTestExportIpcMemHandle(0, p, h.data()));
    return h;
  }
  static SessionSpec Spec() {
    SessionSpec spec;
    spec.client_name = "cuda-region-test";
    GroupSpec g;
    g.name = "a";
    g.config.algorithm = optim::AlgorithmKind::kAdamW;
    spec.groups.push_back(g);
    spec.params.push_back({"w", {16, 8}, DType::kF32, "a"});
    return spec;
  }
  // A host session (no context: the CPU).
  static std::unique_ptr<Session> NewHostSession() {
    auto s = Session::Create("s-host", Spec());
    EXPECT_THAT(s.status(), IsOk());
    return s.ok() ? *std::move(s) : nullptr;
  }
  // A device session on TEST device 0 (no hooks: no stream of its own).
  std::unique_ptr<Session> NewSession() {
    kernels::ContextOptions co;
    co.device = kDev0;
    co.num_threads = 1;
    auto ctx = kernels::Context::Create(co);
    EXPECT_THAT(ctx.status(), IsOk());
    if (!ctx.ok()) return nullptr;
    device_ctx_ = *std::move(ctx);
    auto s = Session::Create("s-cuda", Spec(), device_ctx_.get());
    EXPECT_THAT(s.status(), IsOk());
    if (s.ok()) {
      EXPECT_TRUE((*s)->is_device_session());
    }
    return s.ok() ? *std::move(s) : nullptr;
  }

  std::unique_ptr<kernels::Context> device_ctx_;
  int64_t live_ = 0;
  kt::HostTestHandoffCounters counters_;
  std::vector<void*> allocations_;
};

TEST_F(CudaRegionTest, UnknownGpuAndWrongDeviceAreRefusedWithBothUuidsAndOpenNothing) {
  void* p = Alloc(4096);
  const auto h = Handle(p);
  memory::GpuUuid stranger = Uuid(0);
  stranger[0] ^= 0xff;
  auto r = memory::CudaRegion::OpenIpc(kDev0, stranger, h, 0, 4096);
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(absl::StrContains(r.status().message(), memory::FormatGpuUuid(stranger)))
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), memory::FormatGpuUuid(Uuid(0))))
      << r.status();
  // The trainer's GPU is the daemon's device 1, but the daemon computes on device 0.
  r = memory::CudaRegion::OpenIpc(kDev0, Uuid(1), h, 0, 4096);
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("is this daemon's device 1")));
  EXPECT_TRUE(absl::StrContains(r.status().message(), memory::FormatGpuUuid(Uuid(0))))
      << r.status();
  // A CPU daemon.
  r = memory::CudaRegion::OpenIpc(kernels::Device{}, Uuid(0), h, 0, 4096);
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CPU")));
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_opens, counters_.ipc_opens);
}

TEST_F(CudaRegionTest, IpcRegionIsCheckedAgainstTheAllocationAndClosedWhenDropped) {
  void* p = Alloc(8192);
  const auto h = Handle(p);
  // Past the end of the allocation: OUT_OF_RANGE, and the handle is closed again.
  auto bad = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 4096, 8192);
  EXPECT_THAT(bad.status(), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("8192 bytes")));
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, counters_.ipc_open_now);
  {
    auto r = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 4096, 4096);
    ASSERT_THAT(r.status(), IsOk());
    EXPECT_EQ((*r)->data(), static_cast<uint8_t*>(p) + 4096);
    EXPECT_EQ((*r)->device().index, 0);
    EXPECT_EQ(memory::CudaRegion::LiveCount(), live_ + 1);
    EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, counters_.ipc_open_now + 1);
  }
  // Closed twice in all: after the refused range, and when the region was dropped.
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_closes, counters_.ipc_closes + 2);
}

TEST_F(CudaRegionTest, VmmRegionRoundsToTheGranularityAndUnmapsWhenDropped) {
  constexpr int64_t g = static_cast<int64_t>(kt::kHostTestVmmGranularity);
  void* p = Alloc(2 * g);
  const int fd = kt::HostTestExportVmmFd(0, p);
  ASSERT_GE(fd, 0);
  EXPECT_THAT(memory::CudaRegion::OpenVmm(kDev0, Uuid(0), fd, 0, g, 3).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power-of-two")));
  EXPECT_THAT(memory::CudaRegion::OpenVmm(kDev0, Uuid(0), fd, g, 2 * g, g).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exceeds")));
  {
    auto r = memory::CudaRegion::OpenVmm(kDev0, Uuid(0), fd, 256, g, g);  // maps 2 granules
    ASSERT_THAT(r.status(), IsOk());
    EXPECT_TRUE((*r)->vmm());
    EXPECT_EQ((*r)->data(), static_cast<uint8_t*>(p) + 256);
    EXPECT_EQ(kt::GetHostTestHandoffCounters().vmm_mapped_now, counters_.vmm_mapped_now + 1);
  }
  EXPECT_EQ(kt::GetHostTestHandoffCounters().vmm_unmaps, counters_.vmm_unmaps + 1);
  close(fd);
}

TEST_F(CudaRegionTest, AHostSessionRefusesACudaRegion) {
  void* p = Alloc(1 << 16);
  const auto h = Handle(p);
  auto s = NewHostSession();
  ASSERT_NE(s, nullptr);
  auto r = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 0, s->layout().param_arena_bytes);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_THAT(s->RegisterCudaRegion(Role::kParameters, *std::move(r)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("steps on the host")));
  // OpenCudaRegion opens nothing for it.
  bool opened = false;
  auto open = [&](kernels::Device d) -> absl::StatusOr<std::unique_ptr<memory::CudaRegion>> {
    opened = true;
    return memory::CudaRegion::OpenIpc(d, Uuid(0), h, 0, 4096);
  };
  EXPECT_THAT(s->OpenCudaRegion(Role::kGradients, open).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device session")));
  EXPECT_FALSE(opened);
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
}

TEST_F(CudaRegionTest, ADeviceSessionBindsReleasesAndMovesWeightsOnlyThroughCopies) {
  constexpr size_t kBytes = 1 << 16;
  void* p = Alloc(kBytes);
  // A known pattern (the allocation is uninitialized; ASan fills it with 0xbe): the refused host
  // paths may change no byte of it.
  std::memset(p, 0x5a, kBytes);
  const auto h = Handle(p);
  auto s = NewSession();
  ASSERT_NE(s, nullptr);
  const int64_t need = s->layout().param_arena_bytes;
  // Too small for the arena.
  auto small = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 0, need - 4);
  ASSERT_THAT(small.status(), IsOk());
  EXPECT_THAT(s->RegisterCudaRegion(Role::kParameters, *std::move(small)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("smaller")));
  auto id = s->OpenCudaRegion(Role::kParameters, [&](kernels::Device d) {
    return memory::CudaRegion::OpenIpc(d, Uuid(0), h, 0, need);
  });
  ASSERT_THAT(id.status(), IsOk());
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_ + 1);
  // The role is taken (by either kind).
  EXPECT_THAT(s->RegisterShmRegion(Role::kParameters, "nope", 0, need).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already has region")));
  {
    // A second region of the same handle shares its one mapping (a handle opens once per
    // process); the mapping stays open while the first region holds it.
    const int64_t open_now = kt::GetHostTestHandoffCounters().ipc_open_now;
    auto g = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 256, 256);
    ASSERT_THAT(g.status(), IsOk());
    EXPECT_EQ((*g)->data(), static_cast<uint8_t*>(p) + 256);
    EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, open_now);
    EXPECT_EQ(memory::CudaRegion::LiveCount(), live_ + 2);
  }
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, counters_.ipc_open_now + 1);
  // The streamed host path refuses device memory: PushGradients into a CUDA GRADIENTS region.
  auto gid = s->OpenCudaRegion(Role::kGradients, [&](kernels::Device d) {
    return memory::CudaRegion::OpenIpc(d, Uuid(0), h, kBytes / 2, s->layout().grad_arena_bytes);
  });
  ASSERT_THAT(gid.status(), IsOk());
  TensorWrite push{"w", 0, std::string(512, '\0')};
  EXPECT_THAT(s->ApplyGradientWrites({push}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("reads and writes it")));
  ASSERT_THAT(s->UnregisterRegion(*gid), IsOk());
  const uint8_t* bytes = static_cast<const uint8_t*>(p);
  EXPECT_EQ(std::count(bytes, bytes + kBytes, uint8_t{0x5a}), static_cast<std::ptrdiff_t>(kBytes))
      << "a host path wrote into the region";
  // SetState writes the weights into the region (explicit copies), GetState reads them back.
  std::vector<float> values(128);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 3.0f;
  const auto before = kt::GetHostTestDeviceCounters();
  ASSERT_THAT(s->SetState({NamedTensor{"w", {16, 8}, values}}), IsOk());
  EXPECT_EQ(std::memcmp(p, values.data(), values.size() * 4), 0);
  EXPECT_EQ(bytes[values.size() * 4], uint8_t{0x5a}) << "written past the parameter";
  auto state = s->GetState(/*include_parameters=*/true);
  ASSERT_THAT(state.status(), IsOk());
  ASSERT_EQ((*state)[0].name, "w");
  EXPECT_EQ((*state)[0].data, values);
  std::string out;  // PullParameters' read: through a copy too
  ASSERT_THAT(s->ReadParameterBytes("w", 8, 8, &out), IsOk());
  EXPECT_EQ(out, std::string(reinterpret_cast<const char*>(values.data()) + 8, 8));
  const auto after = kt::GetHostTestDeviceCounters();
  EXPECT_GE(after.copies_to_device, before.copies_to_device + 1);
  EXPECT_GE(after.copies_to_host, before.copies_to_host + 1);
  // Unregister releases it.
  ASSERT_THAT(s->UnregisterRegion(*id), IsOk());
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
  // Bound again, then released with the session.
  auto again = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 0, need);
  ASSERT_THAT(again.status(), IsOk());
  ASSERT_THAT(s->RegisterCudaRegion(Role::kParameters, *std::move(again)).status(), IsOk());
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_ + 1);
  s.reset();
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
}

TEST_F(CudaRegionTest, ANewTrainersRegionGetsTheWeightsTheOldTrainersRegionHeld) {
  void* old_mem = Alloc(1 << 16);
  void* new_mem = Alloc(1 << 16);
  auto s = NewSession();
  ASSERT_NE(s, nullptr);
  const int64_t need = s->layout().param_arena_bytes;
  auto r = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), Handle(old_mem), 0, need);
  ASSERT_THAT(r.status(), IsOk());
  ASSERT_THAT(s->RegisterCudaRegion(Role::kParameters, *std::move(r)).status(), IsOk());
  std::vector<float> values(128);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 1.5f - 0.125f * static_cast<float>(i);
  ASSERT_THAT(s->SetState({NamedTensor{"w", {16, 8}, values}}), IsOk());
  s->DetachTrainer();
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
  std::memset(new_mem, 0, 1 << 16);
  auto r2 = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), Handle(new_mem), 0, need);
  ASSERT_THAT(r2.status(), IsOk());
  ASSERT_THAT(s->RegisterCudaRegion(Role::kParameters, *std::move(r2)).status(), IsOk());
  EXPECT_EQ(std::memcmp(new_mem, values.data(), values.size() * 4), 0);
}

TEST_F(CudaRegionTest, ANewTrainerAttachingReleasesTheOldTrainersRegions) {
  void* p = Alloc(1 << 16);
  const auto h = Handle(p);
  auto s = NewSession();
  ASSERT_NE(s, nullptr);
  auto r = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 0, s->layout().grad_arena_bytes);
  ASSERT_THAT(r.status(), IsOk());
  ASSERT_THAT(s->RegisterCudaRegion(Role::kGradients, *std::move(r)).status(), IsOk());
  s->DetachTrainer();
  EXPECT_EQ(memory::CudaRegion::LiveCount(), live_);
  // A thousand bind/unbind cycles leave nothing open.
  for (int i = 0; i < 1000; ++i) {
    auto c = memory::CudaRegion::OpenIpc(kDev0, Uuid(0), h, 0, s->layout().grad_arena_bytes);
    ASSERT_THAT(c.status(), IsOk());
    auto id = s->RegisterCudaRegion(Role::kGradients, *std::move(c));
    ASSERT_THAT(id.status(), IsOk());
    ASSERT_THAT(s->UnregisterRegion(*id), IsOk());
  }
  EXPECT_EQ(kt::GetHostTestHandoffCounters().ipc_open_now, counters_.ipc_open_now);
  (void)kDev1;
}

}  // namespace
}  // namespace diond::session
