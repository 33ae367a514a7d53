// The daemon, the composition root (server/exe, ARCHITECTURE.md §3): composes device selection,
// sessions, the world, metrics and the gRPC server, and owns their lifetime. Nothing below exe/
// includes it. server/exe/main.cc turns flags into DaemonOptions; tests can run a Daemon
// in-process.
#ifndef DIOND_SERVER_EXE_DAEMON_H_
#define DIOND_SERVER_EXE_DAEMON_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/device.h"
#include "kernels/tensor.h"
#include "server/comm/memory_store.h"
#include "server/rpc/listen.h"
#include "server/session/session_manager.h"

namespace diond::rpc {
class RpcServer;
class PeerClient;
struct PeerCredentials;
struct RpcServerOptions;
}  // namespace diond::rpc
namespace diond::fdchannel {
class FdChannel;
}
namespace diond::comm {
class Coordinator;
class World;
}  // namespace diond::comm

namespace diond::server {

using rpc::ListenAddress;  // the daemon listens where the RPC layer serves

class DaemonMetrics;
class DeviceWatch;
class MetricsServer;
class RpcMetrics;

// The daemon world (ARCHITECTURE.md §6; flags in docs/OPERATIONS.md "World").
struct WorldConfig {
  int rank = 0;
  int world_size = 1;                      // 1 = no world: nothing below is used
  std::string coordinator;                 // rank 0's Peer address, host:port (ranks > 0)
  std::string peer_address = "127.0.0.1";  // what other daemons reach us at (Gloo binds it)
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Seconds(60);
  comm::StoreLimits store_limits;  // rank 0's rendezvous store quotas
  // --world_device_collectives=auto: NCCL for world device sessions when steps run on a GPU and
  // the plugin has NCCL; false (gloo): always Gloo, staged through host memory.
  bool device_nccl = true;
};

struct DaemonOptions {
  std::vector<ListenAddress> listen;
  std::string metrics_address;  // "host:port"; empty = no metrics endpoint
  std::string health_address;   // "host:port" serving grpc.health.v1 only; empty = none
  kernels::DeviceRequest device;
  std::string cuda_plugin;  // empty = next to the executable, then the loader path
  bool allow_insecure_remote = false;
  bool allow_shm_from_tcp = false;
  // Security (docs/OPERATIONS.md "Security"). Files are read once at start.
  std::string auth_token_file;                  // bearer tokens for TCP callers
  bool allow_unauthenticated_tcp = false;       // TCP callers without credential are "anonymous"
  std::string tls_cert_file, tls_key_file;      // TLS on TCP listeners and to the coordinator
  std::string tls_client_ca_file;               // mTLS: CA of client (and daemon) certificates
  std::string world_secret_file;                // the world's shared secret (Peer service)
  int64_t max_stream_bytes = int64_t{4} << 30;  // one PushGradients/SetState stream; 0 = no cap
  int rpc_handler_threads = 64;  // the Optimizer service's handler pool (server/rpc/handler_pool.h)
  // Device sessions replay their step's phases as captured graphs where they can (docs/GPU.md
  // "CUDA graphs"); false: every step runs eagerly.
  bool step_graphs = true;
  // The fd channel (docs/DATA_PLANE.md): its socket path; empty = "<first Unix --listen
  // path>.fd" (none without a Unix listen address); "none" = no fd channel.
  std::string fd_channel_socket;
  absl::Duration fd_token_ttl = absl::Seconds(60);
  int fd_max_pending_per_uid = 64;
  session::ManagerOptions sessions;
  WorldConfig world;
  // The CPU's BLAS set-up as main() left it (kernels/host_blas.h, kernels/engine_calibration.h):
  // exported in diond_build_info and the start-up line. Empty = not reported.
  std::string openblas_core;         // the core OpenBLAS runs, e.g. "Zen"
  std::string openblas_core_source;  // "autodetected", "operator" or "diond"
  std::string engine_calibration;    // the calibration's report; empty: none ran
  // A device whose backend the binary registered before Start, through the path a plugin's
  // takes (kernels/plugin/plugin_backend.h RegisterPluginOps: its ops and its device runtime):
  // the steps run there, whatever --device selected. Unset (diond): --device decides.
  std::optional<kernels::Device> registered_device;
  // On a device daemon: a line logged after every step and every change of the session count
  // (e.g. a backend's own counters). Empty: none.
  std::function<std::string()> device_report;
};

// "cpu" or "cuda:N" (the labels of diond_build_info; kernels/device.h).
using kernels::DeviceLabel;
// The device part of the start-up line: the selected device, why auto mode fell back to the
// CPU, and, when the steps run elsewhere than the selected device (a GPU host without a CUDA ops
// backend), "steps run on the cpu" with the reason.
// `note` (when not empty) says where the steps run instead of the default explanation.
std::string DescribeDevice(const kernels::SelectedDevice& selected, kernels::Device compute,
                           const std::string& note = "");

class Daemon {
 public:
  // Selects the device, then starts metrics and gRPC. On any error nothing is left listening.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  const kernels::SelectedDevice& device() const { return device_; }
  std::vector<ListenAddress> bound() const;
  int metrics_port() const;
  int health_port() const;  // 0 = no --health_address
  // The fd channel's socket path; empty = none.
  std::string fd_channel_path() const;
  // One line for the start-up log: addresses, metrics URL, device.
  std::string Describe() const;
  // JSON with the bound addresses, for --ready_file.
  std::string ReadyJson() const;

