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
#include "server/listen.h"
#include "server/session/session_manager.h"

namespace diond::rpc {
class RpcServer;
}

namespace diond::server {

class DaemonMetrics;
class MetricsServer;

struct DaemonOptions {
  std::vector<ListenAddress> listen;
  std::string metrics_address;  // "host:port"; empty = no metrics endpoint
  kernels::DeviceRequest device;
  std::string cuda_plugin;      // empty = next to the executable, then the loader path
  bool allow_insecure_remote = false;
  bool allow_shm_from_tcp = false;
  session::ManagerOptions sessions;
};

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

 private:
  Daemon();
  kernels::SelectedDevice device_;
  std::string metrics_address_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<session::SessionManager> sessions_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<rpc::RpcServer> rpc_;
};

}  // namespace diond::server

#endif  // DIOND_SERVER_DAEMON_H_
