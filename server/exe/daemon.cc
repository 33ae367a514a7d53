#include "server/exe/daemon.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/engine_choice.h"
#include "kernels/optim/optimizer_types.h"
#include "kernels/plugin/plugin_backend.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "server/checkpoint/directory_store.h"
#include "server/comm/membership.h"
#include "server/comm/world.h"
#include "server/fdchannel/fd_channel.h"
#include "server/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/grpc_server.h"
#include "server/rpc/peer_client.h"
#include "server/version.h"

namespace diond::server {

using rpc::ParseListenAddresses;

// The RPC layer's observer (server/rpc/rpc_observer.h), counting into the daemon's metrics.
class RpcMetrics final : public rpc::RpcObserver {
 public:
  explicit RpcMetrics(DaemonMetrics* metrics) : metrics_(metrics) {}
  void ObserveRpc(absl::string_view method, absl::string_view code, double seconds) override {
    metrics_->ObserveRpc(method, code, seconds);
  }

 private:
  DaemonMetrics* metrics_;
};

// The compute device's health (docs/GPU.md "Errors"): once a sticky error has lost its context,
// the daemon says so once, everywhere: an ERROR line with the reason, diond_device_lost 1, and
// gRPC health NOT_SERVING (the server and diond.v1.Optimizer); the session manager refuses
// device steps (its device_health hook is Check). A lost context never comes back in-process.
class DeviceWatch {
 public:
  DeviceWatch(kernels::Device device, DaemonMetrics* metrics)
      : device_(device), metrics_(metrics) {}

  // The device runtime's health; the first failure is reported as above.
  absl::Status Check() {
    absl::Status h = kernels::DeviceRuntimeFor(device_.type).health(device_);
    if (h.ok()) return h;
    absl::MutexLock lock(&mu_);
    if (!lost_) {
      lost_ = true;
      DIOND_LOG(ERROR) << "the compute device " << DeviceLabel(device_.type, device_.index)
                       << " is lost: " << h.message()
                       << "; gRPC health is NOT_SERVING and device steps are refused until the "
                          "daemon restarts";
      metrics_->SetDeviceLost();
      if (rpc_ != nullptr) rpc_->SetOptimizerNotServing();
    }
    return h;
  }
  // The RPC server whose health follows (null: none any more).
  void AttachRpc(rpc::RpcServer* rpc) {
    absl::MutexLock lock(&mu_);
    rpc_ = rpc;
    if (lost_ && rpc_ != nullptr) rpc_->SetOptimizerNotServing();
  }

 private:
  const kernels::Device device_;
  DaemonMetrics* const metrics_;
  absl::Mutex mu_;
  bool lost_ ABSL_GUARDED_BY(mu_) = false;
  rpc::RpcServer* rpc_ ABSL_GUARDED_BY(mu_) = nullptr;
};

std::string DescribeDevice(const kernels::SelectedDevice& selected, kernels::Device compute,
                           const std::string& note) {
  std::string s = absl::StrCat("device ", selected.name);
  if (!selected.fallback_reason.empty()) {
    absl::StrAppend(&s, " (no GPU in use: ", selected.fallback_reason, ")");
  }
  if (!note.empty()) {
    absl::StrAppend(&s, "; ", note);
  } else if (compute.type != kernels::DeviceType::kCpu) {
    absl::StrAppend(&s, "; steps run on ", DeviceLabel(compute.type, compute.index),
                    " (device sessions: state and staging in device memory)");
  } else if (compute.type != selected.type) {
    absl::StrAppend(&s, "; steps run on the ", DeviceLabel(compute.type, compute.index),
                    ": this build has no ops backend for ",
                    DeviceLabel(selected.type, selected.index), " yet");
  }
  return s;
}

Daemon::Daemon() = default;
Daemon::~Daemon() { Shutdown(absl::ZeroDuration()); }

namespace {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().size() > (size_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is over 1 MiB"));
  }
  return text.str();
}

// The flags that decide what may listen where, checked before anything starts: TCP off loopback
// needs TLS (or --allow_insecure_remote), and so does /metrics (plain HTTP, every session's
// counters).
absl::Status CheckListenerFlags(const DaemonOptions& options) {
  const bool tls = !options.tls_cert_file.empty();
  for (const auto& a : options.listen) {
    if (a.kind == ListenAddress::Kind::kTcp && !a.loopback && !tls &&
        !options.allow_insecure_remote) {
      return absl::InvalidArgumentError(
          absl::StrCat("refusing to listen on non-loopback ", a.ToString(),
                       " without TLS; use a loopback or unix address, or --allow_insecure_remote"));
    }
  }
  if (!options.metrics_address.empty() && !options.allow_insecure_remote) {
    auto m = ParseListenAddresses(options.metrics_address);
    if (!m.ok() || m->size() != 1 || (*m)[0].kind != ListenAddress::Kind::kTcp) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_address '", options.metrics_address, "' is not one HOST:PORT"));
    }
    if (!(*m)[0].loopback) {
      return absl::InvalidArgumentError(
          absl::StrCat("refusing to serve /metrics on non-loopback ", (*m)[0].ToString(),
                       " (plain HTTP); use a loopback address, or --allow_insecure_remote"));
    }
  }
  if (options.rpc_handler_threads < 1 || options.rpc_handler_threads > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rpc_handler_threads=", options.rpc_handler_threads, ": must be 1 to 4096"));
  }
  if (options.max_stream_bytes < 0) {
    return absl::InvalidArgumentError("--max_stream_bytes must be >= 0");
  }
  return absl::OkStatus();
}

