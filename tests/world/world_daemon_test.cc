// Real diond daemons forming a world on loopback: they join (logs and metrics), a world-size
// mismatch and an unreachable coordinator exit non-zero with one clear line, a SIGKILLed daemon
// is detected by the survivors within --peer_timeout, and a restarted one rejoins.
#include <signal.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/subprocess.h"

namespace diond {
namespace {

using ::diond::testing::HttpGet;
using ::diond::testing::MakeTempDir;
using ::diond::testing::ReadFile;
using ::diond::testing::Subprocess;

constexpr absl::Duration kPeerTimeout = absl::Seconds(2);

struct Daemon {
  std::unique_ptr<Subprocess> proc;
  int port = 0, metrics_port = 0;
  std::string log_path;
  std::string Log() const { return ReadFile(log_path); }
};

std::vector<std::string> WorldArgs(int rank, int w, int coordinator_port) {
  std::vector<std::string> a = {
      absl::StrCat("--world_size=", w), absl::StrCat("--rank=", rank), "--heartbeat_interval=200ms",
      absl::StrCat("--peer_timeout=", absl::FormatDuration(kPeerTimeout))};
  if (coordinator_port != 0)
    a.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port));
  return a;
}

// Starts a daemon; if `wait_ready`, waits for its ready file (written after it joined).
std::unique_ptr<Daemon> Start(const std::string& dir, const std::string& name,
                              std::vector<std::string> extra, bool wait_ready = true) {
  auto d = std::make_unique<Daemon>();
  const std::string ready = absl::StrCat(dir, "/", name, ".json");
  d->log_path = absl::StrCat(dir, "/", name, ".log");
  std::vector<std::string> argv = {DIOND_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                                   "--metrics_address=127.0.0.1:0", "--ready_file=" + ready};
  argv.insert(argv.end(), extra.begin(), extra.end());
  // Peer calls need the world's shared secret (every daemon of the test shares this file).
  bool has_secret = false;
  for (const auto& a : extra) has_secret |= absl::StartsWith(a, "--world_secret_file=");
  if (!has_secret) {
    const std::string secret = dir + "/world.secret";
    if (ReadFile(secret).empty()) std::ofstream(secret) << "world-daemon-test-secret-0123456789";
    argv.push_back("--world_secret_file=" + secret);
  }
  d->proc = std::make_unique<Subprocess>(argv, d->log_path);
  if (!wait_ready) return d;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    std::string text = ReadFile(ready);
    if (!text.empty()) {
      auto j = nlohmann::json::parse(text);
      for (const auto& e : j["listen"]) {
        if (e.contains("port")) d->port = e["port"].get<int>();
      }
      d->metrics_port = j["metrics_port"].get<int>();
      return d;
    }
    if (d->proc->Wait(absl::ZeroDuration()).has_value()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << name << " did not become ready; log:\n" << d->Log();
  return nullptr;
}

// Value of an unlabelled metric, or -1.
double Metric(const Daemon& d, const std::string& name) {
  std::string body = HttpGet(d.metrics_port, "/metrics");
  size_t at = body.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body.substr(at + name.size() + 2));
}

// Polls until `pred` holds or `timeout` passes; returns whether it held.
template <typename P>
bool WaitFor(P pred, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return pred();
}

class WorldDaemons : public ::testing::TestWithParam<int> {};

TEST_P(WorldDaemons, JoinDetectLossRejoin) {
  const int w = GetParam();
  const std::string dir = MakeTempDir("diond_world_d");
  std::vector<std::unique_ptr<Daemon>> d;
  d.push_back(Start(dir, "rank0", WorldArgs(0, w, 0)));
  ASSERT_NE(d[0], nullptr);
  for (int r = 1; r < w; ++r) {
    d.push_back(Start(dir, absl::StrCat("rank", r), WorldArgs(r, w, d[0]->port)));
    ASSERT_NE(d[r], nullptr);
  }
  for (int r = 0; r < w; ++r) {
    ASSERT_TRUE(WaitFor([&] { return absl::StrContains(d[r]->Log(), "ready, generation"); },
                        absl::Seconds(20)))
        << "rank " << r << " log:\n"
        << d[r]->Log();
    EXPECT_TRUE(WaitFor([&] { return Metric(*d[r], "diond_world_peers") == w; }, absl::Seconds(5)))
        << "rank " << r << " peers " << Metric(*d[r], "diond_world_peers");
    EXPECT_GT(Metric(*d[r], "diond_world_generation"), 0);
  }

  // SIGKILL the last rank: every survivor must see the world broken within --peer_timeout.
  const int victim = w - 1;
  d[victim]->proc->Signal(SIGKILL);
  ASSERT_TRUE(d[victim]->proc->Wait(absl::Seconds(5)).has_value());
  const absl::Time killed = absl::Now();
  for (int r = 0; r < victim; ++r) {
    // 200 ms of slack for this test's own polling and the log write.
    EXPECT_TRUE(WaitFor([&] { return Metric(*d[r], "diond_world_failures_total") >= 1; },
                        kPeerTimeout + absl::Milliseconds(200) - (absl::Now() - killed)))
        << "rank " << r << " did not detect the loss within the peer timeout; log:\n"
        << d[r]->Log();
    EXPECT_TRUE(absl::StrContains(d[r]->Log(), absl::StrCat("rank ", victim, " (127.0.0.1) lost")))
        << d[r]->Log();
  }
  EXPECT_TRUE(
      WaitFor([&] { return Metric(*d[0], "diond_world_peers") == w - 1; }, absl::Seconds(1)));

  // Restart it: it rejoins as a new incarnation and everybody is ready on a new generation.
  const double old_generation = Metric(*d[0], "diond_world_generation");
  d[victim] = Start(dir, "restarted", WorldArgs(victim, w, d[0]->port));
  ASSERT_NE(d[victim], nullptr);
  for (int r = 0; r < w; ++r) {
    EXPECT_TRUE(WaitFor(
        [&] {
          return Metric(*d[r], "diond_world_peers") == w &&
                 Metric(*d[r], "diond_world_generation") > old_generation;
        },
        absl::Seconds(20)))
        << "rank " << r << " did not rebuild; log:\n"
        << d[r]->Log();
  }
  for (auto& p : d) p->proc->Signal(SIGTERM);
  for (auto& p : d) EXPECT_EQ(p->proc->Wait(absl::Seconds(15)), 0) << p->Log();
}

