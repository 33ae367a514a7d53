#include "server/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <exception>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

namespace diond::server {
namespace {

// Latency buckets from 50 µs to ~100 s: Step over shm is sub-millisecond, checkpoints are seconds.
prometheus::Histogram::BucketBoundaries RpcBuckets() {
  return {5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
          0.1,  0.25, 0.5,    1.0,  2.5,  5.0,    10.0, 30.0, 100.0};
}

prometheus::MetricFamily Gauge(const std::string& name, const std::string& help, double v) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Gauge;
  prometheus::ClientMetric m;
  m.gauge.value = v;
  f.metric.push_back(m);
  return f;
}

class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    std::ifstream stat("/proc/self/stat");
    std::string line;
    if (std::getline(stat, line)) {
      // Fields after the parenthesised command name; see proc(5).
      size_t close = line.rfind(')');
      std::vector<std::string> f = absl::StrSplit(line.substr(close + 2), ' ', absl::SkipEmpty());
      // f[0] is field 3 (state); utime=14, stime=15, num_threads=20, starttime=22, vsize=23,
      // rss=24 -> indices field-3.
      if (f.size() > 21) {
        double utime = std::stod(f[11]), stime = std::stod(f[12]);
        prometheus::MetricFamily cpu;
        cpu.name = "process_cpu_seconds_total";
        cpu.help = "Total user and system CPU time spent in seconds.";
        cpu.type = prometheus::MetricType::Counter;
        prometheus::ClientMetric m;
        m.counter.value = (utime + stime) / ticks;
        cpu.metric.push_back(m);
        out.push_back(cpu);
        out.push_back(
            Gauge("process_threads", "Number of OS threads in the process.", std::stod(f[17])));
        double boot = BootTimeSeconds();
        out.push_back(Gauge("process_start_time_seconds",
                            "Start time of the process since unix epoch in seconds.",
                            boot + std::stod(f[19]) / ticks));
        out.push_back(Gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                            std::stod(f[20])));
        out.push_back(Gauge("process_resident_memory_bytes", "Resident memory size in bytes.",
                            std::stod(f[21]) * page));
      }
    }
    out.push_back(Gauge("process_open_fds", "Number of open file descriptors.", CountFds()));
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
      out.push_back(Gauge("process_max_fds", "Maximum number of open file descriptors.",
                          static_cast<double>(rl.rlim_cur)));
    }
    return out;
  }

 private:
  static double CountFds() {
    DIR* d = opendir("/proc/self/fd");
    if (d == nullptr) return 0;
    double n = 0;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') n += 1;
    }
    closedir(d);
    return n - 1;  // the descriptor of the DIR itself
  }
  static double BootTimeSeconds() {
    std::ifstream s("/proc/stat");
    std::string key;
    double value = 0;
    while (s >> key) {
      if (key == "btime") {
        s >> value;
        return value;
      }
    }
    return 0;
  }
};

// One metric family of the catalogue (docs/OPERATIONS.md), or its single unlabelled series.
prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r, const char* name,
                                                       const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r, const char* name,
                                                   const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& r,
                                                           const char* name, const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}
prometheus::Counter& OneCounter(prometheus::Registry& r, const char* name, const char* help) {
  return CounterFamily(r, name, help).Add({});
}
prometheus::Gauge& OneGauge(prometheus::Registry& r, const char* name, const char* help) {
  return GaugeFamily(r, name, help).Add({});
}
prometheus::Histogram& OneHistogram(prometheus::Registry& r, const char* name, const char* help) {
  return HistogramFamily(r, name, help).Add({}, RpcBuckets());
}