// The session manager's hooks into the metrics. `device_report` (may be empty) runs after every
// step and every change of the session count.
session::ManagerObserver MetricsObserver(DaemonMetrics* metrics,
                                         const std::function<void()>& device_report) {
  session::ManagerObserver observer;
  observer.on_sessions_changed = [metrics, device_report](int64_t n) {
    metrics->SetSessions(n);
    if (device_report) device_report();
  };
  observer.on_step = [metrics, device_report](const std::string&, const session::StepResult& r) {
    if (device_report) device_report();
    if (!r.replayed) {
      for (const auto& [phase, reason] : r.graph_fallbacks) {
        metrics->CountGraphFallback(phase, reason);
      }
      for (const auto& [phase, mode] : r.graph_steps) metrics->CountGraphStep(phase, mode);
    }
    metrics->ObserveStep(r.replayed  ? "replayed"
                         : r.skipped ? "skipped"
                                     : "applied",
                         static_cast<double>(r.total_micros) * 1e-6,
                         static_cast<double>(r.compute_micros) * 1e-6);
    if (!r.replayed && r.checksum_mismatches > 0) {
      metrics->CountChecksumMismatches(r.checksum_mismatches);
    }
  };
  observer.on_checkpoint = [metrics](const std::string&, const std::string&, int64_t bytes) {
    metrics->ObserveCheckpoint(bytes);
  };
  observer.on_checkpoint_failed = [metrics](const std::string&, const absl::Status&) {
    metrics->CountCheckpointFailure();
  };
  observer.on_session_reaped = [metrics](const std::string&, const std::string& reason) {
    metrics->CountSessionReaped(reason);
  };
  return observer;
}

// The RPC server's credentials from the files the flags name: bearer tokens and TLS.
absl::StatusOr<rpc::RpcServerOptions> RpcSecurity(const DaemonOptions& options) {
  rpc::RpcServerOptions ro;
  if (!options.auth_token_file.empty()) {
    DIOND_ASSIGN_OR_RETURN(std::string text,
                           ReadWholeFile(options.auth_token_file, "--auth_token_file"));
    auto tokens = rpc::ParseTokenFile(text);
    if (!tokens.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_token_file ", options.auth_token_file,
                                                     ": ", tokens.status().message()));
    }
    ro.auth.tokens = *std::move(tokens);
  }
  ro.auth.allow_unauthenticated_tcp = options.allow_unauthenticated_tcp;
  if (!options.tls_cert_file.empty()) {
    DIOND_ASSIGN_OR_RETURN(ro.tls_cert, ReadWholeFile(options.tls_cert_file, "--tls_cert"));
  }
  if (!options.tls_key_file.empty()) {
    DIOND_ASSIGN_OR_RETURN(ro.tls_key, ReadWholeFile(options.tls_key_file, "--tls_key"));
  }
  if (!options.tls_client_ca_file.empty()) {
    DIOND_ASSIGN_OR_RETURN(ro.tls_client_ca,
                           ReadWholeFile(options.tls_client_ca_file, "--tls_client_ca"));
  }
  return ro;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  DIOND_RETURN_IF_ERROR(CheckListenerFlags(options));
  std::unique_ptr<Daemon> d(new Daemon);
  DIOND_RETURN_IF_ERROR(d->SelectDevices(options));
  DIOND_RETURN_IF_ERROR(d->StartMetrics(options));
  DIOND_RETURN_IF_ERROR(d->StartSessions(options));
  DIOND_ASSIGN_OR_RETURN(rpc::RpcServerOptions ro, RpcSecurity(options));
  DIOND_RETURN_IF_ERROR(d->PrepareWorld(options, &ro));
  DIOND_RETURN_IF_ERROR(d->StartFdChannel(options, &ro));
  DIOND_RETURN_IF_ERROR(d->StartRpc(options, std::move(ro)));
  if (options.world.world_size > 1) DIOND_RETURN_IF_ERROR(d->JoinWorld(options.world));
  return d;
}

