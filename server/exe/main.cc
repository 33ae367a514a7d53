// diond: the optimizer-as-a-service daemon. The composition root (STYLE.md R1): parses flags,
// starts the Daemon, waits for SIGTERM/SIGINT, drains and exits 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "kernels/context.h"
#include "kernels/engine_calibration.h"
#include "kernels/engine_choice.h"
#include "kernels/host_blas.h"
#include "kernels/optim/optimizer_types.h"
#include "server/comm/world_flags.h"
#include "server/exe/daemon.h"
#include "server/rpc/listen.h"
#include "server/version.h"

#ifdef DIOND_TEST_DEVICE_BINARY
// diond_testdevice (tests/service/test_device_daemon.cc): registers the host-memory TEST backend
// as the compute device. A test-only binary, never installed.
namespace diond::server {
void ConfigureTestDevice(DaemonOptions* options);
}
#endif

ABSL_FLAG(std::string, listen, "",
          "Comma-separated listen addresses: unix:PATH and/or HOST:PORT (port 0 = any free "
          "port). Empty = unix:$XDG_RUNTIME_DIR/diond.sock (else /tmp/diond-<uid>.sock) plus "
          "127.0.0.1:50551. Unix sockets are created with mode 0600.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "HOST:PORT for the Prometheus /metrics endpoint (port 0 = any free port); empty "
          "disables it.");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (first GPU if the CUDA plugin loads and a GPU is present, else "
          "the CPU), cpu, cuda or cuda:N. On a GPU the steps run in device sessions once the "
          "CUDA ops register and the update rules run on a device context, else on the CPU "
          "(the start-up line and diond_build_info's compute_device say which, and why).");
ABSL_FLAG(std::string, cuda_plugin, "",
          "Path of libdiond_cuda.so; empty = next to the diond binary, then the loader path.");
ABSL_FLAG(std::string, log_level, "info", "Log threshold: debug, info, warning or error.");
ABSL_FLAG(std::string, log_format, "text",
          "Log line format on stderr: text (\"<time> <LEVEL> <file>:<line>] <message>\") or json "
          "(one object per line: time, level, source, session, step, message).");
ABSL_FLAG(std::string, health_address, "",
          "HOST:PORT serving only grpc.health.v1 (no other service), e.g. 0.0.0.0:50552 for "
          "Kubernetes gRPC probes while the API stays on unix/loopback; empty = off.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long in-flight RPCs may run before they are cancelled.");
ABSL_FLAG(bool, exit_on_stdin_eof, false,
          "Stop (as on SIGTERM) when standard input reaches end-of-file: a parent that starts "
          "the daemon with a pipe on stdin and keeps the write end ties the daemon's life to its "
          "own, even when it is SIGKILLed. Standard input must then be a pipe; anything read is "
          "ignored.");
ABSL_FLAG(std::string, ready_file, "",
          "If set, write a JSON file with the bound addresses and metrics port once serving "
          "(mode 0600 whatever the umask, written atomically; for scripts and tests that use "
          "port 0).");
ABSL_FLAG(bool, allow_shm_from_tcp, false,
          "Accept RegisterRegion (shared memory) from TCP peers, not only Unix-socket peers.");
ABSL_FLAG(std::string, fd_channel_socket, "",
          "The fd channel's Unix socket (docs/DATA_PLANE.md), where trainers pass memfds with "
          "SCM_RIGHTS for REGION_KIND_MEMFD. Empty = the first Unix --listen path + \".fd\"; "
          "\"none\" = no fd channel.");
ABSL_FLAG(absl::Duration, fd_token_ttl, absl::Seconds(60),
          "How long a token of the fd channel stays valid unredeemed; its fd is closed then.");
ABSL_FLAG(
    int, fd_max_pending_per_uid, 64,
    "The most unredeemed fd-channel tokens one uid may hold (the daemon holds 1024 at most).");
ABSL_FLAG(int64_t, max_session_bytes, 0,
          "Largest optimizer state (plus fp32 master weights) one session may hold, in bytes; "
          "a device session counts everything it holds in the device pool (state, staging, "
          "scratch). 0 = unlimited. Over it, CreateSession fails with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, memory_budget_bytes, 0,
          "Optimizer state all sessions together may hold, in bytes, counted as for "
          "--max_session_bytes (device sessions: their device pool bytes); 0 = unlimited.");