// Every phase's series exist at zero (docs/OPERATIONS.md): each phase with the reasons it can
// have (only the update calls the rules' sync points and compressed Dion's collectives; only the
// read and write phases copy host memory).
void AddGraphSeries(prometheus::Family<prometheus::Counter>& fallbacks,
                    prometheus::Family<prometheus::Counter>& graphs) {
  for (const char* phase : {"read", "update", "write"}) {
    const bool update = std::string(phase) == "update";
    for (const char* reason :
         {"unsupported", "sync_point", "capture_failed", "world", "pageable"}) {
      const std::string r = reason;
      if (update ? r == "pageable" : (r == "sync_point" || r == "world")) continue;
      fallbacks.Add({{"phase", phase}, {"reason", reason}});
    }
    for (const char* mode : {"captured", "replayed"})
      graphs.Add({{"phase", phase}, {"mode", mode}});
  }
}

void RegisterBuildInfo(prometheus::Registry& r, const BuildInfo& info) {
  GaugeFamily(r, "diond_build_info", "Always 1; labels describe the running daemon.")
      .Add({{"version", info.version},
            {"device", info.device},
            {"compute_device", info.compute_device},
            {"cuda_plugin", info.cuda_plugin ? "true" : "false"},
            {"openblas_core", info.openblas_core},
            {"openblas_core_source", info.openblas_core_source},
            {"fp32_gemm_auto", info.fp32_gemm_auto},
            {"fp32_symmetric_auto", info.fp32_symmetric_auto},
            {"bf16_matmul_auto", info.bf16_matmul_auto},
            {"engines_calibrated", info.engines_calibrated ? "true" : "false"}})
      .Set(1);
}

}  // namespace

// diond_state_bytes and diond_checkpoint_steps_behind, computed from the sessions at scrape time.
class DaemonMetrics::SessionCollector : public prometheus::Collectable {
 public:
  void SetSource(std::function<SessionTotals()> source) {
    absl::MutexLock lock(&mu_);
    source_ = std::move(source);
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    SessionTotals totals;
    {
      absl::MutexLock lock(&mu_);
      if (source_) totals = source_();
    }
    return {Gauge("diond_state_bytes",
                  "Optimizer state and daemon-owned arenas of all open sessions, in bytes (what "
                  "--memory_budget_bytes limits).",
                  static_cast<double>(totals.state_bytes)),
            Gauge("diond_checkpoint_steps_behind",
                  "Largest number of steps any open session has applied since its last "
                  "checkpoint (or restore).",
                  static_cast<double>(totals.steps_behind))};
  }

 private:
  mutable absl::Mutex mu_;
  std::function<SessionTotals()> source_ ABSL_GUARDED_BY(mu_);
};

