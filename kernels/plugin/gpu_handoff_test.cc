// The GPU half's device objects (the handoff block of the plugin ABI) through the adapter
// (plugin_backend.h) on the TEST backend's emulation: device UUIDs, legacy IPC memory handles,
// VMM fds and interprocess events, with every refusal the CUDA entries make (bad, unknown,
// freed, closed, twice-opened, foreign-device handles; bad sizes and granularities), and the
// live-object counts back to zero (no leaks).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

constexpr Device kDev0{DeviceType::kTest, 0};
constexpr Device kDev1{DeviceType::kTest, 1};
using Handle = std::vector<uint8_t>;

class GpuHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UnregisterOpsBackendForTest(DeviceType::kTest);
    ASSERT_THAT(RegisterPluginOps(DeviceType::kTest, testing::HostTestDeviceOps()), IsOk());
    before_ = testing::GetHostTestHandoffCounters();
  }
  void TearDown() override {
    for (void* p : allocations_) {
      testing::HostTestDeviceOps()->deallocate(0, nullptr, p, 0);
    }
    // Nothing opened by a test stays open.
    const auto now = testing::GetHostTestHandoffCounters();
    EXPECT_EQ(now.ipc_open_now, before_.ipc_open_now);
    EXPECT_EQ(now.vmm_mapped_now, before_.vmm_mapped_now);
    EXPECT_EQ(now.events_open_now, before_.events_open_now);
    UnregisterOpsBackendForTest(DeviceType::kTest);
  }
  // A TEST-device allocation (the "trainer's" memory), freed at TearDown unless taken back.
  void* Alloc(size_t bytes) {
    char err[256] = {0};
    DiondOpsCall call{0, nullptr, err, sizeof(err)};
    void* p = nullptr;
    EXPECT_EQ(testing::HostTestDeviceOps()->allocate(&call, bytes, &p), DIOND_OPS_OK) << err;
    allocations_.push_back(p);
    return p;
  }
  void Free(void* p) {
    testing::HostTestDeviceOps()->deallocate(0, nullptr, p, 0);
    allocations_.erase(std::find(allocations_.begin(), allocations_.end(), p));
  }
  Handle MemHandle(void* p, int device = 0) {
    Handle h(DIOND_CUDA_IPC_HANDLE_BYTES);
    EXPECT_TRUE(testing::HostTestExportIpcMemHandle(device, p, h.data()));
    return h;
  }

  std::vector<void*> allocations_;
  testing::HostTestHandoffCounters before_;
};

TEST_F(GpuHandoffTest, DeviceUuidsListEveryDeviceInIndexOrder) {
  auto uuids = DeviceRuntimeFor(DeviceType::kTest).device_uuids();
  ASSERT_THAT(uuids.status(), IsOk());
  ASSERT_EQ(uuids->size(), static_cast<size_t>(testing::kHostTestDeviceCount));
  for (int i = 0; i < testing::kHostTestDeviceCount; ++i) {
    EXPECT_EQ((*uuids)[i], testing::HostTestDeviceUuid(i)) << i;
  }
  EXPECT_NE((*uuids)[0], (*uuids)[1]);
  // Nothing adapted for CUDA here.
  EXPECT_THAT(DeviceRuntimeFor(DeviceType::kCuda).device_uuids().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(GpuHandoffTest, IpcMemHandleOpensTheExportersAllocationAndClosesOnce) {
  void* p = Alloc(4096);
  std::memset(p, 0x5a, 4096);
  const Handle h = MemHandle(p);
  auto m = DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, h);
  ASSERT_THAT(m.status(), IsOk());
  EXPECT_EQ(m->ptr, p);
  EXPECT_EQ(m->bytes, 4096u);
  EXPECT_EQ(static_cast<uint8_t*>(m->ptr)[4095], 0x5a);
  // Open twice in one process: refused, as CUDA does.
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, h).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("open already")));
  EXPECT_EQ(testing::GetHostTestHandoffCounters().ipc_open_now, before_.ipc_open_now + 1);
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).close_ipc_mem_handle(kDev0, m->ptr), IsOk());
  // Closed: a second close is refused; the handle can be opened again.
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).close_ipc_mem_handle(kDev0, m->ptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not an open")));
  auto again = DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, h);
  ASSERT_THAT(again.status(), IsOk());
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).close_ipc_mem_handle(kDev0, again->ptr), IsOk());
}

TEST_F(GpuHandoffTest, BadUnknownFreedAndMisSizedIpcHandlesAreRefused) {
  void* p = Alloc(1024);
  Handle h = MemHandle(p);
  // Not 64 bytes: the adapter's own check.
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, Handle(63)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("64 bytes")));
  // Garbage, and a well-formed handle nobody exported.
  Handle garbage(DIOND_CUDA_IPC_HANDLE_BYTES, 0xee);
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, garbage).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a CUDA IPC")));
  Handle unknown = h;
  unknown[8] ^= 0x7f;
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, unknown).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unknown")));
  // A device the backend does not have.
  EXPECT_THAT(DeviceRuntimeFor(DeviceType::kTest)
                  .open_ipc_mem_handle(Device{DeviceType::kTest, 7}, h)
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no device 7")));
  // The exporter freed the memory.
  Free(p);
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, h).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("freed")));
  // Not a pointer this backend handed out: nothing to export.
  int local = 0;
  Handle none(DIOND_CUDA_IPC_HANDLE_BYTES);
  EXPECT_FALSE(testing::HostTestExportIpcMemHandle(0, &local, none.data()));
}

