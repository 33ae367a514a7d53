// The one edge mapping between absl::Status and grpc::Status (STYLE.md E3). Codes map 1:1
// because both follow google.rpc.Code; the message is carried unchanged.
#ifndef DIOND_SERVER_RPC_STATUS_CONVERSION_H_
#define DIOND_SERVER_RPC_STATUS_CONVERSION_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace diond::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_STATUS_CONVERSION_H_