  void Shutdown(absl::Duration drain);

  // The daemon world, or null when --world_size is 1. Valid until Shutdown.
  comm::World* world() const { return world_.get(); }

 private:
  Daemon();
  // Start's steps, in the order it runs them.
  // The selected device and the one the steps run on (with the note the start-up line gives).
  absl::Status SelectDevices(const DaemonOptions& options);
  // The metrics registry with diond_build_info, and the /metrics endpoint when asked for.
  absl::Status StartMetrics(const DaemonOptions& options);
  // The session manager on the compute device, reporting into the metrics, with the checkpoint
  // store on --state_dir.
  absl::Status StartSessions(const DaemonOptions& options);
  // A device daemon's DeviceWatch, asked by the manager before every step (`manager_options`'
  // device_health); returns the report to run after steps and session changes (empty on the
  // CPU).
  std::function<void()> WatchDevice(const DaemonOptions& options,
                                    session::ManagerOptions* manager_options);
  // The world's credentials (secret or mutual TLS) and, on rank 0, the coordinator the RPC
  // server serves.
  absl::Status PrepareWorld(const DaemonOptions& options, rpc::RpcServerOptions* ro);
  absl::Status StartFdChannel(const DaemonOptions& options, rpc::RpcServerOptions* ro);
  absl::Status StartRpc(const DaemonOptions& options, rpc::RpcServerOptions ro);
  absl::Status JoinWorld(const WorldConfig& config);
  kernels::SelectedDevice device_;
  std::unique_ptr<rpc::PeerCredentials>
      peer_credentials_;            // how this daemon proves itself to the coordinator
  kernels::Device compute_device_;  // where steps run (kernels::ComputeDevice of device_)
  // The CUDA plugin when steps run on a GPU: its NCCL table carries world sessions' collectives
  // on device memory (JoinWorld); null otherwise.
  const DiondCudaPluginV1* cuda_plugin_ = nullptr;
  std::string compute_note_;  // why / how, for the start-up line (DescribeDevice)
  std::string cpu_blas_;      // "OpenBLAS core Zen (autodetected); auto engines ...", ditto
  std::string metrics_address_;
  std::unique_ptr<DaemonMetrics> metrics_;
  // A device daemon's watch on its compute device's context (daemon.cc); null on a CPU daemon.
  std::shared_ptr<DeviceWatch> device_watch_;
  std::unique_ptr<RpcMetrics> rpc_metrics_;  // the RPC layer's observer, into metrics_
  std::unique_ptr<session::SessionManager> sessions_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<fdchannel::FdChannel> fd_channel_;  // outlives rpc_, which takes its fds
  std::unique_ptr<rpc::RpcServer> rpc_;
  // World members are declared last so they are destroyed first (they call into the others).
  std::unique_ptr<comm::Coordinator> coordinator_;  // rank 0 of a world only
  std::unique_ptr<rpc::PeerClient> peer_client_;    // ranks > 0 only
  std::unique_ptr<comm::World> world_;
};

}  // namespace diond::server

#endif  // DIOND_SERVER_EXE_DAEMON_H_