ABSL_FLAG(absl::Duration, session_idle_timeout, absl::ZeroDuration(),
          "Close sessions with no RPC for this long (checkpointing them first when --state_dir "
          "is set); 0 = never. Until then a session whose trainer vanished can be re-attached "
          "by its session_name.");
ABSL_FLAG(absl::Duration, orphan_grace, absl::Seconds(60),
          "Close a session (checkpointing it first when --state_dir is set) once every local "
          "process that created, attached or called on it over the Unix socket has exited and "
          "it has been unused this long; 0 = never. Sessions created or attached over TCP (or "
          "by a process the daemon cannot see, e.g. of another pid namespace) and world sessions "
          "are never reaped this way; named sessions follow --orphan_grace_named "
          "(docs/OPERATIONS.md \"Orphan sessions\").");
ABSL_FLAG(absl::Duration, orphan_grace_named, absl::ZeroDuration(),
          "--orphan_grace for sessions with a session_name, which a restarted trainer "
          "re-attaches to by that name; 0 = never (they wait for AttachSession, bounded by "
          "--session_idle_timeout). Set it longer than a trainer restart takes.");
ABSL_FLAG(absl::Duration, overlap_bucket_timeout, absl::Minutes(10),
          "How long an overlapped step waits for each bucket's gradients doorbell before it "
          "fails with DEADLINE_EXCEEDED, nothing committed (docs/DATA_PLANE.md \"Overlapped "
          "step\"); must be > 0. Far longer than a backward: only a stalled trainer meets it.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for checkpoints (<state_dir>/<session>/step-<N>); empty = SaveCheckpoint "
          "needs an explicit directory.");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "With --state_dir: checkpoint every session after every N-th applied step; 0 = off.");
ABSL_FLAG(int64_t, keep_checkpoints, 0,
          "Keep only the newest N step-<N> checkpoints of each session (older ones are removed "
          "after every successful save); 0 = keep all.");
ABSL_FLAG(bool, recover, false,
          "With --state_dir: at start-up restore every session's latest checkpoint under its id "
          "and session_name, so trainers re-attach (AttachSession) after a daemon restart. "
          "Sessions closed by their client and world sessions are not restored.");
ABSL_FLAG(int, compute_threads, 0, "CPU threads for optimizer math; 0 = all cores.");
ABSL_FLAG(bool, calibrate_engines, false,
          "At start-up, time oneDNN against OpenBLAS for fp32 GEMMs and oneDNN bf16 against the "
          "widened fp32 GEMM for bf16_reference (512³; 0.1-0.4 s on a loaded 2-core machine) and "
          "let the `auto` engines take the faster. Off by default: a measurement may choose "
          "differently at the next start or on another rank, and the engines' bits differ, so a "
          "resumed or replicated session would no longer repeat its numbers. Off: oneDNN for "
          "fp32, PyTorch's ISA rule for bf16. The start-up line and diond_build_info say what "
          "was chosen (docs/OPERATIONS.md).");
ABSL_FLAG(int64_t, checksum_every, 100,
          "World sessions: every N-th step the daemons compare parameter checksums; a copy that "
          "differs from its owner's is logged, counted and replaced by the owner's; 0 = never.");
ABSL_FLAG(bool, allow_insecure_remote, false,
          "Allow TCP listeners and the --metrics_address endpoint on non-loopback addresses "
          "without TLS. Off by default.");
ABSL_FLAG(int32_t, rpc_handler_threads, 64,
          "Most threads running the Optimizer service's calls (a call waiting for its world's "
          "peers or a collective holds one; past the cap calls wait their turn). 1 to 4096.");
ABSL_FLAG(bool, step_graphs, true,
          "Device daemons: from its second step, a session's step runs as captured device graphs "
          "(its reads, its update replayed with each step's scalars, its write-back; "
          "docs/GPU.md); false runs every step eagerly.");
ABSL_FLAG(int64_t, max_stream_bytes, int64_t{4} << 30,
          "Most bytes one PushGradients or SetState stream may carry (they are buffered until "
          "the stream ends); more is RESOURCE_EXHAUSTED. A stream is also bounded by the "
          "session's own tensor bytes. 0 = only that bound.");

