// Prometheus metrics of the daemon (ARCHITECTURE.md §8). The only module that includes
// prometheus-cpp. Everything registers on an injected prometheus::Registry (STYLE.md T5), so tests
// can inspect values without an HTTP server.
//
// Thread-safety: all methods are thread-safe (prometheus-cpp metrics are atomic).
#ifndef DIOND_SERVER_METRICS_H_
#define DIOND_SERVER_METRICS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
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
  std::string device;                  // e.g. "cpu" or "cuda:0": the selected device
  bool cuda_plugin = false;            // built with the CUDA plugin
  std::string compute_device = "cpu";  // where steps run (kernels::ComputeDevice)
  // The CPU's BLAS (kernels/host_blas.h) and what the `auto` engines resolve to
  // (kernels/engine_choice.h): "onednn" / "openblas"; bf16: "onednn" / "float32_gemm".
  std::string openblas_core = "unknown";
  std::string openblas_core_source = "unknown";  // autodetected, operator or diond
  std::string fp32_gemm_auto = "onednn";
  std::string fp32_symmetric_auto = "onednn";
  std::string bf16_matmul_auto = "float32_gemm";
  bool engines_calibrated = false;
};

// What the sessions hold, read at scrape time (SessionCollector).
struct SessionTotals {
  int64_t state_bytes = 0;   // what --memory_budget_bytes counts, all sessions together
  int64_t steps_behind = 0;  // max over sessions: steps since its last checkpoint (or restore)
};

// Configured limits, exported as gauges (0 = unlimited / off) so dashboards and alerts can
// compare the live values with them.
struct Limits {
  int64_t max_session_bytes = 0;
  int64_t memory_budget_bytes = 0;
  int64_t checkpoint_every = 0;
  int world_size = 1;
  int rank = 0;
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
  // A device daemon's pool (docs/OPERATIONS.md): bytes in use now and the high-water mark.
  void SetDeviceMemory(double in_use_bytes, double peak_bytes);
  // The compute device's context was lost (a sticky CUDA error): diond_device_lost becomes 1.
  void SetDeviceLost();
  // A device session decided to run a phase of its steps ("read", "update", "write") eagerly
  // (reason: "unsupported", "sync_point", "capture_failed", "world", "pageable").
  void CountGraphFallback(const std::string& phase, const std::string& reason);
  // A phase of a device step ran as a graph (mode: "captured", "replayed").
  void CountGraphStep(const std::string& phase, const std::string& mode);
  void ObserveStep(absl::string_view outcome, double total_seconds, double compute_seconds);
  void ObserveCheckpoint(int64_t bytes);  // also sets the last-success timestamp to now
  void CountCheckpointFailure();
  // The session manager closed a session by itself: `reason` "idle" (--session_idle_timeout)
  // or "orphan" (--orphan_grace: its trainer processes exited).
  void CountSessionReaped(const std::string& reason);
  void SetLimits(const Limits& limits);
  // Where the scrape-time session gauges (diond_state_bytes, diond_checkpoint_steps_behind) come
  // from; unset = zeros. Set once the session manager exists.
  void SetSessionSource(std::function<SessionTotals()> source);
  // The collectables to serve: the registry and the scrape-time session gauges.
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables();
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
  prometheus::Family<prometheus::Counter>& sessions_reaped_;
  prometheus::Gauge& device_memory_in_use_;
  prometheus::Gauge& device_memory_peak_;
  prometheus::Gauge& device_lost_;
  prometheus::Family<prometheus::Counter>& graph_fallbacks_;
  prometheus::Family<prometheus::Counter>& graph_steps_;
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
  prometheus::Counter& checkpoint_failures_;
  prometheus::Gauge& checkpoint_last_success_;
  prometheus::Gauge& max_session_bytes_;
  prometheus::Gauge& memory_budget_bytes_;
  prometheus::Gauge& checkpoint_interval_;
  prometheus::Gauge& world_size_;
  prometheus::Gauge& world_rank_;
  class SessionCollector;
  std::shared_ptr<SessionCollector> session_collector_;
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
