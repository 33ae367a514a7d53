#include "server/daemon.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "server/metrics.h"
#include "server/comm/membership.h"
#include "server/comm/world.h"
#include "server/rpc/grpc_server.h"
#include "server/rpc/peer_client.h"
#include "server/version.h"

#include <unistd.h>

namespace diond::server {

std::string DeviceLabel(kernels::DeviceType type, int index) {
  return type == kernels::DeviceType::kCuda ? absl::StrCat("cuda:", index) : "cpu";
}

std::string DescribeDevice(const kernels::SelectedDevice& selected, kernels::Device compute) {
  std::string s = absl::StrCat("device ", selected.name);
  if (!selected.fallback_reason.empty()) {
    absl::StrAppend(&s, " (no GPU in use: ", selected.fallback_reason, ")");
  }
  if (compute.type != selected.type) {
    absl::StrAppend(&s, "; steps run on the ", DeviceLabel(compute.type, compute.index),
                    ": this build has no ops backend for ",
                    DeviceLabel(selected.type, selected.index), " yet");
  }
  return s;
}

Daemon::Daemon() = default;
Daemon::~Daemon() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  for (const auto& a : options.listen) {
    if (a.kind == ListenAddress::Kind::kTcp && !a.loopback && !options.allow_insecure_remote) {
      return absl::InvalidArgumentError(absl::StrCat(
          "refusing to listen on non-loopback ", a.ToString(),
          " without TLS; use a loopback or unix address, or --allow_insecure_remote"));
    }
  }
  std::unique_ptr<Daemon> d(new Daemon);
  DIOND_ASSIGN_OR_RETURN(d->device_, kernels::SelectDevice(options.device, options.cuda_plugin));

  // The device the steps run on: the selected one if this build has an ops backend for it,
  // else the CPU (every GPU until the CUDA backend exists; said plainly below and in metrics).
  d->compute_device_ = kernels::ComputeDevice(d->device_);
  BuildInfo info;
  info.version = kVersion;
  info.device = DeviceLabel(d->device_.type, d->device_.index);
  info.compute_device = DeviceLabel(d->compute_device_.type, d->compute_device_.index);
  info.cuda_plugin = d->device_.cuda_plugin_loaded;
  d->metrics_ = std::make_unique<DaemonMetrics>(std::make_shared<prometheus::Registry>(), info);

  // Metrics start after the CUDA plugin is loaded: the plugin's TLS is dynamic (dlopen), so
  // civetweb's small-stack threads still start (TOOLCHAIN.md P1).
  if (!options.metrics_address.empty()) {
    d->metrics_address_ = options.metrics_address;
    DIOND_ASSIGN_OR_RETURN(d->metrics_server_,
                           MetricsServer::Start(options.metrics_address,
                                                {d->metrics_->shared_registry(),
                                                 MakeProcessCollector()}));
  }
  session::ManagerObserver observer;
  DaemonMetrics* metrics = d->metrics_.get();
  observer.on_sessions_changed = [metrics](int64_t n) { metrics->SetSessions(n); };
  observer.on_step = [metrics](const std::string&, const session::StepResult& r) {
    metrics->ObserveStep(r.replayed ? "replayed" : r.skipped ? "skipped" : "applied",
                         r.total_micros * 1e-6, r.compute_micros * 1e-6);
    if (!r.replayed && r.checksum_mismatches > 0) {
      metrics->CountChecksumMismatches(r.checksum_mismatches);
    }
  };
  observer.on_checkpoint = [metrics](const std::string&, const std::string&, int64_t bytes) {
    metrics->ObserveCheckpoint(bytes);
  };
  session::ManagerOptions manager_options = options.sessions;
  manager_options.compute_device = d->compute_device_;
  DIOND_ASSIGN_OR_RETURN(d->sessions_,
                         session::SessionManager::Create(manager_options, std::move(observer)));
  rpc::RpcServerOptions ro;
  ro.listen = options.listen;
  ro.manager = d->sessions_.get();
  ro.service.allow_shm_from_tcp = options.allow_shm_from_tcp;
  const WorldConfig& wc = options.world;
  if (wc.world_size > 1 && wc.rank == 0) {
    comm::CoordinatorOptions co;
    co.world_size = wc.world_size;
    co.heartbeat_interval = wc.heartbeat_interval;
    co.peer_timeout = wc.peer_timeout;
    d->coordinator_ = std::make_unique<comm::Coordinator>(co);
    ro.coordinator = d->coordinator_.get();
  }
  DIOND_ASSIGN_OR_RETURN(d->rpc_, rpc::RpcServer::Start(ro, d->metrics_.get()));
  if (wc.world_size > 1) DIOND_RETURN_IF_ERROR(d->JoinWorld(wc));
  return d;
}

