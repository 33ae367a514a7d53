// diond: the optimizer-as-a-service daemon. The composition root (STYLE.md R1): parses flags,
// starts the Daemon, waits for SIGTERM/SIGINT, drains and exits 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "server/comm/world_flags.h"
#include "server/daemon.h"
#include "server/listen.h"
#include "server/version.h"

ABSL_FLAG(std::string, listen, "",
          "Comma-separated listen addresses: unix:PATH and/or HOST:PORT (port 0 = any free "
          "port). Empty = unix:$XDG_RUNTIME_DIR/diond.sock (else /tmp/diond-<uid>.sock) plus "
          "127.0.0.1:50551. Unix sockets are created with mode 0600.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "HOST:PORT for the Prometheus /metrics endpoint (port 0 = any free port); empty "
          "disables it.");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (first GPU if the CUDA plugin loads and a GPU is present, else "
          "the CPU), cpu, cuda or cuda:N. Until the CUDA ops backend exists, steps run on the "
          "CPU on every device (the start-up line and diond_build_info's compute_device say so).");
ABSL_FLAG(std::string, cuda_plugin, "",
          "Path of libdiond_cuda.so; empty = next to the diond binary, then the loader path.");
ABSL_FLAG(std::string, log_level, "info", "Log threshold: debug, info, warning or error.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long in-flight RPCs may run before they are cancelled.");
ABSL_FLAG(std::string, ready_file, "",
          "If set, write a JSON file with the bound addresses and metrics port once serving "
          "(written atomically; for scripts and tests that use port 0).");
ABSL_FLAG(bool, allow_shm_from_tcp, false,
          "Accept RegisterRegion (shared memory) from TCP peers, not only Unix-socket peers.");
ABSL_FLAG(int64_t, max_session_bytes, 0,
          "Largest optimizer state (plus fp32 master weights) one session may hold, in bytes; "
          "0 = unlimited. Over it, CreateSession fails with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, memory_budget_bytes, 0,
          "Optimizer state all sessions together may hold, in bytes; 0 = unlimited.");
ABSL_FLAG(absl::Duration, session_idle_timeout, absl::ZeroDuration(),
          "Close sessions with no RPC for this long (checkpointing them first when --state_dir "
          "is set); 0 = never.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for checkpoints (<state_dir>/<session>/step-<N>); empty = SaveCheckpoint "
          "needs an explicit directory.");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "With --state_dir: checkpoint every session after every N-th applied step; 0 = off.");
ABSL_FLAG(int, compute_threads, 0, "CPU threads for optimizer math; 0 = all cores.");
ABSL_FLAG(int64_t, checksum_every, 100,
          "World sessions: every N-th step the daemons compare parameter checksums; a copy that "
          "differs from its owner's is logged, counted and replaced by the owner's; 0 = never.");
ABSL_FLAG(bool, allow_insecure_remote, false,
          "Allow TCP listeners on non-loopback addresses without TLS. Off by default.");

// The daemon world (docs/OPERATIONS.md, "World").
ABSL_FLAG(int, world_size, 1,
          "Daemons in the world; 1 = a single daemon (no world, none of the flags below used).");
ABSL_FLAG(int, rank, -1,
          "This daemon's rank in [0, world_size); -1 = JOB_COMPLETION_INDEX (indexed Job), else "
          "the -<N> suffix of the hostname (StatefulSet ordinal).");
ABSL_FLAG(std::string, coordinator, "",
          "HOST:PORT of rank 0's gRPC listener, which serves the Peer service (ranks > 0).");
ABSL_FLAG(std::string, peer_service, "",
          "Kubernetes headless service NAME: --coordinator defaults to "
          "<statefulset>-0.NAME:<port of our first TCP --listen address>.");
ABSL_FLAG(std::string, peer_listen, "127.0.0.1",
          "Host or IP other daemons reach this one at; Gloo's TCP transport binds it (ports are "
          "Gloo's own).");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(1),
          "How often each daemon heartbeats the coordinator.");
ABSL_FLAG(absl::Duration, peer_timeout, absl::Seconds(10),
          "A daemon silent this long is lost; also bounds every collective and rendezvous wait.");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60),
          "How long a daemon tries to reach the coordinator and join before it exits non-zero.");

