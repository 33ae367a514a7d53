// NcclCommunicator's bound on a host wait for queued collectives, through a host stand-in for
// the CUDA plugin's NCCL table whose queued collectives never complete (a peer that heartbeats
// but never joins): the wait must end within the communicator's timeout, as a Gloo collective's.
#include <atomic>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/comm/memory_store.h"
#include "server/comm/nccl_communicator.h"

namespace diond::comm {
namespace {

std::atomic<int> g_aborts{0};
int g_comm = 0;

int UniqueId(uint8_t* id, char*, size_t) {
  std::memset(id, 0, DIOND_NCCL_UNIQUE_ID_BYTES);
  return 0;
}
int Create(const uint8_t*, int, int, int, int64_t, void** comm, char*, size_t) {
  *comm = &g_comm;
  return 0;
}
void Destroy(void*) { ++g_aborts; }  // ncclCommAbort: would end the waiting kernels
int QueuedReduceScatter(void*, const void*, void*, size_t, int, int, int64_t, void*, char*,
                        size_t) {
  return 0;  // queued; on a GPU it now waits for the peer on the stream
}
int NoAsyncError(void*, char*, size_t) { return 0; }  // healthy: the peer heartbeats

const DiondCudaPluginV1* Plugin() {
  static DiondNcclApiV1 nccl = [] {
    DiondNcclApiV1 n{};
    n.version = 2;
    n.get_unique_id = &UniqueId;
    n.comm_create = &Create;
    n.comm_destroy = &Destroy;
    n.reduce_scatter_on = &QueuedReduceScatter;
    n.async_error = &NoAsyncError;
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

std::unique_ptr<NcclCommunicator> Make(absl::Duration timeout) {
  MemoryKeyValueStore kv;
  NcclOptions o;
  o.prefix = "w/";
  o.timeout = timeout;
  auto c = NcclCommunicator::Create(Plugin(), &kv, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST(NcclQueuedWait, AHostWaitPastTheTimeoutAbortsTheCommunicator) {
  g_aborts = 0;
  auto c = Make(absl::Milliseconds(50));
  ASSERT_NE(c, nullptr);
  auto view = c->OnStream(reinterpret_cast<void*>(0x1));
  ASSERT_TRUE(view.ok()) << view.status();
  std::vector<float> in(4), out(4);
  ASSERT_TRUE((*view)->ReduceScatterSum(in, absl::MakeSpan(out)).ok());
  (*view)->BeginQueuedWait();  // the session reads back the reduce-scatter's flag
  EXPECT_TRUE(c->Poll().ok()) << "aborted before the timeout";
  const absl::Time t0 = absl::Now();
  absl::Status polled;
  while ((polled = c->Poll()).ok() && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(10));  // the World's heartbeat
  }
  EXPECT_EQ(polled.code(), absl::StatusCode::kDeadlineExceeded) << polled;
  EXPECT_NE(polled.message().find("--peer_timeout"), absl::string_view::npos) << polled;
  EXPECT_EQ(g_aborts.load(), 1) << "the NCCL comm was not aborted: the wait never ends";
  (*view)->EndQueuedWait();
  view->reset();
}

// Two sessions' read-backs on one communicator overlap: the later one ending first must leave
// the earlier one bounded (a single deadline that End clears would leave it waiting for ever).
TEST(NcclQueuedWait, OverlappingWaitsAreEachBounded) {
  g_aborts = 0;
  auto c = Make(absl::Milliseconds(50));
  ASSERT_NE(c, nullptr);
  c->BeginQueuedWait();  // session A starts waiting
  c->BeginQueuedWait();  // session B too
  c->EndQueuedWait();    // B's read-back returned; A's still waits on a late peer
  const absl::Time t0 = absl::Now();
  absl::Status polled;
  while ((polled = c->Poll()).ok() && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(10));  // the World's heartbeat
  }
  EXPECT_EQ(polled.code(), absl::StatusCode::kDeadlineExceeded) << polled;
  EXPECT_EQ(g_aborts.load(), 1) << "the remaining wait was left unbounded";
  c->EndQueuedWait();
}

TEST(NcclQueuedWait, NoBoundOutsideAWaitOrAfterIt) {
  g_aborts = 0;
  auto c = Make(absl::Milliseconds(20));
  ASSERT_NE(c, nullptr);
  c->BeginQueuedWait();
  c->EndQueuedWait();                      // the read-back returned in time
  absl::SleepFor(absl::Milliseconds(60));  // the trainer pauses between steps
  EXPECT_TRUE(c->Poll().ok());
  EXPECT_EQ(g_aborts.load(), 0);
}

}  // namespace
}  // namespace diond::comm
