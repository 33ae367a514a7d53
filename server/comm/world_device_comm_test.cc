// World's device communicators (WorldOptions::device_communicator_factory, the slot NCCL fills on
// a GPU daemon), in process: two Worlds on threads, one Coordinator, Gloo over loopback, and a
// recording factory in place of NCCL.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/comm/membership.h"
#include "server/comm/world.h"

namespace diond::comm {
namespace {

using ::diond::testing::IsOk;

// Stands for NCCL: device memory, records how it was made; its collectives do nothing.
class FakeDeviceComm final : public Communicator {
 public:
  FakeDeviceComm(int rank, int size, std::string prefix)
      : Communicator(rank, size, nullptr), prefix(std::move(prefix)) {}
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  absl::string_view backend() const override { return "fake-device"; }
  absl::Status AllReduceSum(absl::Span<float>) override { return status(); }
  absl::Status AllReduceAverage(absl::Span<float>) override { return status(); }
  absl::Status ReduceScatterSum(absl::Span<const float>, absl::Span<float>) override {
    return status();
  }
  absl::Status AllGather(absl::Span<const float>, absl::Span<float>) override { return status(); }
  absl::Status AllGatherV(absl::Span<const float>, absl::Span<const int64_t>,
                          absl::Span<float>) override {
    return status();
  }
  absl::Status AllToAll(absl::Span<const float>, absl::Span<float>) override { return status(); }
  absl::Status Broadcast(absl::Span<float>, int) override { return status(); }
  absl::Status Barrier() override { return status(); }
  absl::Status AllGatherBytes(absl::Span<const uint8_t>, absl::Span<uint8_t>) override {
    return status();
  }
  absl::Status BroadcastBytes(absl::Span<uint8_t>, int) override { return status(); }
  // NCCL's asynchronous error, as the plugin reports it to Poll (set by a test); Poll counted.
  absl::Status Poll() override {
    polls.fetch_add(1);
    absl::MutexLock lock(&mu);
    if (!async_error.ok()) Abort(async_error);
    return status();
  }
  void SetAsyncError(absl::Status s) {
    absl::MutexLock lock(&mu);
    async_error = std::move(s);
  }
  void OnAbort() override { aborts.fetch_add(1); }
  const std::string prefix;
  std::atomic<int> polls{0}, aborts{0};
  absl::Mutex mu;
  absl::Status async_error ABSL_GUARDED_BY(mu);
};

struct Fixture {
  static constexpr int kW = 2;
  explicit Fixture(std::function<absl::Status(int rank)> fail = nullptr) {
    CoordinatorOptions co;
    co.world_size = kW;
    co.heartbeat_interval = absl::Milliseconds(100);
    co.peer_timeout = absl::Seconds(3);
    coordinator = std::make_unique<Coordinator>(co);
    std::thread t[kW];
    for (int r = 0; r < kW; ++r) {
      t[r] = std::thread([this, r, fail] {
        WorldOptions o;
        o.rank = r;
        o.world_size = kW;
        o.heartbeat_interval = absl::Milliseconds(100);
        o.peer_timeout = absl::Seconds(3);
        o.join_timeout = absl::Seconds(10);
        o.device_communicator_factory =
            [this, fail](KeyValueStore*, const std::string& prefix, int rank, int size,
                         absl::Duration,
                         CollectiveObserver) -> absl::StatusOr<std::unique_ptr<Communicator>> {
          made.fetch_add(1);
          if (fail) {
            if (absl::Status s = fail(rank); !s.ok()) return s;
          }
          return std::unique_ptr<Communicator>(new FakeDeviceComm(rank, size, prefix));
        };
        auto w = World::Join(o, coordinator.get(), coordinator->store());
        ASSERT_THAT(w.status(), IsOk());
        worlds[r] = std::move(*w);
      });
    }
    for (auto& th : t) th.join();
  }
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<World> worlds[kW];
  std::atomic<int> made{0};
};

TEST(WorldDeviceComm, EveryGenerationGetsOneBesideGlooUnderItsOwnPrefix) {
  Fixture f;
  std::string prefix[Fixture::kW];
  for (int r = 0; r < Fixture::kW; ++r) {
    ASSERT_TRUE(f.worlds[r] != nullptr);
    ASSERT_THAT(f.worlds[r]->WaitReady(absl::Seconds(10)), IsOk());
    std::shared_ptr<Communicator> d = f.worlds[r]->device_communicator();
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(d->memory(), MemorySpace::kDevice);
    EXPECT_EQ(d->rank(), r);
    prefix[r] = static_cast<FakeDeviceComm&>(*d).prefix;
    EXPECT_TRUE(absl::EndsWith(prefix[r], "dev/")) << prefix[r];
    auto host = f.worlds[r]->communicator();
    ASSERT_THAT(host.status(), IsOk());
    EXPECT_EQ((*host)->memory(), MemorySpace::kHost);
  }
  EXPECT_EQ(prefix[0], prefix[1]);
  EXPECT_EQ(f.made.load(), Fixture::kW);
}

TEST(WorldDeviceComm, ADeviceCollectiveFailureBreaksTheGeneration) {
  Fixture f;
  for (int r = 0; r < Fixture::kW; ++r) {
    ASSERT_TRUE(f.worlds[r] != nullptr);
    ASSERT_THAT(f.worlds[r]->WaitReady(absl::Seconds(10)), IsOk());
  }
  std::shared_ptr<Communicator> d = f.worlds[1]->device_communicator();
  ASSERT_NE(d, nullptr);
  auto host = f.worlds[1]->communicator();
  ASSERT_THAT(host.status(), IsOk());
  // What the NCCL backend does on ncclCommGetAsyncError: abort with the reason.
  d->Abort(absl::UnavailableError("NCCL async error: remote process exited"));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while ((*host)->status().ok() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE((*host)->status().ok()) << "the host communicator of the generation was not aborted";
  EXPECT_TRUE(absl::StrContains((*host)->status().message(), "NCCL async error"))
      << (*host)->status().message();
}

// Collectives queued on a session's stream fail asynchronously: the World polls the device
// communicator at every heartbeat, and an error there breaks the generation (both communicators
// aborted, the device one once: that ends NCCL's kernels still waiting on the stream).
TEST(WorldDeviceComm, AnAsynchronousErrorFoundByThePollBreaksTheGeneration) {
  Fixture f;
  for (int r = 0; r < Fixture::kW; ++r) {
    ASSERT_TRUE(f.worlds[r] != nullptr);
    ASSERT_THAT(f.worlds[r]->WaitReady(absl::Seconds(10)), IsOk());
  }
  std::shared_ptr<Communicator> d = f.worlds[0]->device_communicator();
  ASSERT_NE(d, nullptr);
  auto& fake = static_cast<FakeDeviceComm&>(*d);
  auto host = f.worlds[0]->communicator();
  ASSERT_THAT(host.status(), IsOk());
  // Polled while healthy, nothing happens.
  const absl::Time polled = absl::Now() + absl::Seconds(5);
  while (fake.polls.load() < 3 && absl::Now() < polled) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_GE(fake.polls.load(), 3) << "the heartbeat does not poll the device communicator";
  EXPECT_THAT((*host)->status(), IsOk());
  EXPECT_EQ(fake.aborts.load(), 0);
  fake.SetAsyncError(absl::UnavailableError("nccl asynchronous error: remote process exited"));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while ((*host)->status().ok() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE((*host)->status().ok()) << "the host communicator of the generation was not aborted";
  EXPECT_TRUE(absl::StrContains((*host)->status().message(), "remote process exited"))
      << (*host)->status().message();
  EXPECT_EQ(fake.aborts.load(), 1);
}

TEST(WorldDeviceComm, AFactoryFailureFailsTheGenerationAndSaysSo) {
  Fixture f([](int rank) {
    return rank == 1 ? absl::UnavailableError("ncclCommInitRank: unhandled system error")
                     : absl::OkStatus();
  });
  ASSERT_TRUE(f.worlds[1] != nullptr);
  absl::Status s = f.worlds[1]->WaitReady(absl::Seconds(2));
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "device communicator: ncclCommInitRank"))
      << s.message();
  EXPECT_EQ(f.worlds[1]->device_communicator(), nullptr);
}

}  // namespace
}  // namespace diond::comm
