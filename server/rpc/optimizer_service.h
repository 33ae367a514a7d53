// The diond.v1.Optimizer gRPC service (callback API, STYLE.md O2). Handlers stay thin: parse,
// convert to domain structs (server/rpc/convert.h), call the SessionManager, convert back, and
// map the status once (status_conversion.h). The unary handlers and the streams' final apply run
// on the service's HandlerPool, never on gRPC's few callback threads (handler_pool.h says why).
#ifndef DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_
#define DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_

#include <functional>
#include <memory>
#include <string>

#include "diond/v1/optimizer.grpc.pb.h"
#include "server/fdchannel/fd_channel.h"
#include "server/rpc/auth.h"
#include "server/rpc/handler_pool.h"
#include "server/session/session_manager.h"

namespace diond::rpc {

struct OptimizerServiceOptions {
  // Allow RegisterRegion from TCP peers (shared memory only makes sense on the same host, and a
  // remote caller could otherwise probe the daemon's shm namespace). Unix-socket peers always may.
  bool allow_shm_from_tcp = false;
  int64_t max_chunk_bytes = 4 << 20;
  // PushGradients / SetState: the most bytes one stream may buffer (--max_stream_bytes;
  // 0 = only the session's own bound: the bytes of the tensors the stream can write).
  int64_t max_stream_bytes = int64_t{4} << 30;
  // The data plane (docs/DATA_PLANE.md). The fd channel that MEMFD / CUDA_VMM_FD regions take
  // their fds from; null = none (those kinds are refused). Must outlive the service.
  fdchannel::FdChannel* fd_channel = nullptr;
  // True when the daemon computes on a device (a GPU, or the test-only TEST backend): its device
  // sessions take the CUDA region kinds. A CPU daemon refuses them with FAILED_PRECONDITION.
  bool gpu_daemon = false;
  // The most handler threads (handler_pool.h): calls that need a thread beyond them wait in
  // order. Each call in flight that waits (a world session's CreateSession for its peers, a Step
  // in a collective) holds one.
  int handler_threads = 64;
};

class OptimizerService final : public diond::v1::Optimizer::CallbackService {
 public:
  // `manager` and `auth` must outlive the service. Every RPC authenticates its caller first
  // (UNAUTHENTICATED); an RPC that names a session another principal owns gets
  // PERMISSION_DENIED unless the caller is an admin.
  OptimizerService(session::SessionManager* manager, const Authenticator* auth,
                   OptimizerServiceOptions options)
      : manager_(manager),
        auth_(auth),
        options_(options),
        pool_(std::make_unique<HandlerPool>(options_.handler_threads)) {}

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* req,
                                           v1::RegisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                 v1::StepResponse* resp) override;
  grpc::ServerReadReactor<v1::TensorChunk>* PushGradients(grpc::CallbackServerContext* ctx,
                                                          v1::PushGradientsResponse* resp) override;
  grpc::ServerWriteReactor<v1::TensorChunk>* PullParameters(
      grpc::CallbackServerContext* ctx, const v1::PullParametersRequest* req) override;
  grpc::ServerUnaryReactor* SetHyperparameters(grpc::CallbackServerContext* ctx,
                                               const v1::SetHyperparametersRequest* req,
                                               v1::SetHyperparametersResponse* resp) override;
  grpc::ServerWriteReactor<v1::TensorChunk>* GetState(grpc::CallbackServerContext* ctx,
                                                      const v1::GetStateRequest* req) override;
  grpc::ServerReadReactor<v1::TensorChunk>* SetState(grpc::CallbackServerContext* ctx,
                                                     v1::SetStateResponse* resp) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::SaveCheckpointRequest* req,
                                           v1::SaveCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::LoadCheckpointRequest* req,
                                           v1::LoadCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* AttachSession(grpc::CallbackServerContext* ctx,
                                          const v1::AttachSessionRequest* req,
                                          v1::AttachSessionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  // server/rpc/option_schema.cc: the option table, to any authenticated caller.
  grpc::ServerUnaryReactor* DescribeOptions(grpc::CallbackServerContext* ctx,
                                            const v1::DescribeOptionsRequest* req,
                                            v1::DescribeOptionsResponse* resp) override;

 private:
  // RegisterRegion's MEMFD and CUDA kinds (the data plane).
  // REGION_ROLE_DOORBELLS (SYSTEM_SHM or MEMFD) with its buckets.
  absl::StatusOr<std::string> RegisterDoorbells(const Principal& p, session::Session* s,
                                                const v1::RegisterRegionRequest& req,
                                                const std::string& peer);
  // A shm registration's caller checks: a local caller (or --allow_shm_from_tcp) owning `name`.
  absl::Status CheckShmCaller(const Principal& p, const std::string& name,
                              const std::string& peer) const;
  // The memfd behind m.fd_token, for a local caller of a daemon with an fd channel.
  absl::StatusOr<fdchannel::UniqueFd> TakeMemfd(const Principal& p, const v1::MemfdRegion& m);
  absl::StatusOr<std::string> RegisterMemfd(const Principal& p, session::Session* s,
                                            session::Role role, const v1::MemfdRegion& m);
  // CUDA_IPC / CUDA_VMM_FD (docs/DATA_PLANE.md "CUDA regions"): the fields checked, the VMM fd
  // taken from the fd channel (same uid), then opened on the session's compute device and bound.
  // FAILED_PRECONDITION on a CPU daemon and for a host session.
  absl::StatusOr<std::string> RegisterCuda(const Principal& p, session::Session* s,
                                           session::Role role,
                                           const v1::RegisterRegionRequest& req);
  // CreateSession / AttachSession: fd_channel_socket and region_kinds (the CUDA kinds for a
  // device session of a GPU daemon).
  void DataPlaneToProto(const session::Session& s, v1::CreateSessionResponse* resp) const;
  // For the client-streaming RPCs: authenticates now, checks ownership on the first chunk.
  std::function<absl::Status(const std::string&)> OwnerCheck(
      grpc::CallbackServerContext* ctx) const;
  // Runs `work` on the handler pool (handler_pool.h: never on gRPC's callback threads) and
  // finishes the call with its status from there.
  grpc::ServerUnaryReactor* Offload(grpc::CallbackServerContext* ctx,
                                    std::function<absl::Status()> work);
  session::SessionManager* manager_;
  const Authenticator* auth_;
  OptimizerServiceOptions options_;
  // Declared last: destroyed first, after it ran what was queued (the server is shut down and
  // destroyed before the service, so no call arrives meanwhile).
  std::unique_ptr<HandlerPool> pool_;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_