// Security (docs/OPERATIONS.md, "Security").
ABSL_FLAG(std::string, auth_token_file, "",
          "File of bearer tokens for TCP callers, one 'TOKEN PRINCIPAL [admin]' a line ('#' "
          "comments). A caller sends 'authorization: Bearer TOKEN' and acts as PRINCIPAL.");
ABSL_FLAG(bool, allow_unauthenticated_tcp, false,
          "Accept TCP calls without a credential (loopback included) as principal 'anonymous'. "
          "Off by default: TCP calls need a token or a TLS client certificate.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this daemon: TLS on every TCP listener, and this daemon's "
          "client certificate towards the coordinator. Needs --tls_key.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates: client certificates signed by them are verified and accepted as "
          "credentials (principal x509:<subject>); in a world, also the CA of the coordinator's "
          "certificate.");
ABSL_FLAG(std::string, world_secret_file, "",
          "File holding the world's shared secret (16 to 4096 bytes, e.g. a Kubernetes Secret); "
          "every Peer call must carry it. A world needs it or mutual TLS.");
ABSL_FLAG(int64_t, world_max_key_bytes, 1024,
          "Rank 0's rendezvous store: the longest key, in bytes.");
ABSL_FLAG(int64_t, world_max_value_bytes, int64_t{16} << 20,
          "Rank 0's rendezvous store: the largest value, in bytes.");
ABSL_FLAG(int64_t, world_max_keys, 100000, "Rank 0's rendezvous store: the most keys.");
ABSL_FLAG(int64_t, world_max_store_bytes, int64_t{256} << 20,
          "Rank 0's rendezvous store: keys plus values, in bytes.");

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
ABSL_FLAG(std::string, world_device_collectives, "auto",
          "How world sessions of a daemon whose steps run on a GPU exchange: auto (NCCL on device "
          "memory when the CUDA plugin has it, else Gloo staged through host memory) or gloo "
          "(always Gloo, staged). CPU daemons always use Gloo.");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60),
          "How long a daemon tries to reach the coordinator and join before it exits non-zero.");