DaemonMetrics::DaemonMetrics(std::shared_ptr<prometheus::Registry> registry, const BuildInfo& info)
    : registry_(std::move(registry)),
      rpcs_(CounterFamily(*registry_, "diond_rpcs_total",
                          "Finished gRPC calls by method and status code.")),
      rpc_seconds_(HistogramFamily(*registry_, "diond_rpc_duration_seconds",
                                   "Latency of finished gRPC calls by method and status code.")),
      sessions_(OneGauge(*registry_, "diond_sessions", "Open optimizer sessions.")),
      sessions_reaped_(CounterFamily(*registry_, "diond_sessions_reaped_total",
                                     "Sessions the daemon closed by itself, by reason: idle "
                                     "(--session_idle_timeout) or orphan (every trainer process "
                                     "that created or used it exited; --orphan_grace).")),
      device_memory_in_use_(OneGauge(*registry_, "diond_device_memory_in_use_bytes",
                                     "Bytes of the compute device's pool handed out and not "
                                     "freed (0 on a CPU daemon).")),
      device_memory_peak_(OneGauge(*registry_, "diond_device_memory_peak_bytes",
                                   "High-water mark of diond_device_memory_in_use_bytes since "
                                   "the daemon started.")),
      device_lost_(OneGauge(*registry_, "diond_device_lost",
                            "1 once a sticky error (an illegal address, a kernel fault) has "
                            "lost the compute device's context: health is NOT_SERVING and "
                            "device steps are refused until the daemon restarts; else 0.")),
      graph_fallbacks_(
          CounterFamily(*registry_, "diond_step_graph_fallbacks_total",
                        "Device sessions whose step phase (read, update, write) runs "
                        "eagerly instead of as a captured graph, by phase and reason "
                        "(unsupported, sync_point, capture_failed, world, pageable).")),
      graph_steps_(CounterFamily(*registry_, "diond_step_graphs_total",
                                 "Device step phases (read, update, write) that ran as a graph, by "
                                 "phase and mode: captured (a new graph) or replayed.")),
      steps_(CounterFamily(*registry_, "diond_steps_total",
                           "Step RPCs that succeeded, by outcome (applied, skipped, replayed).")),
      step_seconds_(OneHistogram(*registry_, "diond_step_duration_seconds",
                                 "Wall time of applied steps inside the daemon.")),
      step_compute_seconds_(OneHistogram(*registry_, "diond_step_compute_seconds",
                                         "Optimizer compute time of applied steps.")),
      checkpoints_(OneCounter(*registry_, "diond_checkpoints_total", "Checkpoints written.")),
      checkpoint_bytes_(
          OneCounter(*registry_, "diond_checkpoint_bytes_total", "Bytes of checkpoints written.")),
      collective_bytes_(CounterFamily(*registry_, "diond_collective_bytes_total",
                                      "Bytes this daemon sent in collectives, by op.")),
      collective_seconds_(HistogramFamily(*registry_, "diond_collective_seconds",
                                          "Wall time of collectives, by op.")),
      world_peers_(OneGauge(*registry_, "diond_world_peers",
                            "Live ranks of the daemon world as the coordinator reports them.")),
      world_generation_(OneGauge(*registry_, "diond_world_generation",
                                 "Generation of the world's current communicator; 0 = none.")),
      world_failures_(OneCounter(*registry_, "diond_world_failures_total",
                                 "Times the daemon world broke (lost rank, lost coordinator, "
                                 "failed collective).")),
      checksum_mismatches_(OneCounter(*registry_, "diond_world_checksum_mismatches_total",
                                      "World sessions: parameters whose copy on this daemon "
                                      "differed from the owner's at a --checksum_every check "
                                      "(each was replaced by the owner's copy).")),
      checkpoint_failures_(OneCounter(*registry_, "diond_checkpoint_failures_total",
                                      "Checkpoints of open sessions that could not be written "
                                      "(automatic or requested).")),
      checkpoint_last_success_(OneGauge(*registry_,
                                        "diond_checkpoint_last_success_timestamp_seconds",
                                        "Unix time of the last checkpoint written; 0 = none.")),
      max_session_bytes_(OneGauge(*registry_, "diond_max_session_bytes",
                                  "--max_session_bytes: the largest state one session may "
                                  "hold; 0 = unlimited.")),
      memory_budget_bytes_(OneGauge(*registry_, "diond_memory_budget_bytes",
                                    "--memory_budget_bytes: the state all sessions together "
                                    "may hold; 0 = unlimited.")),
      checkpoint_interval_(OneGauge(*registry_, "diond_checkpoint_interval_steps",
                                    "--checkpoint_every (with --state_dir): automatic "
                                    "checkpoint interval in steps; 0 = off.")),
      world_size_(OneGauge(*registry_, "diond_world_size",
                           "--world_size: daemons the world should have; 1 = no world.")),
      world_rank_(OneGauge(*registry_, "diond_world_rank",
                           "This daemon's rank in the world (0 without a world).")),
      session_collector_(std::make_shared<SessionCollector>()) {
  world_size_.Set(1);
  for (const char* reason : {"idle", "orphan"}) sessions_reaped_.Add({{"reason", reason}});
  AddGraphSeries(graph_fallbacks_, graph_steps_);
  RegisterBuildInfo(*registry_, info);
}

void DaemonMetrics::ObserveRpc(absl::string_view method, absl::string_view code, double seconds) {
  std::map<std::string, std::string> labels{{"method", std::string(method)},
                                            {"code", std::string(code)}};
  rpcs_.Add(labels).Increment();
  rpc_seconds_.Add(labels, RpcBuckets()).Observe(seconds);
}

