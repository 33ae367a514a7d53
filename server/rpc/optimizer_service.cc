#include "server/rpc/optimizer_service.h"

namespace diond::rpc {
namespace {

grpc::ServerUnaryReactor* Unimplemented(grpc::CallbackServerContext* ctx, const char* method) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                         std::string(method) +
                             " is not implemented in this build of diond yet (sessions arrive "
                             "with the service v1 milestone)"));
  return r;
}

}  // namespace

grpc::ServerUnaryReactor* OptimizerService::CreateSession(grpc::CallbackServerContext* ctx,
                                                          const v1::CreateSessionRequest*,
                                                          v1::CreateSessionResponse*) {
  return Unimplemented(ctx, "CreateSession");
}

grpc::ServerUnaryReactor* OptimizerService::ListSessions(grpc::CallbackServerContext* ctx,
                                                         const v1::ListSessionsRequest*,
                                                         v1::ListSessionsResponse* resp) {
  // No session can exist yet, so the empty list is the true answer.
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

}  // namespace diond::rpc
