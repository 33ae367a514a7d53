#include "server/rpc/status_conversion.h"

#include <string>

#include "common/bounded.h"

namespace diond::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // Every message that echoes client input is bounded where it is made (common/bounded.h); this
  // is the last line of defence, so that no status can exceed what a default client accepts
  // in its metadata.
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())),
                      BoundedMessage(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(status.error_code())),
                      status.error_message());
}

}  // namespace diond::rpc