void DaemonMetrics::SetSessions(int64_t sessions) { sessions_.Set(static_cast<double>(sessions)); }

void DaemonMetrics::CountGraphFallback(const std::string& phase, const std::string& reason) {
  graph_fallbacks_.Add({{"phase", phase}, {"reason", reason}}).Increment();
}

void DaemonMetrics::CountGraphStep(const std::string& phase, const std::string& mode) {
  graph_steps_.Add({{"phase", phase}, {"mode", mode}}).Increment();
}

void DaemonMetrics::SetDeviceMemory(double in_use_bytes, double peak_bytes) {
  device_memory_in_use_.Set(in_use_bytes);
  device_memory_peak_.Set(peak_bytes);
}

void DaemonMetrics::SetDeviceLost() { device_lost_.Set(1); }

void DaemonMetrics::ObserveStep(absl::string_view outcome, double total_seconds,
                                double compute_seconds) {
  steps_.Add({{"outcome", std::string(outcome)}}).Increment();
  if (outcome == "applied") {
    step_seconds_.Observe(total_seconds);
    step_compute_seconds_.Observe(compute_seconds);
  }
}

void DaemonMetrics::ObserveCheckpoint(int64_t bytes) {
  checkpoints_.Increment();
  checkpoint_bytes_.Increment(static_cast<double>(bytes));
  checkpoint_last_success_.SetToCurrentTime();
}

void DaemonMetrics::CountCheckpointFailure() { checkpoint_failures_.Increment(); }

void DaemonMetrics::CountSessionReaped(const std::string& reason) {
  sessions_reaped_.Add({{"reason", reason}}).Increment();
}

void DaemonMetrics::SetLimits(const Limits& limits) {
  max_session_bytes_.Set(static_cast<double>(limits.max_session_bytes));
  memory_budget_bytes_.Set(static_cast<double>(limits.memory_budget_bytes));
  checkpoint_interval_.Set(static_cast<double>(limits.checkpoint_every));
  world_size_.Set(limits.world_size);
  world_rank_.Set(limits.rank);
}

void DaemonMetrics::SetSessionSource(std::function<SessionTotals()> source) {
  session_collector_->SetSource(std::move(source));
}

std::vector<std::shared_ptr<prometheus::Collectable>> DaemonMetrics::collectables() {
  return {registry_, session_collector_};
}

void DaemonMetrics::ObserveCollective(absl::string_view op, int64_t bytes_sent, double seconds) {
  std::map<std::string, std::string> labels{{"op", std::string(op)}};
  collective_bytes_.Add(labels).Increment(static_cast<double>(bytes_sent));
  collective_seconds_.Add(labels, RpcBuckets()).Observe(seconds);
}

void DaemonMetrics::SetWorldPeers(int64_t live_ranks) {
  world_peers_.Set(static_cast<double>(live_ranks));
}

void DaemonMetrics::SetWorldGeneration(uint64_t generation) {
  world_generation_.Set(static_cast<double>(generation));
}

void DaemonMetrics::CountWorldFailure() { world_failures_.Increment(); }
void DaemonMetrics::CountChecksumMismatches(int64_t n) {
  checksum_mismatches_.Increment(static_cast<double>(n));
}

std::shared_ptr<prometheus::Collectable> MakeProcessCollector() {
  return std::make_shared<ProcessCollector>();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources) {
  std::unique_ptr<MetricsServer> s(new MetricsServer);
  try {
    // One civetweb worker thread is plenty for a scrape endpoint.
    s->exposer_ = std::make_unique<prometheus::Exposer>(address, 1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  s->sources_ = std::move(sources);
  for (auto& src : s->sources_) s->exposer_->RegisterCollectable(src);
  std::vector<int> ports = s->exposer_->GetListeningPorts();
  s->port_ = ports.empty() ? 0 : ports.front();
  return s;
}

MetricsServer::~MetricsServer() = default;

}  // namespace diond::server
