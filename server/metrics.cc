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
      rpcs_(prometheus::BuildCounter()
                .Name("diond_rpcs_total")
                .Help("Finished gRPC calls by method and status code.")
                .Register(*registry_)),
      rpc_seconds_(prometheus::BuildHistogram()
                       .Name("diond_rpc_duration_seconds")
                       .Help("Latency of finished gRPC calls by method and status code.")
                       .Register(*registry_)),
      sessions_(prometheus::BuildGauge()
                    .Name("diond_sessions")
                    .Help("Open optimizer sessions.")
                    .Register(*registry_)
                    .Add({})),
      sessions_reaped_(prometheus::BuildCounter()
                           .Name("diond_sessions_reaped_total")
                           .Help("Sessions the daemon closed by itself, by reason: idle "
                                 "(--session_idle_timeout) or orphan (every trainer process "
                                 "that created or used it exited; --orphan_grace).")
                           .Register(*registry_)),
      device_memory_in_use_(prometheus::BuildGauge()
                                .Name("diond_device_memory_in_use_bytes")
                                .Help("Bytes of the compute device's pool handed out and not "
                                      "freed (0 on a CPU daemon).")
                                .Register(*registry_)
                                .Add({})),
      device_memory_peak_(prometheus::BuildGauge()
                              .Name("diond_device_memory_peak_bytes")
                              .Help("High-water mark of diond_device_memory_in_use_bytes since "
                                    "the daemon started.")
                              .Register(*registry_)
                              .Add({})),
      device_lost_(prometheus::BuildGauge()
                       .Name("diond_device_lost")
                       .Help("1 once a sticky error (an illegal address, a kernel fault) has "
                             "lost the compute device's context: health is NOT_SERVING and "
                             "device steps are refused until the daemon restarts; else 0.")
                       .Register(*registry_)
                       .Add({})),
      graph_fallbacks_(prometheus::BuildCounter()
                           .Name("diond_step_graph_fallbacks_total")
                           .Help("Device sessions whose step phase (read, update, write) runs "
                                 "eagerly instead of as a captured graph, by phase and reason "
                                 "(unsupported, sync_point, capture_failed, world, pageable).")
                           .Register(*registry_)),
      graph_steps_(prometheus::BuildCounter()
                       .Name("diond_step_graphs_total")
                       .Help("Device step phases (read, update, write) that ran as a graph, by "
                             "phase and mode: captured (a new graph) or replayed.")
                       .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("diond_steps_total")
                 .Help("Step RPCs that succeeded, by outcome (applied, skipped, replayed).")
                 .Register(*registry_)),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("diond_step_duration_seconds")
                        .Help("Wall time of applied steps inside the daemon.")
                        .Register(*registry_)
                        .Add({}, RpcBuckets())),
      step_compute_seconds_(prometheus::BuildHistogram()
                                .Name("diond_step_compute_seconds")
                                .Help("Optimizer compute time of applied steps.")
                                .Register(*registry_)
                                .Add({}, RpcBuckets())),
      checkpoints_(prometheus::BuildCounter()
                       .Name("diond_checkpoints_total")
                       .Help("Checkpoints written.")
                       .Register(*registry_)
                       .Add({})),
      checkpoint_bytes_(prometheus::BuildCounter()
                            .Name("diond_checkpoint_bytes_total")
                            .Help("Bytes of checkpoints written.")
                            .Register(*registry_)
                            .Add({})),
      collective_bytes_(prometheus::BuildCounter()
                            .Name("diond_collective_bytes_total")
                            .Help("Bytes this daemon sent in collectives, by op.")
                            .Register(*registry_)),
      collective_seconds_(prometheus::BuildHistogram()
                              .Name("diond_collective_seconds")
                              .Help("Wall time of collectives, by op.")
                              .Register(*registry_)),
      world_peers_(prometheus::BuildGauge()
                       .Name("diond_world_peers")
                       .Help("Live ranks of the daemon world as the coordinator reports them.")
                       .Register(*registry_)
                       .Add({})),
      world_generation_(prometheus::BuildGauge()
                            .Name("diond_world_generation")
                            .Help("Generation of the world's current communicator; 0 = none.")
                            .Register(*registry_)
                            .Add({})),
      world_failures_(prometheus::BuildCounter()
                          .Name("diond_world_failures_total")
                          .Help("Times the daemon world broke (lost rank, lost coordinator, "
                                "failed collective).")
                          .Register(*registry_)
                          .Add({})),
      checksum_mismatches_(prometheus::BuildCounter()
                               .Name("diond_world_checksum_mismatches_total")
                               .Help("World sessions: parameters whose copy on this daemon "
                                     "differed from the owner's at a --checksum_every check "
                                     "(each was replaced by the owner's copy).")
                               .Register(*registry_)
                               .Add({})),
      checkpoint_failures_(prometheus::BuildCounter()
                               .Name("diond_checkpoint_failures_total")
                               .Help("Checkpoints of open sessions that could not be written "
                                     "(automatic or requested).")
                               .Register(*registry_)
                               .Add({})),
      checkpoint_last_success_(prometheus::BuildGauge()
                                   .Name("diond_checkpoint_last_success_timestamp_seconds")
                                   .Help("Unix time of the last checkpoint written; 0 = none.")
                                   .Register(*registry_)
                                   .Add({})),
      max_session_bytes_(prometheus::BuildGauge()
                             .Name("diond_max_session_bytes")
                             .Help("--max_session_bytes: the largest state one session may "
                                   "hold; 0 = unlimited.")
                             .Register(*registry_)
                             .Add({})),
      memory_budget_bytes_(prometheus::BuildGauge()
                               .Name("diond_memory_budget_bytes")
                               .Help("--memory_budget_bytes: the state all sessions together "
                                     "may hold; 0 = unlimited.")
                               .Register(*registry_)
                               .Add({})),
      checkpoint_interval_(prometheus::BuildGauge()
                               .Name("diond_checkpoint_interval_steps")
                               .Help("--checkpoint_every (with --state_dir): automatic "
                                     "checkpoint interval in steps; 0 = off.")
                               .Register(*registry_)
                               .Add({})),
      world_size_(prometheus::BuildGauge()
                      .Name("diond_world_size")
                      .Help("--world_size: daemons the world should have; 1 = no world.")
                      .Register(*registry_)
                      .Add({})),
      world_rank_(prometheus::BuildGauge()
                      .Name("diond_world_rank")
                      .Help("This daemon's rank in the world (0 without a world).")
                      .Register(*registry_)
                      .Add({})),
      session_collector_(std::make_shared<SessionCollector>()) {
  world_size_.Set(1);
  for (const char* reason : {"idle", "orphan"}) sessions_reaped_.Add({{"reason", reason}});
  // Every phase's series exist at zero (docs/OPERATIONS.md): each phase with the reasons it
  // can have (only the update calls the rules' sync points and compressed Dion's collectives;
  // only the read and write phases copy host memory).
  for (const char* phase : {"read", "update", "write"}) {
    const bool update = std::string(phase) == "update";
    for (const char* reason :
         {"unsupported", "sync_point", "capture_failed", "world", "pageable"}) {
      const std::string r = reason;
      if (update ? r == "pageable" : (r == "sync_point" || r == "world")) continue;
      graph_fallbacks_.Add({{"phase", phase}, {"reason", reason}});
    }
    for (const char* mode : {"captured", "replayed"}) {
      graph_steps_.Add({{"phase", phase}, {"mode", mode}});
    }
  }
  prometheus::BuildGauge()
      .Name("diond_build_info")
      .Help("Always 1; labels describe the running daemon.")
      .Register(*registry_)
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