absl::Status Daemon::SelectDevices(const DaemonOptions& options) {
  DIOND_ASSIGN_OR_RETURN(device_, kernels::SelectDevice(options.device, options.cuda_plugin));
  // The device the steps run on: a GPU once the plugin's ops and runtime are registered and its
  // runtime says the update rules run on device memory; else the CPU, said plainly in the
  // start-up line and metrics.
  if (options.registered_device.has_value()) {
    compute_device_ = *options.registered_device;
    if (kernels::FindOpsBackend(compute_device_.type) == nullptr ||
        kernels::FindDeviceRuntime(compute_device_.type) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the registered device ", DeviceLabel(compute_device_.type, compute_device_.index),
          " has no ops backend or no device runtime"));
    }
  } else if (device_.type == kernels::DeviceType::kCuda) {
    if (absl::Status reg = kernels::RegisterCudaOps(options.cuda_plugin); !reg.ok()) {
      compute_device_ = kernels::Device{kernels::DeviceType::kCpu, 0};
      compute_note_ =
          absl::StrCat("steps run on the cpu: the CUDA ops did not register: ", reg.message());
    } else {
      compute_device_ = kernels::ComputeDevice(device_);
      if (compute_device_.type == kernels::DeviceType::kCuda) {
        auto plugin = kernels::LoadCudaPlugin(options.cuda_plugin);
        if (plugin.ok()) cuda_plugin_ = *plugin;
      }
    }
  } else {
    compute_device_ = kernels::ComputeDevice(device_);
  }
  if (compute_device_.type != kernels::DeviceType::kCpu) {
    const kernels::DeviceRuntime* runtime = kernels::FindDeviceRuntime(compute_device_.type);
    if (runtime == nullptr || !runtime->rules_on_device) {
      // The rules would be handed device pointers they read from the host.
      compute_note_ = absl::StrCat("steps run on the cpu: the update rules do not run on a ",
                                   DeviceLabel(compute_device_.type, compute_device_.index),
                                   " context", runtime == nullptr ? " (no device runtime)" : "");
      compute_device_ = kernels::Device{kernels::DeviceType::kCpu, 0};
    }
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics(const DaemonOptions& options) {
  BuildInfo info;
  info.version = kVersion;
  info.device = DeviceLabel(device_.type, device_.index);
  info.compute_device = DeviceLabel(compute_device_.type, compute_device_.index);
  info.cuda_plugin = device_.cuda_plugin_loaded;
  const kernels::AutoEngines engines = kernels::CurrentAutoEngines();
  auto name = [](kernels::Fp32GemmEngine e) {
    return e == kernels::Fp32GemmEngine::kOpenBlas ? "openblas" : "onednn";
  };
  if (!options.openblas_core.empty()) info.openblas_core = options.openblas_core;
  if (!options.openblas_core_source.empty()) {
    info.openblas_core_source = options.openblas_core_source;
  }
  info.fp32_gemm_auto = name(engines.fp32_gemm);
  info.fp32_symmetric_auto = name(engines.fp32_symmetric);
  info.bf16_matmul_auto = std::string(
      optim::Bf16MatmulEngineName(optim::ResolveBf16Matmul(optim::Bf16MatmulEngine::kAuto)));
  info.engines_calibrated = engines.bf16_measured;
  cpu_blas_ = absl::StrCat("OpenBLAS core ", info.openblas_core, " (", info.openblas_core_source,
                           "); auto engines", engines.bf16_measured ? " (calibrated)" : "",
                           ": fp32 GEMM ", info.fp32_gemm_auto, ", fp32 symmetric ",
                           info.fp32_symmetric_auto, ", bf16_reference ", info.bf16_matmul_auto);
  metrics_ = std::make_unique<DaemonMetrics>(std::make_shared<prometheus::Registry>(), info);

  // Metrics start after the CUDA plugin is loaded: the plugin's TLS is dynamic (dlopen), so
  // civetweb's small-stack threads still start (TOOLCHAIN.md P1).
  if (options.metrics_address.empty()) return absl::OkStatus();
  metrics_address_ = options.metrics_address;
  auto sources = metrics_->collectables();
  sources.push_back(MakeProcessCollector());
  DIOND_ASSIGN_OR_RETURN(metrics_server_,
                         MetricsServer::Start(options.metrics_address, std::move(sources)));
  return absl::OkStatus();
}

std::function<void()> Daemon::WatchDevice(const DaemonOptions& options,
                                          session::ManagerOptions* manager_options) {
  if (compute_device_.type == kernels::DeviceType::kCpu) return nullptr;
  // A device daemon: the pool's bytes in use and high-water mark after every step and every
  // change of the session count (and the binary's own report line, if it has one).
  DaemonMetrics* metrics = metrics_.get();
  const kernels::Device dev = compute_device_;
  std::function<std::string()> extra_report = options.device_report;
  device_watch_ = std::make_shared<DeviceWatch>(dev, metrics);
  std::shared_ptr<DeviceWatch> watch = device_watch_;
  manager_options->device_health = [watch](kernels::Device) { return watch->Check(); };
  std::function<void()> report = [metrics, dev, extra_report, watch] {
    if (auto m = kernels::DeviceRuntimeFor(dev.type).memory_stats(dev); m.ok()) {
      metrics->SetDeviceMemory(static_cast<double>(m->in_use), static_cast<double>(m->peak));
    }
    (void)watch->Check();
    if (extra_report) DIOND_LOG(INFO) << extra_report();
  };
  report();
  return report;
}

absl::Status Daemon::StartSessions(const DaemonOptions& options) {
  DaemonMetrics* metrics = metrics_.get();
  session::ManagerOptions manager_options = options.sessions;
  manager_options.compute_device = compute_device_;
  manager_options.step_graphs = options.step_graphs;
  std::function<void()> device_report = WatchDevice(options, &manager_options);
  // Explicit absolute checkpoint paths work without --state_dir too.
  manager_options.checkpoints =
      std::make_shared<checkpoint::DirectoryStore>(manager_options.state_dir);
  DIOND_ASSIGN_OR_RETURN(sessions_, session::SessionManager::Create(
                                        manager_options, MetricsObserver(metrics, device_report)));
  if (device_.type == kernels::DeviceType::kCpu) {
    // The threads the steps use (--compute_threads as the compute context took it), not the
    // cores SelectDevice counted.
    const int threads = sessions_->compute_threads();
    device_.name = absl::StrCat("cpu (", threads, threads == 1 ? " thread)" : " threads)");
  }
  Limits limits;
  limits.max_session_bytes = options.sessions.max_session_bytes;
  limits.memory_budget_bytes = options.sessions.memory_budget_bytes;
  limits.checkpoint_every =
      options.sessions.state_dir.empty() ? 0 : options.sessions.checkpoint_every;
  limits.world_size = options.world.world_size;
  limits.rank = options.world.world_size > 1 ? options.world.rank : 0;
  metrics->SetLimits(limits);
  session::SessionManager* manager = sessions_.get();
  metrics->SetSessionSource([manager] {
    SessionTotals totals;
    for (const session::SessionInfo& s : manager->List()) {
      totals.state_bytes += s.budget_bytes;  // what the budgets count (device pool bytes too)
      totals.steps_behind =
          std::max(totals.steps_behind, s.last_step_index - s.last_checkpoint_step);
    }
    return totals;
  });
  return absl::OkStatus();
}

absl::Status Daemon::StartFdChannel(const DaemonOptions& options, rpc::RpcServerOptions* ro) {
  std::string fd_path = options.fd_channel_socket;
  if (fd_path.empty()) {
    for (const auto& a : options.listen) {
      if (a.kind == ListenAddress::Kind::kUnix) {
        fd_path = fdchannel::DerivedPath(a.path);
        break;
      }
    }
  }
  if (fd_path.empty() || fd_path == "none") return absl::OkStatus();
  fdchannel::TokenOptions to;
  to.ttl = options.fd_token_ttl;
  to.max_pending_per_uid = options.fd_max_pending_per_uid;
  auto channel = fdchannel::FdChannel::Start(fd_path, to);
  if (channel.ok()) {
    fd_channel_ = *std::move(channel);
    ro->service.fd_channel = fd_channel_.get();
  } else if (!options.fd_channel_socket.empty()) {
    return channel.status();  // asked for by name: a start-up error
  } else {  // derived (e.g. a socket path too long for ".fd"): run without, as documented
    DIOND_LOG(WARNING) << "no fd channel (MEMFD regions are off): " << channel.status().message()
                       << "; name one with --fd_channel_socket";
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartRpc(const DaemonOptions& options, rpc::RpcServerOptions ro) {
  ro.listen = options.listen;
  ro.manager = sessions_.get();
  ro.service.allow_shm_from_tcp = options.allow_shm_from_tcp;
  ro.health_address = options.health_address;
  ro.service.max_stream_bytes = options.max_stream_bytes;
  ro.service.handler_threads = options.rpc_handler_threads;
  // Device sessions (a GPU's, or the test-only TEST backend's) take the CUDA region kinds.
  ro.service.gpu_daemon = compute_device_.type != kernels::DeviceType::kCpu;
  rpc_metrics_ = std::make_unique<RpcMetrics>(metrics_.get());
  DIOND_ASSIGN_OR_RETURN(rpc_, rpc::RpcServer::Start(ro, rpc_metrics_.get()));
  if (device_watch_) device_watch_->AttachRpc(rpc_.get());
  return absl::OkStatus();
}

std::vector<ListenAddress> Daemon::bound() const {
  return rpc_ ? rpc_->bound() : std::vector<ListenAddress>{};
}

int Daemon::metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }
int Daemon::health_port() const { return rpc_ ? rpc_->health_port() : 0; }

std::string Daemon::Describe() const {
  std::vector<std::string> names;
  for (const auto& a : bound()) names.push_back(a.ToString());
  std::string metrics = "metrics off";
  if (metrics_server_) {
    std::string host = metrics_address_.substr(0, metrics_address_.rfind(':'));
    metrics = absl::StrCat("metrics on http://", host, ":", metrics_port(), "/metrics");
  }
  std::string device = DescribeDevice(device_, compute_device_, compute_note_);
  if (health_port() != 0) absl::StrAppend(&metrics, "; health checks on port ", health_port());
  std::string world;
  if (world_) {
    world = absl::StrCat("; world rank ", world_->rank(), " of ", world_->size(),
                         coordinator_ ? " (coordinator)" : "");
  }
  return absl::StrCat("diond ", kVersion, " serving on ", absl::StrJoin(names, ", "), "; ", metrics,
                      "; ", device, world, "; ", cpu_blas_);
}

std::string Daemon::fd_channel_path() const {
  return fd_channel_ ? fd_channel_->path() : std::string();
}

std::string Daemon::ReadyJson() const {
  nlohmann::json j;
  j["version"] = kVersion;
  j["pid"] = static_cast<int64_t>(getpid());
  nlohmann::json listen = nlohmann::json::array();
  for (const auto& a : bound()) {
    nlohmann::json e;
    if (a.kind == ListenAddress::Kind::kUnix) {
      e["unix"] = a.path;
    } else {
      e["host"] = a.host;
      e["port"] = a.port;
    }
    e["uri"] = a.ToString();
    listen.push_back(e);
  }
  j["listen"] = listen;
  j["metrics_port"] = metrics_port();
  j["health_port"] = health_port();
  j["fd_channel"] = fd_channel_path();
  j["device"] = device_.name;
  j["compute_device"] = DeviceLabel(compute_device_.type, compute_device_.index);
  return j.dump();
}

void Daemon::Shutdown(absl::Duration drain) {
  if (sessions_) sessions_->DetachWorld();  // world sessions must not outlive the World
  world_.reset();
  // Parked Peer.Wait calls would hold the gRPC server's shutdown until their timeouts.
  if (coordinator_) coordinator_->store()->CancelWaiters();
  if (device_watch_) device_watch_->AttachRpc(nullptr);
  if (sessions_) sessions_->CancelDoorbellWaits();
  if (rpc_) rpc_->Shutdown(drain);
  rpc_.reset();
  fd_channel_.reset();
  // A scrape must not read the sessions while they go (SetSessionSource waits for one in flight).
  if (metrics_) metrics_->SetSessionSource(nullptr);
  sessions_.reset();
  metrics_server_.reset();
  peer_client_.reset();
  coordinator_.reset();
}

}  // namespace diond::server
