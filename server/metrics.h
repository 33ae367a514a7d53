// Prometheus metrics of the daemon (ARCHITECTURE.md §8). The only module that includes
// prometheus-cpp. Everything registers on an injected prometheus::Registry (STYLE.md T5), so tests
// can inspect values without an HTTP server.
//
// Thread-safety: all methods are thread-safe (prometheus-cpp metrics are atomic).
#ifndef DIOND_SERVER_METRICS_H_
#define DIOND_SERVER_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace diond::server {

struct BuildInfo {
  std::string version;
  std::string device;       // e.g. "cpu" or "cuda:0": the selected device
  bool cuda_plugin = false; // built with the CUDA plugin
  std::string compute_device = "cpu";  // where steps run (kernels::ComputeDevice)
};

// The daemon's metric families. Labels: `method` is the full gRPC method name
// ("/diond.v1.Optimizer/Step"), `code` the canonical status code name ("OK", "INVALID_ARGUMENT").
class DaemonMetrics {
 public:
  DaemonMetrics(std::shared_ptr<prometheus::Registry> registry, const BuildInfo& info);

  // Counts one finished RPC and observes its latency.
  void ObserveRpc(absl::string_view method, absl::string_view code, double seconds);
  // Session and step accounting. `outcome` is "applied", "skipped" or "replayed".
  void SetSessions(int64_t sessions);
  void ObserveStep(absl::string_view outcome, double total_seconds, double compute_seconds);
  void ObserveCheckpoint(int64_t bytes);
  // The daemon world (server/comm). `op` is a CollectiveOpName ("all_reduce", ...).
  void ObserveCollective(absl::string_view op, int64_t bytes_sent, double seconds);
  void SetWorldPeers(int64_t live_ranks);
  void SetWorldGeneration(uint64_t generation);
  void CountWorldFailure();
  // World sessions: parameters whose replica differed from the owner's (and was healed).
  void CountChecksumMismatches(int64_t n);

  prometheus::Registry& registry() { return *registry_; }
  const std::shared_ptr<prometheus::Registry>& shared_registry() { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Gauge& sessions_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& step_compute_seconds_;
  prometheus::Counter& checkpoints_;
  prometheus::Counter& checkpoint_bytes_;
  prometheus::Family<prometheus::Counter>& collective_bytes_;
  prometheus::Family<prometheus::Histogram>& collective_seconds_;
  prometheus::Gauge& world_peers_;
  prometheus::Gauge& world_generation_;
  prometheus::Counter& world_failures_;
  prometheus::Counter& checksum_mismatches_;
};

// Standard process_* metrics read from /proc/self at scrape time (prometheus-cpp 1.0 has no
// process collector): cpu seconds, resident and virtual memory, open and max fds, start time,
// threads.
std::shared_ptr<prometheus::Collectable> MakeProcessCollector();

// Serves /metrics over HTTP on `address` ("host:port"; port 0 picks a free one).
// Returns UNAVAILABLE with the address if it cannot bind (civetweb throws; caught here).
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources);
  ~MetricsServer();
  // The bound port (useful with port 0).
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  // The Exposer holds only weak references, so the server owns its sources.
  std::vector<std::shared_ptr<prometheus::Collectable>> sources_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace diond::server

#endif  // DIOND_SERVER_METRICS_H_
