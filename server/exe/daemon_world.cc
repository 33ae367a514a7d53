// The daemon world's steps of Daemon::Start (docs/DISTRIBUTED.md): its credentials and, on rank
// 0, the coordinator (PrepareWorld, before the RPC server starts), then joining it (JoinWorld,
// once this daemon serves its peers).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/comm/membership.h"
#include "server/comm/nccl_communicator.h"
#include "server/comm/world.h"
#include "server/exe/daemon.h"
#include "server/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/grpc_server.h"
#include "server/rpc/peer_client.h"

namespace diond::server {

absl::Status Daemon::PrepareWorld(const DaemonOptions& options, rpc::RpcServerOptions* ro) {
  const WorldConfig& wc = options.world;
  const bool tls = !options.tls_cert_file.empty();
  std::string world_secret;
  if (!options.world_secret_file.empty()) {
    auto secret = rpc::ReadSecretFile(options.world_secret_file);
    if (!secret.ok()) {
      return absl::Status(secret.status().code(),
                          absl::StrCat("--world_secret_file: ", secret.status().message()));
    }
    world_secret = *std::move(secret);
  }
  if (wc.world_size > 1 && world_secret.empty() && ro->tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "a daemon world (--world_size > 1) needs --world_secret_file (the same secret on every "
        "rank) or mutual TLS (--tls_cert, --tls_key, --tls_client_ca on every rank)");
  }
  if (wc.world_size > 1 && tls && ro->tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "a daemon world with TLS needs --tls_client_ca: the CA that verifies the coordinator's "
        "certificate");
  }
  peer_credentials_ = std::make_unique<rpc::PeerCredentials>();
  peer_credentials_->world_secret = world_secret;
  if (tls) {
    peer_credentials_->tls_ca = ro->tls_client_ca;
    peer_credentials_->tls_cert = ro->tls_cert;
    peer_credentials_->tls_key = ro->tls_key;
  }
  ro->world_secret = world_secret;
  if (wc.world_size > 1 && wc.rank == 0) {
    comm::CoordinatorOptions co;
    co.store_limits = wc.store_limits;
    co.world_size = wc.world_size;
    co.heartbeat_interval = wc.heartbeat_interval;
    co.peer_timeout = wc.peer_timeout;
    coordinator_ = std::make_unique<comm::Coordinator>(co);
    ro->coordinator = coordinator_.get();
  }
  return absl::OkStatus();
}

absl::Status Daemon::JoinWorld(const WorldConfig& wc) {
  comm::MembershipService* membership = coordinator_.get();
  comm::KeyValueStore* kv = coordinator_ ? coordinator_->store() : nullptr;
  if (coordinator_ == nullptr) {
    if (wc.coordinator.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", wc.rank, " of a world of ", wc.world_size,
                       " needs --coordinator=HOST:PORT (rank 0's address) or --peer_service"));
    }
    peer_client_ = std::make_unique<rpc::PeerClient>(
        wc.coordinator, std::min(absl::Seconds(5), wc.peer_timeout / 2), *peer_credentials_);
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
  if (compute_device_.type != kernels::DeviceType::kCpu) {
    const bool nccl = wc.device_nccl && cuda_plugin_ != nullptr &&
                      compute_device_.type == kernels::DeviceType::kCuda &&
                      cuda_plugin_->nccl != nullptr;
    DIOND_LOG(INFO) << "world: device sessions exchange "
                    << (nccl ? "over NCCL on device memory"
                             : absl::StrCat("over Gloo, staged through host memory (",
                                            !wc.device_nccl ? "--world_device_collectives=gloo"
                                            : compute_device_.type != kernels::DeviceType::kCuda
                                                ? "not a CUDA device"
                                                : "the CUDA plugin has no NCCL",
                                            ")"));
  }
  if (wc.device_nccl && cuda_plugin_ != nullptr &&
      compute_device_.type == kernels::DeviceType::kCuda && cuda_plugin_->nccl != nullptr) {
    // World sessions on the GPU exchange in device memory over NCCL (docs/DISTRIBUTED.md
    // "On device daemons"); Gloo stays for the host-side control traffic.
    const DiondCudaPluginV1* plugin = cuda_plugin_;
    const int device = compute_device_.index;
    wo.device_communicator_factory =
        [plugin, device](comm::KeyValueStore* store, const std::string& prefix, int rank, int size,
                         absl::Duration timeout, comm::CollectiveObserver observer)
        -> absl::StatusOr<std::unique_ptr<comm::Communicator>> {
      comm::NcclOptions no;
      no.rank = rank;
      no.size = size;
      no.device = device;
      no.prefix = prefix;
      no.timeout = timeout;
      no.observer = std::move(observer);
      DIOND_ASSIGN_OR_RETURN(std::unique_ptr<comm::NcclCommunicator> c,
                             comm::NcclCommunicator::Create(plugin, store, no));
      return std::unique_ptr<comm::Communicator>(std::move(c));
    };
  }
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

}  // namespace diond::server
