// The diond.v1.Optimizer gRPC service (callback API, STYLE.md O2). Handlers stay thin: parse,
// convert to domain structs, call the engine, convert back, map the status once.
//
// Today every RPC answers UNIMPLEMENTED with a message saying so: the session engine lands with
// the "Optimizer service v1" issue. The service is registered now so that reflection lists the
// whole v1 API and clients can be generated against it.
#ifndef DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_
#define DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_

#include "diond/v1/optimizer.grpc.pb.h"

namespace diond::rpc {

class OptimizerService final : public diond::v1::Optimizer::CallbackService {
 public:
  OptimizerService() = default;

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
};

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_OPTIMIZER_SERVICE_H_