namespace {

bool IsMainFlagFile(absl::string_view file) {
  return file.find("server/exe/main.cc") != absl::string_view::npos;
}

// Mode 0600 whatever the umask: under umask 0 the file would be world-writable, and only the
// daemon's user needs to read it.
bool WriteFileAtomically(const std::string& path, const std::string& text) {
  std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return false;
  const std::string body = text + "\n";
  bool ok = fchmod(fd, 0600) == 0;
  for (size_t done = 0; ok && done < body.size();) {
    ssize_t n = write(fd, body.data() + done, body.size() - done);
    if (n <= 0)
      ok = false;
    else
      done += static_cast<size_t>(n);
  }
  ok = close(fd) == 0 && ok;
  if (!ok) {
    unlink(tmp.c_str());
    return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// --exit_on_stdin_eof: reads standard input until end-of-file (or an error other than EINTR),
// then raises SIGTERM for the main thread's sigwait, so the stop is the ordinary drained one.
// Every thread blocks SIGTERM, so the signal stays pending for the process until sigwait takes it.
void WatchStdinForEof() {
  std::thread([] {
    char buf[256];
    for (;;) {
      const ssize_t n = read(STDIN_FILENO, buf, sizeof(buf));
      if (n > 0 || (n < 0 && errno == EINTR)) continue;
      DIOND_LOG(INFO) << "standard input "
                      << (n == 0 ? "reached end-of-file"
                                 : absl::StrCat("failed: ", std::strerror(errno)))
                      << " (--exit_on_stdin_eof): the parent process is gone; stopping";
      kill(getpid(), SIGTERM);
      return;
    }
  }).detach();
}

}  // namespace

// libgomp and OpenBLAS read how long their idle threads wait once, when they are loaded, before
// main() runs.
// - libgomp's default lets an idle OpenMP thread spin for 300,000 rounds (milliseconds) against
//   OpenBLAS's threads and the trainer, which made steps several times slower on small
//   machines; "passive" (no spinning) cost every parallel loop a futex wake-up instead, 30-40 %
//   of a Dion2 step (docs/TOOLCHAIN.md P20). So GOMP_SPINCOUNT=10000: a thread spins about a
//   tenth of a millisecond, which bridges the gaps between the loops of one step, then sleeps.
// - OpenBLAS's (pthreads build) idle workers call sched_yield in a loop for 2^28 cycles (about
//   0.1 s) after every call before they sleep. Between the LAPACK calls of Dion's QR and the
//   oneDNN GEMMs around them that loop competed with oneDNN's OpenMP threads for the cores:
//   about 20 % of a Dion step's cycles were sched_yield (perf, one GPT-2 layer). So
//   OPENBLAS_THREAD_TIMEOUT=18: 2^18 cycles, about a tenth of a millisecond too.
// - OpenBLAS picks its kernel set by CPU model when it is loaded and falls back to generic
//   (Prescott) kernels on a model it does not know; OPENBLAS_CORETYPE is set to the core the
//   CPU's features call for (kernels/host_blas.h, DecideOpenBlasCore) when OpenBLAS fell back
//   on a CPU with AVX2 or AVX-512 and the operator has not set it.
// Each is set only when the operator has set neither of its variables (any value of them is
// respected); then the daemon re-executes itself (same pid, same arguments) before it has opened
// anything. Returns the names of the variables set here, space-separated (empty: none; execv
// returns only on failure, and then the daemon runs on with the libraries' defaults).
struct WaitLimit {
  const char* name;
  const char* value;
  const char* alternative;  // another variable that, when set, means the operator has chosen
};
constexpr WaitLimit kWaitLimits[] = {
    {"GOMP_SPINCOUNT", "10000", "OMP_WAIT_POLICY"},
    {"OPENBLAS_THREAD_TIMEOUT", "18", "GOTO_THREAD_TIMEOUT"},
};
constexpr char kWaitMarker[] = "DIOND_THREAD_WAIT_SET";
std::string SetThreadWaitLimits(char** argv) {
  if (const char* done = std::getenv(kWaitMarker)) return done;  // after the re-exec
  std::string set;
  for (const WaitLimit& w : kWaitLimits) {
    if (std::getenv(w.name) != nullptr || std::getenv(w.alternative) != nullptr) continue;
    setenv(w.name, w.value, 1);
    absl::StrAppend(&set, set.empty() ? "" : " ", w.name);
  }
  const diond::kernels::OpenBlasCoreDecision core = diond::kernels::PlanOpenBlasCore();
  if (!core.set.empty()) {
    diond::kernels::ApplyOpenBlasCoreDecision(core);
    absl::StrAppend(&set, set.empty() ? "" : " ", "OPENBLAS_CORETYPE");
  }
  if (set.empty()) return set;
  setenv(kWaitMarker, set.c_str(), 1);
  diond::kernels::ExecSelf(argv);
  std::fprintf(stderr,
               "diond: warning: could not re-execute with %s set (%s); set them in the "
               "environment (docs/OPERATIONS.md)\n",
               set.c_str(), std::strerror(errno));
  for (const WaitLimit& w : kWaitLimits) {
    if (absl::StrContains(set, w.name)) unsetenv(w.name);
  }
  diond::kernels::RevertOpenBlasCoreDecision();
  unsetenv(kWaitMarker);
  return "";
}

// The names of `set` that are thread-wait variables (the thread-waiting line's list).
std::string WaitVariablesOf(const std::string& set) {
  std::string out;
  for (const WaitLimit& w : kWaitLimits) {
    if (absl::StrContains(set, w.name)) absl::StrAppend(&out, out.empty() ? "" : " ", w.name);
  }
  return out;
}

namespace {

// --log_level and --log_format, applied. INVALID_ARGUMENT "--flag: why" for a bad value.
absl::Status ApplyLogFlags() {
  auto level = diond::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--log_level: ", level.status().message()));
  }
  diond::SetMinLogLevel(*level);
  auto format = diond::ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  if (!format.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--log_format: ", format.status().message()));
  }
  diond::SetLogFormat(*format);
  return absl::OkStatus();
}

// The world flags into options->world (--listen already parsed, for --peer_service's port).
absl::Status WorldFromFlags(diond::server::DaemonOptions* options) {
  diond::server::WorldConfig& world = options->world;
  world.world_size = absl::GetFlag(FLAGS_world_size);
  if (world.world_size < 1) return absl::InvalidArgumentError("--world_size must be at least 1");
  const std::string device_collectives = absl::GetFlag(FLAGS_world_device_collectives);
  if (device_collectives != "auto" && device_collectives != "gloo") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--world_device_collectives must be auto or gloo, not \"", device_collectives, "\""));
  }
  world.device_nccl = device_collectives == "auto";
  if (world.world_size > 1) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    auto rank = diond::comm::DeriveRank(absl::GetFlag(FLAGS_rank), world.world_size, host,
                                        std::getenv("JOB_COMPLETION_INDEX"));
    if (!rank.ok()) return absl::InvalidArgumentError(rank.status().message());
    world.rank = *rank;
    world.coordinator = absl::GetFlag(FLAGS_coordinator);
    const std::string service = absl::GetFlag(FLAGS_peer_service);
    if (world.coordinator.empty() && !service.empty()) {
      int port = 0;
      for (const auto& a : options->listen) {
        if (a.kind == diond::rpc::ListenAddress::Kind::kTcp) {
          port = a.port;
          break;
        }
      }
      auto c = diond::comm::CoordinatorFromService(host, service, port);
      if (!c.ok() || port == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--peer_service: ",
            c.ok() ? "needs a TCP --listen address with a fixed port" : c.status().message()));
      }
      world.coordinator = *c;
    }
    world.peer_address = absl::GetFlag(FLAGS_peer_listen);
    world.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
    world.peer_timeout = absl::GetFlag(FLAGS_peer_timeout);
    world.join_timeout = absl::GetFlag(FLAGS_join_timeout);
    world.store_limits.max_key_bytes = absl::GetFlag(FLAGS_world_max_key_bytes);
    world.store_limits.max_value_bytes = absl::GetFlag(FLAGS_world_max_value_bytes);
    world.store_limits.max_keys = absl::GetFlag(FLAGS_world_max_keys);
    world.store_limits.max_bytes = absl::GetFlag(FLAGS_world_max_store_bytes);
    if (world.store_limits.max_key_bytes < 64 || world.store_limits.max_value_bytes < 1024 ||
        world.store_limits.max_keys < 16 || world.store_limits.max_bytes < 4096) {
      return absl::InvalidArgumentError(
          "--world_max_key_bytes >= 64, --world_max_value_bytes >= 1024, "
          "--world_max_keys >= 16 and --world_max_store_bytes >= 4096 are needed");
    }
  }
  return absl::OkStatus();
}