absl::Status Daemon::JoinWorld(const WorldConfig& wc) {
  comm::MembershipService* membership = coordinator_.get();
  comm::KeyValueStore* kv = coordinator_ ? coordinator_->store() : nullptr;
  if (coordinator_ == nullptr) {
    if (wc.coordinator.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", wc.rank, " of a world of ", wc.world_size,
          " needs --coordinator=HOST:PORT (rank 0's address) or --peer_service"));
    }
    peer_client_ = std::make_unique<rpc::PeerClient>(
        wc.coordinator, std::min(absl::Seconds(5), wc.peer_timeout / 2));
    membership = peer_client_.get();
    kv = peer_client_.get();
  }
  comm::WorldOptions wo;
  wo.rank = wc.rank;
  wo.world_size = wc.world_size;
  wo.address = wc.peer_address;
  wo.heartbeat_interval = wc.heartbeat_interval;
  wo.peer_timeout = wc.peer_timeout;
  wo.join_timeout = wc.join_timeout;
  DaemonMetrics* m = metrics_.get();
  wo.collective_observer = [m](comm::CollectiveOp op, int64_t bytes, double seconds,
                               const absl::Status&) {
    m->ObserveCollective(comm::CollectiveOpName(op), bytes, seconds);
  };
  wo.on_peers = [m](int live) { m->SetWorldPeers(live); };
  wo.on_ready = [m](uint64_t generation) { m->SetWorldGeneration(generation); };
  wo.on_broken = [m](uint64_t, const absl::Status&) {
    m->CountWorldFailure();
    m->SetWorldGeneration(0);
  };
  auto world = comm::World::Join(wo, membership, kv);
  if (!world.ok()) {
    std::string where = coordinator_ ? "" : absl::StrCat(" (coordinator ", wc.coordinator, ")");
    return absl::Status(world.status().code(),
                        absl::StrCat("cannot join the daemon world as rank ", wc.rank, " of ",
                                     wc.world_size, where, ": ", world.status().message()));
  }
  world_ = std::move(*world);
  // World sessions (docs/DISTRIBUTED.md); a failed collective waits up to a peer timeout and two
  // heartbeats for the coordinator to name the lost rank.
  sessions_->AttachWorld(world_.get(), kv, wc.peer_timeout + 2 * wc.heartbeat_interval);
  return absl::OkStatus();
}

std::vector<ListenAddress> Daemon::bound() const {
  return rpc_ ? rpc_->bound() : std::vector<ListenAddress>{};
}

int Daemon::metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }

std::string Daemon::Describe() const {
  std::vector<std::string> names;
  for (const auto& a : bound()) names.push_back(a.ToString());
  std::string metrics = "metrics off";
  if (metrics_server_) {
    std::string host = metrics_address_.substr(0, metrics_address_.rfind(':'));
    metrics = absl::StrCat("metrics on http://", host, ":", metrics_port(), "/metrics");
  }
  const std::string device = DescribeDevice(device_, compute_device_);
  std::string world;
  if (world_) {
    world = absl::StrCat("; world rank ", world_->rank(), " of ", world_->size(),
                         coordinator_ ? " (coordinator)" : "");
  }
  return absl::StrCat("diond ", kVersion, " serving on ", absl::StrJoin(names, ", "), "; ",
                      metrics, "; ", device, world);
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
  j["device"] = device_.name;
  j["compute_device"] = DeviceLabel(compute_device_.type, compute_device_.index);
  return j.dump();
}

void Daemon::Shutdown(absl::Duration drain) {
  if (sessions_) sessions_->DetachWorld();  // world sessions must not outlive the World
  world_.reset();
  // Parked Peer.Wait calls would hold the gRPC server's shutdown until their timeouts.
  if (coordinator_) coordinator_->store()->CancelWaiters();
  if (rpc_) rpc_->Shutdown(drain);
  rpc_.reset();
  sessions_.reset();
  metrics_server_.reset();
  peer_client_.reset();
  coordinator_.reset();
}

}  // namespace diond::server
