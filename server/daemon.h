// The daemon: composes device selection, metrics and the gRPC server, and owns their lifetime.
// server/main.cc turns flags into DaemonOptions; tests can run a Daemon in-process.
#ifndef DIOND_SERVER_DAEMON_H_
#define DIOND_SERVER_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/device.h"
#include "kernels/tensor.h"
#include "server/listen.h"
#include "server/session/session_manager.h"

namespace diond::rpc {
class RpcServer;
class PeerClient;
}
namespace diond::comm {
class Coordinator;
class World;
}

namespace diond::server {

class DaemonMetrics;
class MetricsServer;

// The daemon world (ARCHITECTURE.md §6; flags in docs/OPERATIONS.md "World").
struct WorldConfig {
  int rank = 0;
  int world_size = 1;          // 1 = no world: nothing below is used
  std::string coordinator;     // rank 0's Peer address, host:port (ranks > 0)
  std::string peer_address = "127.0.0.1";  // what other daemons reach us at (Gloo binds it)
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Seconds(60);
};

struct DaemonOptions {
  std::vector<ListenAddress> listen;
  std::string metrics_address;  // "host:port"; empty = no metrics endpoint
  kernels::DeviceRequest device;
  std::string cuda_plugin;      // empty = next to the executable, then the loader path
  bool allow_insecure_remote = false;
  bool allow_shm_from_tcp = false;
  session::ManagerOptions sessions;
  WorldConfig world;
};

// "cpu" or "cuda:N" (the labels of diond_build_info).
std::string DeviceLabel(kernels::DeviceType type, int index);
// The device part of the start-up line: the selected device, why auto mode fell back to the
// CPU, and, when the steps run elsewhere than the selected device (a GPU host without a CUDA ops
// backend), "steps run on the cpu" with the reason.
std::string DescribeDevice(const kernels::SelectedDevice& selected, kernels::Device compute);

class Daemon {
 public:
  // Selects the device, then starts metrics and gRPC. On any error nothing is left listening.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  const kernels::SelectedDevice& device() const { return device_; }
  std::vector<ListenAddress> bound() const;
  int metrics_port() const;
  // One line for the start-up log: addresses, metrics URL, device.
  std::string Describe() const;
  // JSON with the bound addresses, for --ready_file.
  std::string ReadyJson() const;

  void Shutdown(absl::Duration drain);

  // The daemon world, or null when --world_size is 1. Valid until Shutdown.
  comm::World* world() const { return world_.get(); }

 private:
  Daemon();
  absl::Status JoinWorld(const WorldConfig& config);
  kernels::SelectedDevice device_;
  kernels::Device compute_device_;  // where steps run (kernels::ComputeDevice of device_)
  std::string metrics_address_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<session::SessionManager> sessions_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<rpc::RpcServer> rpc_;
  // World members are declared last so they are destroyed first (they call into the others).
  std::unique_ptr<comm::Coordinator> coordinator_;  // rank 0 of a world only
  std::unique_ptr<rpc::PeerClient> peer_client_;    // ranks > 0 only
  std::unique_ptr<comm::World> world_;
};

}  // namespace diond::server

#endif  // DIOND_SERVER_DAEMON_H_