// The daemon's options from the flags. INVALID_ARGUMENT "--flag: why" for a bad value; main
// prints it after "diond: " and exits 2.
absl::StatusOr<diond::server::DaemonOptions> OptionsFromFlags() {
  diond::server::DaemonOptions options;
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) {
    listen = absl::StrCat("unix:", diond::rpc::DefaultUnixSocketPath(), ",127.0.0.1:50551");
  }
  auto addresses = diond::rpc::ParseListenAddresses(listen);
  if (!addresses.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--listen: ", addresses.status().message()));
  }
  options.listen = *addresses;
  auto device = diond::kernels::ParseDeviceRequest(absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--device: ", device.status().message()));
  }
  options.device = *device;
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.health_address = absl::GetFlag(FLAGS_health_address);
  options.cuda_plugin = absl::GetFlag(FLAGS_cuda_plugin);
  options.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
  options.allow_shm_from_tcp = absl::GetFlag(FLAGS_allow_shm_from_tcp);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.allow_unauthenticated_tcp = absl::GetFlag(FLAGS_allow_unauthenticated_tcp);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.world_secret_file = absl::GetFlag(FLAGS_world_secret_file);
  options.max_stream_bytes = absl::GetFlag(FLAGS_max_stream_bytes);
  options.rpc_handler_threads = absl::GetFlag(FLAGS_rpc_handler_threads);
  options.step_graphs = absl::GetFlag(FLAGS_step_graphs);
  options.fd_channel_socket = absl::GetFlag(FLAGS_fd_channel_socket);
  options.fd_token_ttl = absl::GetFlag(FLAGS_fd_token_ttl);
  options.fd_max_pending_per_uid = absl::GetFlag(FLAGS_fd_max_pending_per_uid);
  if (options.fd_token_ttl <= absl::ZeroDuration() || options.fd_max_pending_per_uid < 1) {
    return absl::InvalidArgumentError(
        "--fd_token_ttl must be positive and --fd_max_pending_per_uid at least 1");
  }
  options.sessions.max_session_bytes = absl::GetFlag(FLAGS_max_session_bytes);
  options.sessions.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  options.sessions.idle_timeout = absl::GetFlag(FLAGS_session_idle_timeout);
  options.sessions.orphan_grace = absl::GetFlag(FLAGS_orphan_grace);
  options.sessions.orphan_grace_named = absl::GetFlag(FLAGS_orphan_grace_named);
  if (options.sessions.orphan_grace < absl::ZeroDuration() ||
      options.sessions.orphan_grace_named < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--orphan_grace and --orphan_grace_named must be >= 0");
  }
  options.sessions.overlap_bucket_timeout = absl::GetFlag(FLAGS_overlap_bucket_timeout);
  if (options.sessions.overlap_bucket_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--overlap_bucket_timeout must be > 0, got ",
                     absl::FormatDuration(options.sessions.overlap_bucket_timeout)));
  }
  options.sessions.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.sessions.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  options.sessions.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  options.sessions.recover = absl::GetFlag(FLAGS_recover);
  options.sessions.checksum_every = absl::GetFlag(FLAGS_checksum_every);
  options.sessions.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  if (absl::Status s = WorldFromFlags(&options); !s.ok()) return s;
  return options;
}