INSTANTIATE_TEST_SUITE_P(W, WorldDaemons, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("W", info.param); });

TEST(WorldDaemon, WorldSizeMismatchExitsNonZeroWithOneClearLine) {
  const std::string dir = MakeTempDir("diond_world_m");
  auto coordinator = Start(dir, "rank0", WorldArgs(0, 2, 0));
  ASSERT_NE(coordinator, nullptr);
  auto bad = Start(dir, "bad", WorldArgs(1, 3, coordinator->port), /*wait_ready=*/false);
  auto rc = bad->proc->Wait(absl::Seconds(15));
  ASSERT_TRUE(rc.has_value()) << bad->Log();
  EXPECT_NE(*rc, 0);
  EXPECT_TRUE(absl::StrContains(bad->Log(),
                                "world size mismatch: rank 1 was started with "
                                "--world_size=3 but the coordinator (rank 0) has "
                                "--world_size=2"))
      << bad->Log();
  coordinator->proc->Signal(SIGTERM);
  EXPECT_EQ(coordinator->proc->Wait(absl::Seconds(15)), 0);
}

TEST(WorldDaemon, UnreachableCoordinatorExitsNonZeroWithinTheBound) {
  const std::string dir = MakeTempDir("diond_world_u");
  std::vector<std::string> args = WorldArgs(1, 2, 1);  // port 1: nobody listens
  args.push_back("--join_timeout=2s");
  const absl::Time t0 = absl::Now();
  auto d = Start(dir, "lonely", args, /*wait_ready=*/false);
  auto rc = d->proc->Wait(absl::Seconds(15));
  ASSERT_TRUE(rc.has_value()) << d->Log();
  EXPECT_NE(*rc, 0);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8));
  EXPECT_TRUE(absl::StrContains(d->Log(), "could not join the world within 2s")) << d->Log();
}

// A world needs a credential for its Peer traffic: without a secret (or mTLS) a daemon of a
// world refuses to start, and a daemon with another world's secret cannot join.
TEST(WorldDaemon, WorldWithoutSecretRefusesToStart) {
  const std::string dir = MakeTempDir("diond_world_s");
  std::vector<std::string> args = WorldArgs(0, 2, 0);
  args.push_back("--world_secret_file=");
  auto d = Start(dir, "open", args, /*wait_ready=*/false);
  auto rc = d->proc->Wait(absl::Seconds(15));
  ASSERT_TRUE(rc.has_value()) << d->Log();
  EXPECT_NE(*rc, 0);
  EXPECT_TRUE(absl::StrContains(d->Log(), "needs --world_secret_file")) << d->Log();
}

TEST(WorldDaemon, RankWithAnotherSecretCannotJoin) {
  const std::string dir = MakeTempDir("diond_world_w");
  auto coordinator = Start(dir, "rank0", WorldArgs(0, 2, 0));
  ASSERT_NE(coordinator, nullptr);
  const std::string other = dir + "/other.secret";
  std::ofstream(other) << "not-the-world-secret-0123456789";
  std::vector<std::string> args = WorldArgs(1, 2, coordinator->port);
  args.push_back("--world_secret_file=" + other);
  args.push_back("--join_timeout=5s");
  auto intruder = Start(dir, "intruder", args, /*wait_ready=*/false);
  auto rc = intruder->proc->Wait(absl::Seconds(20));
  ASSERT_TRUE(rc.has_value()) << intruder->Log();
  EXPECT_NE(*rc, 0);
  EXPECT_TRUE(absl::StrContains(intruder->Log(), "world secret is wrong")) << intruder->Log();
  EXPECT_FALSE(absl::StrContains(coordinator->Log(), "rank 1 joined")) << coordinator->Log();
  coordinator->proc->Signal(SIGTERM);
  EXPECT_EQ(coordinator->proc->Wait(absl::Seconds(15)), 0);
}

}  // namespace
}  // namespace diond
