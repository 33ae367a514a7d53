// StepDeviceComm (device_comm.h) on the TEST backend in strict mode (its "device" memory faults
// on any host access outside the backend's entries), two ranks on threads:
// - staged over Gloo: every collective on device buffers gives the values computed here by hand
//   (the exact copy counts of a whole world step are checked by tests/world's
//   DeviceWorld.CopiesCarryOnlyWhatTheCollectivesNeed);
// - forwarded to a device communicator (what NCCL is on a GPU daemon): the same device pointers
//   reach it, after the session's stream was waited for (one sync before the call), and the
//   host communicator is never used.
#include "server/session/device_comm.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"
#include "server/comm/gloo_communicator.h"
#include "server/comm/memory_store.h"
#include "server/comm/nccl_communicator.h"

namespace diond::session {
namespace {

using ::diond::testing::IsOk;
using kernels::Buffer;
using kernels::Context;
using kernels::DType;

constexpr kernels::Device kDev{kernels::DeviceType::kTest, 0};

class DeviceComm : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_THAT(device_.status(), IsOk()); }
  kernels::testing::ScopedHostTestDevice device_{/*strict=*/true};
};

// One rank's device side: a stream and a Context on it.
struct Rank {
  std::unique_ptr<kernels::testing::HostTestStreamContext> sc;
  Context* ctx = nullptr;
  Rank() {
    auto s = kernels::testing::HostTestStreamContext::Create(kDev);
    EXPECT_THAT(s.status(), IsOk());
    sc = std::move(*s);
    ctx = &sc->ctx();
  }
  Buffer Up(const std::vector<float>& v) {
    auto b = ctx->Allocate(DType::kF32, {static_cast<int64_t>(v.size())});
    EXPECT_THAT(b.status(), IsOk());
    EXPECT_THAT(kernels::CopyFromHost(
                    *ctx, kernels::MakeView(v.data(), {static_cast<int64_t>(v.size())}), b->view()),
                IsOk());
    return std::move(*b);
  }
  std::vector<float> Down(const Buffer& b) {
    std::vector<float> v(static_cast<size_t>(b.NumElements()));
    EXPECT_THAT(
        kernels::CopyToHost(*ctx, b.cview(), kernels::MakeView(v.data(), {b.NumElements()})),
        IsOk());
    return v;
  }
};

absl::Span<float> S(Buffer& b) {
  return absl::MakeSpan(b.As<float>(), static_cast<size_t>(b.NumElements()));
}

