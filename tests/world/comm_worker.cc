// One rank of a multi-process collective check, spawned W times by world_collectives_test.
//   comm_worker RANK WORLD_SIZE DIR
// Rank 0 serves the Peer service (a real gRPC server on 127.0.0.1:0, its port written to
// DIR/port); other ranks reach it with rpc::PeerClient. Every rank forms a comm::World, exactly
// as the daemon does, then runs every collective on data whose expectation it computes locally,
// and checks the byte counter against the ring formulas of ALGORITHMS.md §15 (within 5%).
// Prints one line per failure and exits 1 on any failure; prints measured bandwidth.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "server/comm/membership.h"
#include "server/comm/world.h"
#include "server/rpc/peer_client.h"
#include "server/rpc/peer_service.h"

// The Peer service requires a world secret; the workers share this one.
constexpr char kWorkerSecret[] = "comm-worker-world-secret-0123456789";

namespace {

int failures = 0;
int g_rank = 0;

void Fail(const std::string& what) {
  std::fprintf(stderr, "rank %d FAIL: %s\n", g_rank, what.c_str());
  ++failures;
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Fail(absl::StrCat(what, ": ", s.ToString()));
}

// The value rank `r` contributes at index `i`: exact in fp32 (small integers).
float Value(int r, int64_t i) { return static_cast<float>((i % 97) + 100 * r); }

void ExpectEq(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  if (got.size() != want.size()) return Fail(absl::StrCat(what, ": size ", got.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return Fail(absl::StrCat(what, ": [", i, "] = ", got[i], ", want ", want[i]));
    }
  }
}

void ExpectBytes(diond::comm::Communicator& c, int64_t want, const char* what) {
  const int64_t got = c.TakeBytesSent();
  if (want == 0 ? got != 0 : std::abs(static_cast<double>(got - want)) > 0.05 * want) {
    Fail(absl::StrCat(what, ": sent ", got, " bytes, ring formula says ", want));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: comm_worker RANK WORLD_SIZE DIR\n");
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int w = std::atoi(argv[2]);
  const std::string dir = argv[3];
  g_rank = rank;

  std::unique_ptr<diond::comm::Coordinator> coordinator;
  std::unique_ptr<diond::rpc::PeerService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<diond::rpc::PeerClient> client;
  diond::comm::MembershipService* membership = nullptr;
  diond::comm::KeyValueStore* kv = nullptr;
  diond::comm::CoordinatorOptions co;
  co.world_size = w;
  co.heartbeat_interval = absl::Milliseconds(200);
  co.peer_timeout = absl::Seconds(5);
  if (rank == 0) {
    coordinator = std::make_unique<diond::comm::Coordinator>(co);
    service = std::make_unique<diond::rpc::PeerService>(coordinator.get(), kWorkerSecret,
                                                        /*mtls=*/false);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service.get());
    server = b.BuildAndStart();
    if (!server || port == 0) return Fail("cannot start the Peer server"), 1;
    { std::ofstream(dir + "/port.tmp") << port; }
    std::rename((dir + "/port.tmp").c_str(), (dir + "/port").c_str());
    membership = coordinator.get();
    kv = coordinator->store();
  } else {
    std::string port;
    for (int i = 0; i < 3000 && port.empty(); ++i) {
      std::ifstream(dir + "/port") >> port;
      if (port.empty()) absl::SleepFor(absl::Milliseconds(10));
    }
    if (port.empty()) return Fail("rank 0 never wrote its port"), 1;
    diond::rpc::PeerCredentials creds;
    creds.world_secret = kWorkerSecret;
    client = std::make_unique<diond::rpc::PeerClient>("127.0.0.1:" + port, absl::Seconds(5), creds);
    membership = client.get();
    kv = client.get();
  }

  diond::comm::WorldOptions wo;
  wo.rank = rank;
  wo.world_size = w;
  wo.heartbeat_interval = co.heartbeat_interval;
  wo.peer_timeout = co.peer_timeout;
  wo.join_timeout = absl::Seconds(30);
  auto world = diond::comm::World::Join(wo, membership, kv);
  if (!world.ok()) return Fail(world.status().ToString()), 1;
  Check((*world)->WaitReady(absl::Seconds(30)), "WaitReady");
  auto cs = (*world)->communicator();
  if (!cs.ok()) return Fail(cs.status().ToString()), 1;
  diond::comm::Communicator& c = **cs;

  // Sizes: a large one for the byte formulas (chunk rounding < 1%), an odd one for edges.
  for (int64_t n : {int64_t{1} << 18, int64_t{1003}}) {
    const bool big = n > 100000;
    // all-reduce (sum and average)
    std::vector<float> a(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = Value(rank, i);
      want[i] = 0;
      for (int r = 0; r < w; ++r) want[i] += Value(r, i);
    }
    Check(c.AllReduceSum(absl::MakeSpan(a)), "all_reduce");
    ExpectEq(a, want, "all_reduce");
    if (big) ExpectBytes(c, diond::comm::RingAllReduceBytes(n * 4, w), "all_reduce bytes");
    c.TakeBytesSent();
    for (int64_t i = 0; i < n; ++i) a[i] = Value(rank, i);
    Check(c.AllReduceAverage(absl::MakeSpan(a)), "all_reduce average");
    for (int64_t i = 0; i < n; ++i) {
      // The sum is exact; dividing by W rounds once: 1 ulp.
      if (std::abs(a[i] - want[i] / w) > 1e-6f * std::abs(want[i])) {
        Fail(absl::StrCat("average [", i, "] = ", a[i]));
        break;
      }
    }
    c.TakeBytesSent();

    // reduce-scatter: block = n elements, input W*n.
    std::vector<float> in(w * n), out(n), rs_want(n);
    for (int64_t i = 0; i < w * n; ++i) in[i] = Value(rank, i);
    for (int64_t i = 0; i < n; ++i) {
      rs_want[i] = 0;
      for (int r = 0; r < w; ++r) rs_want[i] += Value(r, rank * n + i);
    }
    Check(c.ReduceScatterSum(in, absl::MakeSpan(out)), "reduce_scatter");
    ExpectEq(out, rs_want, "reduce_scatter");
    if (big) ExpectBytes(c, diond::comm::RingAllGatherBytes(w * n * 4, w), "reduce_scatter bytes");

    // all-gather
    std::vector<float> mine(n), all(w * n), ag_want(w * n);
    for (int64_t i = 0; i < n; ++i) mine[i] = Value(rank, i);
    for (int r = 0; r < w; ++r) {
      for (int64_t i = 0; i < n; ++i) ag_want[r * n + i] = Value(r, i);
    }
    Check(c.AllGather(mine, absl::MakeSpan(all)), "all_gather");
    ExpectEq(all, ag_want, "all_gather");
    if (big) ExpectBytes(c, diond::comm::RingAllGatherBytes(w * n * 4, w), "all_gather bytes");

    // all-to-all: output block j = rank j's input block `rank`.
    std::vector<float> a2a_in(w * n), a2a_out(w * n), a2a_want(w * n);
    for (int64_t i = 0; i < w * n; ++i) a2a_in[i] = Value(rank, i);
    for (int j = 0; j < w; ++j) {
      for (int64_t i = 0; i < n; ++i) a2a_want[j * n + i] = Value(j, rank * n + i);
    }
    Check(c.AllToAll(a2a_in, absl::MakeSpan(a2a_out)), "all_to_all");
    ExpectEq(a2a_out, a2a_want, "all_to_all");
    if (big) ExpectBytes(c, diond::comm::RingAllGatherBytes(w * n * 4, w), "all_to_all bytes");

    // broadcast from the last rank
    std::vector<float> b(n), b_want(n);
    for (int64_t i = 0; i < n; ++i) {
      b[i] = Value(rank, i);
      b_want[i] = Value(w - 1, i);
    }
    Check(c.Broadcast(absl::MakeSpan(b), w - 1), "broadcast");
    ExpectEq(b, b_want, "broadcast");
    if (big) ExpectBytes(c, rank == w - 1 ? (w - 1) * n * 4 : 0, "broadcast bytes");
  }

  // all-gather-v: rank r contributes r + 1 elements (rank 1 of 2 the most).
  {
    std::vector<int64_t> counts(w);
    int64_t total = 0;
    for (int r = 0; r < w; ++r) total += counts[r] = 5 * r + 1;
    std::vector<float> mine(counts[rank]), out(total), want;
    for (int64_t i = 0; i < counts[rank]; ++i) mine[i] = Value(rank, i);
    for (int r = 0; r < w; ++r) {
      for (int64_t i = 0; i < counts[r]; ++i) want.push_back(Value(r, i));
    }
    Check(c.AllGatherV(mine, counts, absl::MakeSpan(out)), "all_gather_v");
    ExpectEq(out, want, "all_gather_v");
  }
  // raw bytes
  {
    std::vector<uint8_t> mine(7, static_cast<uint8_t>(rank + 1)), all(7 * w);
    Check(c.AllGatherBytes(mine, absl::MakeSpan(all)), "all_gather bytes");
    for (int r = 0; r < w; ++r) {
      if (all[7 * r + 6] != r + 1) Fail("all_gather_bytes content");
    }
    std::vector<uint8_t> b(5, static_cast<uint8_t>(rank));
    Check(c.BroadcastBytes(absl::MakeSpan(b), 0), "broadcast bytes");
    if (b[4] != 0) Fail("broadcast_bytes content");
  }
  Check(c.Barrier(), "barrier");

  // Bandwidth of the hot path: all-reduce of 16 MiB, 5 timed runs after a warm-up.
  {
    std::vector<float> big(4 << 20, 1.0f);
    Check(c.AllReduceSum(absl::MakeSpan(big)), "warm-up");
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < 5; ++i) Check(c.AllReduceSum(absl::MakeSpan(big)), "timed all_reduce");
    const double s = absl::ToDoubleSeconds(absl::Now() - t0) / 5;
    if (rank == 0) {
      std::printf("W=%d all_reduce 16 MiB: %.1f ms, algbw %.2f GB/s\n", w, s * 1e3,
                  16.0 * (1 << 20) / s / 1e9);
    }
  }
  Check(c.Barrier(), "final barrier");
  std::printf("rank %d: %s\n", rank, failures == 0 ? "all collectives OK" : "FAILED");
  std::fflush(stdout);
  // Leave only when every rank has passed the final barrier. A rank whose barrier has returned
  // may still be the one a slower peer is reading from: Gloo's all-to-all barrier returns on a
  // rank once its own receives and sends are done, and a process that exits then closes its
  // sockets under a peer still inside the barrier, which fails that peer with "Connection
  // closed by peer" (a flake this test once hit at W = 3). The rendezvous goes through files in
  // DIR, outside the world under test.
  {
    std::ofstream(absl::StrCat(dir, "/done", rank)) << "1";
    const absl::Time until = absl::Now() + absl::Seconds(30);
    for (int r = 0; r < w; ++r) {
      while (access(absl::StrCat(dir, "/done", r).c_str(), F_OK) != 0 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
  }
  // Rank 0 serves the others' heartbeats: let them leave first.
  if (rank == 0) absl::SleepFor(absl::Milliseconds(300));
  world->reset();
  if (server) server->Shutdown(std::chrono::system_clock::now());
  return failures == 0 ? 0 : 1;
}