// --calibrate_engines: before any session exists, since the choice is process-wide
// (kernels/engine_choice.h). Its line (or why it failed) goes into options->engine_calibration.
void CalibrateEnginesIfAsked(diond::server::DaemonOptions* options) {
  if (!absl::GetFlag(FLAGS_calibrate_engines)) return;
  auto ctx = diond::kernels::Context::CpuDefault(options->sessions.compute_threads);
  auto cal = diond::kernels::CalibrateAutoEngines(
      *ctx, diond::optim::IsaBf16Matmul() == diond::optim::Bf16MatmulEngine::kOneDnn);
  if (cal.ok()) {
    diond::kernels::SetAutoEngines(cal->engines);
    options->engine_calibration = cal->Describe();
  } else {
    options->engine_calibration =
        absl::StrCat("calibration failed (", cal.status().message(), "): the defaults");
  }
}

// The start-up line on the thread-waiting variables: each one's value, and which diond set.
std::string ThreadWaitingLine(const std::string& wait_set_here) {
  std::string line = "thread waiting:";
  for (const char* v :
       {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"}) {
    const char* value = std::getenv(v);
    absl::StrAppend(&line, " ", v, "=", value != nullptr ? value : "(unset)");
  }
  if (!wait_set_here.empty()) {
    absl::StrAppend(&line, " (set by diond: ", wait_set_here,
                    "; idle threads wait about 0.1 ms, then sleep; a value of yours is kept)");
  }
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string wait_set_here = WaitVariablesOf(SetThreadWaitLimits(argv));
  // The markers are ours; keep them out of the environment of anything the daemon starts.
  unsetenv(kWaitMarker);
  const diond::kernels::OpenBlasCoreReport blas_core = diond::kernels::ReportOpenBlasCore();
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

  if (absl::Status s = ApplyLogFlags(); !s.ok()) {
    std::fprintf(stderr, "diond: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<diond::server::DaemonOptions> parsed = OptionsFromFlags();
  if (!parsed.ok()) {
    std::fprintf(stderr, "diond: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  diond::server::DaemonOptions options = *std::move(parsed);
  options.openblas_core = blas_core.core;
  options.openblas_core_source = blas_core.source;
  CalibrateEnginesIfAsked(&options);

#ifdef DIOND_TEST_DEVICE_BINARY
  diond::server::ConfigureTestDevice(&options);
#endif
  auto daemon = diond::server::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "diond: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  DIOND_LOG(INFO) << (*daemon)->Describe();
  if (blas_core.ok) {
    DIOND_LOG(INFO) << blas_core.line;
  } else {
    DIOND_LOG(WARNING) << blas_core.line;
  }
  if (!options.engine_calibration.empty()) DIOND_LOG(INFO) << options.engine_calibration;
  DIOND_LOG(INFO) << ThreadWaitingLine(wait_set_here);

  const std::string ready_file = absl::GetFlag(FLAGS_ready_file);
  if (!ready_file.empty() && !WriteFileAtomically(ready_file, (*daemon)->ReadyJson())) {
    DIOND_LOG(ERROR) << "cannot write --ready_file " << ready_file;
  }

  if (absl::GetFlag(FLAGS_exit_on_stdin_eof)) WatchStdinForEof();
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