TEST_F(GpuHandoffTest, VmmFdMapsWithGranularityChecksAndUnmapsOnce) {
  constexpr uint64_t g = testing::kHostTestVmmGranularity;
  void* p = Alloc(4 * g);
  const int fd = testing::HostTestExportVmmFd(0, p);
  ASSERT_GE(fd, 0);
  auto m = DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, fd, 2 * g, g);
  ASSERT_THAT(m.status(), IsOk());
  EXPECT_EQ(m->ptr, p);
  EXPECT_EQ(m->bytes, 2 * g);
  EXPECT_EQ(testing::GetHostTestHandoffCounters().vmm_mapped_now, before_.vmm_mapped_now + 1);
  // Sizes: not a multiple (adapter), a granularity below the allocation's, more than exported.
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, fd, g + 1, g).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple")));
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, fd, g, g / 2).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("minimum granularity")));
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, fd, 8 * g, g).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exceeds")));
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, -1, g, g).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // An fd of something else.
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).import_vmm_fd(kDev0, pipefd[0], g, g).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a VMM")));
  close(pipefd[0]);
  close(pipefd[1]);
  // Unmap: another range refused, then once, then never again.
  VmmMapping wrong = *m;
  wrong.bytes = g;
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).unmap_vmm(kDev0, wrong),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another range")));
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).unmap_vmm(kDev0, *m), IsOk());
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).unmap_vmm(kDev0, *m),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a live")));
  close(fd);
}

TEST_F(GpuHandoffTest, IpcEventsWaitAndRecordOnStreamsOfTheirDevice) {
  Handle h(DIOND_CUDA_IPC_HANDLE_BYTES);
  ASSERT_TRUE(testing::HostTestCreateIpcEvent(0, h.data()));
  auto stream = DeviceRuntimeFor(kDev0.type).create_stream(kDev0);
  ASSERT_THAT(stream.status(), IsOk());
  auto e = DeviceRuntimeFor(kDev0.type).open_ipc_event(kDev0, h);
  ASSERT_THAT(e.status(), IsOk());
  const auto c0 = testing::GetHostTestHandoffCounters();
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).stream_wait_event(kDev0, *stream, *e), IsOk());
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).record_event(kDev0, *stream, *e), IsOk());
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).record_event(kDev0, *stream, *e), IsOk());
  const auto c1 = testing::GetHostTestHandoffCounters();
  EXPECT_EQ(c1.stream_waits - c0.stream_waits, 1);
  EXPECT_EQ(c1.event_records - c0.event_records, 2);
  EXPECT_EQ(testing::HostTestEventRecords(h.data()), 2);
  // A stream the backend did not create; an event of another device; a bad handle.
  int bogus = 0;
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).stream_wait_event(kDev0, &bogus, *e),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("unknown stream")));
  EXPECT_THAT(DeviceRuntimeFor(kDev1.type).open_ipc_event(kDev1, h).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("created on device 0")));
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type)
                  .open_ipc_event(kDev0, Handle(DIOND_CUDA_IPC_HANDLE_BYTES, 1))
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a CUDA IPC event")));
  ASSERT_THAT(DeviceRuntimeFor(kDev0.type).destroy_event(kDev0, *e), IsOk());
  // Destroyed: every use refused.
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).destroy_event(kDev0, *e),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a live event")));
  EXPECT_THAT(DeviceRuntimeFor(kDev0.type).record_event(kDev0, *stream, *e),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a live event")));
  DeviceRuntimeFor(kDev0.type).destroy_stream(kDev0, *stream);
}

TEST_F(GpuHandoffTest, AThousandOpenCloseCyclesLeaveNothingOpen) {
  void* p = Alloc(512);
  const Handle h = MemHandle(p);
  Handle eh(DIOND_CUDA_IPC_HANDLE_BYTES);
  ASSERT_TRUE(testing::HostTestCreateIpcEvent(1, eh.data()));
  for (int i = 0; i < 1000; ++i) {
    auto m = DeviceRuntimeFor(kDev0.type).open_ipc_mem_handle(kDev0, h);
    ASSERT_THAT(m.status(), IsOk());
    ASSERT_THAT(DeviceRuntimeFor(kDev0.type).close_ipc_mem_handle(kDev0, m->ptr), IsOk());
    auto e = DeviceRuntimeFor(kDev1.type).open_ipc_event(kDev1, eh);
    ASSERT_THAT(e.status(), IsOk());
    ASSERT_THAT(DeviceRuntimeFor(kDev1.type).destroy_event(kDev1, *e), IsOk());
  }
  const auto now = testing::GetHostTestHandoffCounters();
  EXPECT_EQ(now.ipc_opens - before_.ipc_opens, 1000);
  EXPECT_EQ(now.ipc_closes - before_.ipc_closes, 1000);
  EXPECT_EQ(now.events_opened - before_.events_opened, 1000);
  EXPECT_EQ(now.events_destroyed - before_.events_destroyed, 1000);
}

}  // namespace
}  // namespace diond::kernels