// Runs body(rank, comm, device side) on two ranks joined by Gloo, staged.
void TwoRanks(const std::string& prefix,
              const std::function<void(int, StepDeviceComm&, Rank&)>& body) {
  comm::MemoryKeyValueStore kv;
  // Neither rank closes its Gloo pairs before both finished `body`: a rank whose last
  // collective (a barrier) returned first would otherwise close them under a peer still in it
  // ("Connection closed by peer").
  std::atomic<int> done{0};
  std::thread peers[2];
  for (int r = 0; r < 2; ++r) {
    peers[r] = std::thread([&, r] {
      comm::GlooOptions o;
      o.rank = r;
      o.size = 2;
      o.prefix = prefix;
      o.timeout = absl::Seconds(10);
      auto host = comm::GlooCommunicator::Create(&kv, o);
      ASSERT_THAT(host.status(), IsOk());
      Rank dev;
      StepDeviceComm c(dev.ctx, nullptr, std::shared_ptr<comm::Communicator>(std::move(*host)),
                       nullptr);
      EXPECT_TRUE(c.staged());
      EXPECT_EQ(c.backend(), "gloo+staged");
      EXPECT_EQ(c.memory(), comm::MemorySpace::kDevice);
      body(r, c, dev);
      done.fetch_add(1);
      while (done.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  }
  for (auto& t : peers) t.join();
}

TEST_F(DeviceComm, StagedCollectivesOnDeviceBuffersGiveTheHostResults) {
  TwoRanks("staged/", [](int r, StepDeviceComm& c, Rank& dev) {
    const float k = static_cast<float>(r + 1);  // rank 0 holds 1s, rank 1 holds 2s (scaled)
    {                                           // all-reduce, sum and average, in place
      Buffer b = dev.Up({1 * k, 10 * k, 100 * k});
      ASSERT_THAT(c.AllReduceSum(S(b)), IsOk());
      EXPECT_EQ(dev.Down(b), (std::vector<float>{3, 30, 300}));
      Buffer a = dev.Up({2 * k, 4 * k});
      ASSERT_THAT(c.AllReduceAverage(S(a)), IsOk());
      EXPECT_EQ(dev.Down(a), (std::vector<float>{3, 6}));
    }
    {  // reduce-scatter: block r of the sum
      Buffer in = dev.Up({1 * k, 2 * k, 3 * k, 4 * k});
      Buffer out = dev.Up({-1, -1});
      ASSERT_THAT(c.ReduceScatterSum(S(in), S(out)), IsOk());
      EXPECT_EQ(dev.Down(out), r == 0 ? (std::vector<float>{3, 6}) : (std::vector<float>{9, 12}));
    }
    {  // all-gather, all-gather-v (3 floats from rank 0, 1 from rank 1), all-to-all
      Buffer in = dev.Up({k, -k});
      Buffer out = dev.Up({0, 0, 0, 0});
      ASSERT_THAT(c.AllGather(S(in), S(out)), IsOk());
      EXPECT_EQ(dev.Down(out), (std::vector<float>{1, -1, 2, -2}));
      const std::vector<int64_t> counts = {3, 1};
      Buffer vin = r == 0 ? dev.Up({7, 8, 9}) : dev.Up({5});
      Buffer vout = dev.Up({0, 0, 0, 0});
      ASSERT_THAT(c.AllGatherV(S(vin), counts, S(vout)), IsOk());
      EXPECT_EQ(dev.Down(vout), (std::vector<float>{7, 8, 9, 5}));
      Buffer ain = dev.Up({10 * k, 20 * k});
      Buffer aout = dev.Up({0, 0});
      ASSERT_THAT(c.AllToAll(S(ain), S(aout)), IsOk());
      // Block j of the output: rank j's block r.
      EXPECT_EQ(dev.Down(aout),
                r == 0 ? (std::vector<float>{10, 20}) : (std::vector<float>{20, 40}));
    }
    {  // broadcast from rank 1
      Buffer b = dev.Up({k, k, k});
      ASSERT_THAT(c.Broadcast(S(b), 1), IsOk());
      EXPECT_EQ(dev.Down(b), (std::vector<float>{2, 2, 2}));
    }
    {                                    // the byte forms, on device memory too
      std::vector<float> host_bytes(1);  // 4 bytes per rank
      uint8_t v[4] = {static_cast<uint8_t>(r), 1, 2, 3};
      std::memcpy(host_bytes.data(), v, 4);
      Buffer bytes_in = dev.Up(host_bytes);
      Buffer bytes_out = dev.Up({0, 0});
      ASSERT_THAT(c.AllGatherBytes(absl::MakeConstSpan(bytes_in.As<uint8_t>(), 4),
                                   absl::MakeSpan(bytes_out.As<uint8_t>(), 8)),
                  IsOk());
      std::vector<float> got = dev.Down(bytes_out);
      uint8_t g[8];
      std::memcpy(g, got.data(), 8);
      EXPECT_EQ(g[0], 0);
      EXPECT_EQ(g[4], 1);
      EXPECT_EQ(g[5], 1);
      ASSERT_THAT(c.BroadcastBytes(absl::MakeSpan(bytes_in.As<uint8_t>(), 4), 0), IsOk());
      std::memcpy(g, dev.Down(bytes_in).data(), 4);
      EXPECT_EQ(g[0], 0);  // rank 0's first byte everywhere
    }
    EXPECT_THAT(c.Barrier(), IsOk());
  });
}

TEST_F(DeviceComm, StagedArgumentErrorsComeBeforeAnyCopy) {
  TwoRanks("errors/", [](int, StepDeviceComm& c, Rank& dev) {
    Buffer in = dev.Up({1, 2});
    Buffer out = dev.Up({0, 0, 0});
    const std::vector<int64_t> bad = {1, 1};  // sums to 2, output holds 3
    EXPECT_EQ(c.AllGatherV(S(in), bad, S(out)).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.Broadcast(S(in), 5).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.Barrier(), IsOk());  // the world is still in step
  });
}

// What the world's device communicator (NCCL on a GPU daemon) sees: a one-rank recorder.
class RecordingDeviceComm final : public comm::Communicator {
 public:
  RecordingDeviceComm() : comm::Communicator(0, 1, nullptr) {}
  comm::MemorySpace memory() const override { return comm::MemorySpace::kDevice; }
  absl::string_view backend() const override { return "recording"; }
  absl::Status AllReduceSum(absl::Span<float> d) override { return Seen(d.data()); }
  absl::Status AllReduceAverage(absl::Span<float> d) override { return Seen(d.data()); }
  absl::Status ReduceScatterSum(absl::Span<const float> i, absl::Span<float>) override {
    return Seen(i.data());
  }
  absl::Status AllGather(absl::Span<const float> i, absl::Span<float>) override {
    return Seen(i.data());
  }
  absl::Status AllGatherV(absl::Span<const float> i, absl::Span<const int64_t>,
                          absl::Span<float>) override {
    return Seen(i.data());
  }
  absl::Status AllToAll(absl::Span<const float> i, absl::Span<float>) override {
    return Seen(i.data());
  }
  absl::Status Broadcast(absl::Span<float> d, int) override { return Seen(d.data()); }
  absl::Status Barrier() override { return Seen(nullptr); }
  absl::Status AllGatherBytes(absl::Span<const uint8_t> i, absl::Span<uint8_t>) override {
    return Seen(i.data());
  }
  absl::Status BroadcastBytes(absl::Span<uint8_t> d, int) override { return Seen(d.data()); }

  // Stream-ordered like NCCL with plugin ABI 2.1 (`queues`): OnStream gives `view`, a recorder
  // that keeps the stream it was made for. Poll reports `async_error` (NCCL's asynchronous error).
  absl::StatusOr<std::unique_ptr<comm::Communicator>> OnStream(void* stream) override {
    if (!queues) return comm::Communicator::OnStream(stream);
    auto v = std::make_unique<RecordingDeviceComm>();
    view = v.get();
    view_stream = stream;
    return std::unique_ptr<comm::Communicator>(std::move(v));
  }
  absl::Status Poll() override {
    if (!async_error.ok()) Abort(async_error);
    return status();
  }

  std::vector<const void*> pointers;
  bool queues = false;
  RecordingDeviceComm* view = nullptr;
  void* view_stream = nullptr;
  absl::Status async_error;

 private:
  absl::Status Seen(const void* p) {
    pointers.push_back(p);
    return absl::OkStatus();
  }
};

TEST_F(DeviceComm, ADeviceCommunicatorGetsTheSamePointersAfterTheStreamIsWaitedFor) {
  Rank dev;
  // The host communicator is never used on this path: a recorder too, so any use shows.
  auto host = std::make_shared<RecordingDeviceComm>();
  auto device = std::make_shared<RecordingDeviceComm>();
  StepDeviceComm c(dev.ctx, nullptr, host, device);
  EXPECT_FALSE(c.staged());
  EXPECT_EQ(c.backend(), "recording");
  Buffer b = dev.Up({1, 2, 3, 4});
  const auto syncs0 = kernels::testing::GetHostTestDeviceCounters().syncs;
  // Work queued on the session stream (a Fill is deferred until the host waits).
  ASSERT_THAT(kernels::Fill(*dev.ctx, 5.0f, b.view()), IsOk());
  ASSERT_THAT(c.AllReduceSum(S(b)), IsOk());
  const auto syncs1 = kernels::testing::GetHostTestDeviceCounters().syncs;
  EXPECT_EQ(syncs1 - syncs0, 1) << "the session's stream must be waited for before the call";
  ASSERT_THAT(c.AllGather(absl::MakeConstSpan(b.As<float>(), 2), S(b)), IsOk());
  ASSERT_THAT(c.Broadcast(S(b), 0), IsOk());
  ASSERT_EQ(device->pointers.size(), 3u);
  for (const void* p : device->pointers) EXPECT_EQ(p, b.data());
  EXPECT_TRUE(host->pointers.empty());
  EXPECT_EQ(dev.Down(b), (std::vector<float>{5, 5, 5, 5}));
}

// A device communicator that can queue on a stream (NCCL, plugin ABI 2.1) gets the session's own
// stream once, and every collective goes to that view with the same pointers and no wait for the
// stream: the work before it (a Fill) is still queued when the collective is handed over.
// Its asynchronous failure shows in DeviceStatus.
TEST_F(DeviceComm, AQueuingDeviceCommunicatorGetsTheSessionStreamAndNoWait) {
  Rank dev;
  auto host = std::make_shared<RecordingDeviceComm>();
  auto device = std::make_shared<RecordingDeviceComm>();
  device->queues = true;
  StepDeviceComm c(dev.ctx, nullptr, host, device);
  EXPECT_FALSE(c.staged());
  EXPECT_TRUE(c.queued());
  EXPECT_EQ(c.backend(), "recording+stream");
  ASSERT_NE(device->view, nullptr);
  ASSERT_NE(dev.ctx->stream(), nullptr);
  EXPECT_EQ(device->view_stream, dev.ctx->stream());
  Buffer b = dev.Up({1, 2, 3, 4});
  const auto before = kernels::testing::GetHostTestDeviceCounters();
  ASSERT_THAT(kernels::Fill(*dev.ctx, 5.0f, b.view()), IsOk());
  ASSERT_THAT(c.AllReduceSum(S(b)), IsOk());
  ASSERT_THAT(c.ReduceScatterSum(absl::MakeConstSpan(b.As<float>(), 4), S(b)), IsOk());
  const int64_t counts[] = {4};
  ASSERT_THAT(c.AllGatherV(absl::MakeConstSpan(b.As<float>(), 4), counts, S(b)), IsOk());
  ASSERT_THAT(c.Broadcast(S(b), 0), IsOk());
  const auto after = kernels::testing::GetHostTestDeviceCounters();
  EXPECT_EQ(after.syncs, before.syncs) << "a queued collective must not wait for the stream";
  ASSERT_EQ(device->view->pointers.size(), 4u);
  for (const void* p : device->view->pointers) EXPECT_EQ(p, b.data());
  EXPECT_TRUE(device->pointers.empty()) << "the communicator's own (synchronous) calls were used";
  EXPECT_TRUE(host->pointers.empty());
  EXPECT_EQ(dev.Down(b), (std::vector<float>{5, 5, 5, 5}));
  // The failure of a queued collective arrives later, through the device communicator.
  EXPECT_THAT(c.DeviceStatus(), IsOk());
  device->async_error = absl::UnavailableError("nccl asynchronous error: remote process exited");
  EXPECT_EQ(c.DeviceStatus().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(c.DeviceStatus().message(), "remote process exited"));
}

// A device communicator that cannot queue (a plugin before ABI 2.1: OnStream is UNIMPLEMENTED)
// keeps the synchronous path.
TEST_F(DeviceComm, ADeviceCommunicatorThatCannotQueueIsCalledAfterTheWait) {
  Rank dev;
  auto device = std::make_shared<RecordingDeviceComm>();
  StepDeviceComm c(dev.ctx, nullptr, std::make_shared<RecordingDeviceComm>(), device);
  EXPECT_FALSE(c.queued());
  EXPECT_EQ(device->view, nullptr);
  EXPECT_THAT(c.DeviceStatus(), IsOk());
}

// ---- the bound on host waits behind queued collectives, with the real NcclCommunicator over a
// host stand-in for the plugin's NCCL table whose queued all-reduce never completes (a peer that
// heartbeats but whose trainer never joins): on the TEST stream it is work that ends only when the
// communicator is aborted (comm_destroy), or after a 10 s cap that the tests treat as "hung".
std::atomic<bool> g_nccl_aborted{false};
std::atomic<bool> g_ended_by_abort{false};
int g_nccl_comm = 0;

int FakeUniqueId(uint8_t* id, char*, size_t) {
  std::memset(id, 0, DIOND_NCCL_UNIQUE_ID_BYTES);
  return 0;
}
int FakeCreate(const uint8_t*, int, int, int, int64_t, void** comm, char*, size_t) {
  *comm = &g_nccl_comm;
  return 0;
}
void FakeDestroy(void*) { g_nccl_aborted = true; }   // ncclCommAbort ends the waiting kernels
int FakeHealthy(void*, char*, size_t) { return 0; }  // the peer heartbeats: no async error
int FakeNeverEndingAllReduce(void*, const void*, void*, size_t, int, int, int64_t, void* stream,
                             char*, size_t) {
  kernels::testing::QueueHostTestStreamWork(0, stream, [] {
    const absl::Time cap = absl::Now() + absl::Seconds(10);
    while (!g_nccl_aborted.load() && absl::Now() < cap) absl::SleepFor(absl::Milliseconds(2));
    g_ended_by_abort = g_nccl_aborted.load();
  });
  return 0;
}
const DiondCudaPluginV1* FakeNcclPlugin() {
  static DiondNcclApiV1 nccl = [] {
    DiondNcclApiV1 n{};
    n.version = 2;
    n.get_unique_id = &FakeUniqueId;
    n.comm_create = &FakeCreate;
    n.comm_destroy = &FakeDestroy;
    n.all_reduce_on = &FakeNeverEndingAllReduce;
    n.async_error = &FakeHealthy;
    return n;
  }();
  static DiondCudaPluginV1 plugin = [] {
    DiondCudaPluginV1 p{};
    p.abi_major = DIOND_CUDA_PLUGIN_ABI_MAJOR;
    p.abi_minor = DIOND_CUDA_PLUGIN_ABI_MINOR;
    p.nccl = &nccl;
    return p;
  }();
  return &plugin;
}
std::shared_ptr<comm::NcclCommunicator> FakeNccl(absl::Duration timeout) {
  g_nccl_aborted = false;
  g_ended_by_abort = false;
  comm::MemoryKeyValueStore kv;
  comm::NcclOptions o;
  o.prefix = "w/";
  o.timeout = timeout;
  auto c = comm::NcclCommunicator::Create(FakeNcclPlugin(), &kv, o);
  EXPECT_THAT(c.status(), IsOk());
  return c.ok() ? std::shared_ptr<comm::NcclCommunicator>(std::move(*c)) : nullptr;
}
// The World's heartbeat: polls the device communicator until stopped.
class Heartbeat {
 public:
  explicit Heartbeat(comm::Communicator* c)
      : thread_([this, c] {
          while (!stop_.HasBeenNotified()) {
            (void)c->Poll();
            absl::SleepFor(absl::Milliseconds(10));
          }
        }) {}
  ~Heartbeat() {
    stop_.Notify();
    thread_.join();
  }

 private:
  absl::Notification stop_;
  std::thread thread_;
};

// Compressed Dion's replica average on device memory (the rules then read P back on the compute
// thread): the wait behind the queued all-reduce ends within --peer_timeout, by the heartbeat's
// abort, and the step learns why; the read-back after it (AllZeroFlags' download) waits on
// nothing remote.
TEST_F(DeviceComm, AReplicaAverageOnTheDeviceIsABoundedWait) {
  Rank dev;
  ComputeThread compute("test-compute");
  auto nccl = FakeNccl(absl::Milliseconds(100));
  ASSERT_NE(nccl, nullptr);
  StepDeviceComm c(dev.ctx, &compute, std::make_shared<RecordingDeviceComm>(), nccl);
  ASSERT_TRUE(c.queued());
  Buffer p = dev.Up({1, 2, 3, 4});
  absl::Status averaged, read;
  {
    Heartbeat beat(nccl.get());
    averaged = c.ReplicaAverage(S(p));
    read = CallOnCompute(&compute, [&] { return kernels::Synchronize(*dev.ctx); });
  }
  EXPECT_TRUE(g_ended_by_abort.load())
      << "the host waited on the never-ending collective until the test's 10 s cap";
  EXPECT_EQ(averaged.code(), absl::StatusCode::kDeadlineExceeded) << averaged;
  EXPECT_TRUE(absl::StrContains(averaged.message(), "--peer_timeout")) << averaged;
}

// A read-back queued behind other sessions' work on the compute thread: its bound starts when it
// runs there, so time spent waiting for the compute thread (longer than --peer_timeout here)
// never aborts the world's communicator.
TEST_F(DeviceComm, AReadBackIsBoundedFromWhenItRunsNotWhileItWaitsForTheComputeThread) {
  Rank dev;
  ComputeThread compute("test-compute");
  auto nccl = FakeNccl(absl::Milliseconds(50));
  ASSERT_NE(nccl, nullptr);
  StepDeviceComm c(dev.ctx, &compute, std::make_shared<RecordingDeviceComm>(), nccl);
  absl::Notification busy, armed;
  bool polled_ok = false;
  std::thread other([&] {
    compute.Run([&] {  // another session's long compute phase
      busy.Notify();
      armed.WaitForNotificationWithTimeout(absl::Milliseconds(300));
      absl::SleepFor(absl::Milliseconds(100));  // past a bound begun before this ends
      polled_ok = nccl->Poll().ok();            // the World's heartbeat meanwhile
    });
  });
  busy.WaitForNotification();
  // The read-back, as the world phases pass it (a call on the compute thread).
  const absl::Status read = c.ReadBackQueued([&] {
    armed.Notify();
    return CallOnCompute(&compute, [] { return absl::OkStatus(); });
  });
  other.join();
  EXPECT_TRUE(polled_ok) << "the communicator was aborted while the read-back only waited for "
                            "the compute thread";
  EXPECT_THAT(read, IsOk());
  EXPECT_THAT(nccl->Poll(), IsOk());
  EXPECT_FALSE(g_nccl_aborted.load());
}

}  // namespace
}  // namespace diond::session