namespace {

bool IsMainFlagFile(absl::string_view file) {
  return file.find("server/main.cc") != absl::string_view::npos;
}

bool WriteFileAtomically(const std::string& path, const std::string& text) {
  std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return false;
    out << text << "\n";
    if (!out.flush()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Block the stop signals before any thread exists, so every thread inherits the mask and the
  // main thread alone receives them in sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  absl::FlagsUsageConfig config;
  config.contains_help_flags = &IsMainFlagFile;
  config.contains_helpshort_flags = &IsMainFlagFile;
  config.version_string = [] { return absl::StrCat("diond ", diond::server::kVersion, "\n"); };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(
      "diond: optimizer-as-a-service daemon. Trainers send gradients over shared memory or "
      "gRPC and get updated weights back.\nUsage: diond [--listen=unix:/path,127.0.0.1:50551] "
      "[--metrics_address=127.0.0.1:9464] [--device=auto|cpu|cuda:N]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "diond: unexpected argument '%s' (flags are --name=value)\n", rest[1]);
    return 2;
  }

  auto level = diond::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) {
    std::fprintf(stderr, "diond: --log_level: %s\n", std::string(level.status().message()).c_str());
    return 2;
  }
  diond::SetMinLogLevel(*level);

  diond::server::DaemonOptions options;
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) {
    listen = absl::StrCat("unix:", diond::server::DefaultUnixSocketPath(), ",127.0.0.1:50551");
  }
  auto addresses = diond::server::ParseListenAddresses(listen);
  if (!addresses.ok()) {
    std::fprintf(stderr, "diond: --listen: %s\n", std::string(addresses.status().message()).c_str());
    return 2;
  }
  options.listen = *addresses;
  auto device = diond::kernels::ParseDeviceRequest(absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "diond: --device: %s\n", std::string(device.status().message()).c_str());
    return 2;
  }
  options.device = *device;
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.cuda_plugin = absl::GetFlag(FLAGS_cuda_plugin);
  options.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
  options.allow_shm_from_tcp = absl::GetFlag(FLAGS_allow_shm_from_tcp);
  options.sessions.max_session_bytes = absl::GetFlag(FLAGS_max_session_bytes);
  options.sessions.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  options.sessions.idle_timeout = absl::GetFlag(FLAGS_session_idle_timeout);
  options.sessions.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.sessions.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  options.sessions.checksum_every = absl::GetFlag(FLAGS_checksum_every);
  options.sessions.compute_threads = absl::GetFlag(FLAGS_compute_threads);

  diond::server::WorldConfig& world = options.world;
  world.world_size = absl::GetFlag(FLAGS_world_size);
  if (world.world_size < 1) {
    std::fprintf(stderr, "diond: --world_size must be at least 1\n");
    return 2;
  }
  if (world.world_size > 1) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    auto rank = diond::comm::DeriveRank(absl::GetFlag(FLAGS_rank), world.world_size, host,
                                        std::getenv("JOB_COMPLETION_INDEX"));
    if (!rank.ok()) {
      std::fprintf(stderr, "diond: %s\n", std::string(rank.status().message()).c_str());
      return 2;
    }
    world.rank = *rank;
    world.coordinator = absl::GetFlag(FLAGS_coordinator);
    const std::string service = absl::GetFlag(FLAGS_peer_service);
    if (world.coordinator.empty() && !service.empty()) {
      int port = 0;
      for (const auto& a : options.listen) {
        if (a.kind == diond::server::ListenAddress::Kind::kTcp) {
          port = a.port;
          break;
        }
      }
      auto c = diond::comm::CoordinatorFromService(host, service, port);
      if (!c.ok() || port == 0) {
        std::fprintf(stderr, "diond: --peer_service: %s\n",
                     c.ok() ? "needs a TCP --listen address with a fixed port"
                            : std::string(c.status().message()).c_str());
        return 2;
      }
      world.coordinator = *c;
    }
    world.peer_address = absl::GetFlag(FLAGS_peer_listen);
    world.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
    world.peer_timeout = absl::GetFlag(FLAGS_peer_timeout);
    world.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  }

  auto daemon = diond::server::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "diond: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  DIOND_LOG(INFO) << (*daemon)->Describe();

  const std::string ready_file = absl::GetFlag(FLAGS_ready_file);
  if (!ready_file.empty() && !WriteFileAtomically(ready_file, (*daemon)->ReadyJson())) {
    DIOND_LOG(ERROR) << "cannot write --ready_file " << ready_file;
  }

  int sig = 0;
  sigwait(&stop_signals, &sig);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  DIOND_LOG(INFO) << "received " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
                  << ", draining in-flight RPCs (up to " << absl::FormatDuration(drain) << ")";
  (*daemon)->Shutdown(drain);
  daemon->reset();
  if (!ready_file.empty()) unlink(ready_file.c_str());
  DIOND_LOG(INFO) << "stopped cleanly";
  return 0;
}
