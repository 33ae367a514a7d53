// proto ⇄ domain conversion for the Optimizer service. Every request field is validated here or
// in the domain layer; messages name the field and its value.
#ifndef DIOND_SERVER_RPC_CONVERT_H_
#define DIOND_SERVER_RPC_CONVERT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "diond/v1/optimizer.pb.h"
#include "server/session/session.h"
#include "server/session/types.h"

namespace diond::rpc {

absl::StatusOr<session::SessionSpec> SpecFromProto(const v1::CreateSessionRequest& req);
absl::StatusOr<kernels::DType> DTypeFromProto(int value, absl::string_view field);
v1::DType DTypeToProto(kernels::DType d);
void LayoutToProto(const session::Session& s, v1::CreateSessionResponse* resp);
v1::Algorithm AlgorithmToProto(optim::AlgorithmKind a);
// ListSessions' entry; `now` decides ACTIVE against IDLE (60 s without an RPC).
void SessionInfoToProto(const session::SessionInfo& info, absl::Time now, v1::SessionInfo* out);
// Applies only the fields that are set; INVALID_ARGUMENT for an invalid value, and then `out`
// is left as it was.
// Walks the option table (kernels/optim/option_table.h): every row's field, by reflection.
absl::Status ApplyHyperparameters(const v1::Hyperparameters& h, optim::Hyperparams* out);
// Every option of `h`, each field set (DescribeOptions' defaults; ApplyHyperparameters'
// inverse).
void HyperparametersToProto(const optim::Hyperparams& h, v1::Hyperparameters* out);

// SetHyperparameters: the group and the step-size knobs it changes. INVALID_ARGUMENT when the
// request sets any other field (those are fixed at CreateSession); the session validates the
// values (optim::CheckStepKnob) and the group.
struct HyperparameterChange {
  std::string group;
  std::optional<double> lr;
  std::optional<double> weight_decay;
};
absl::StatusOr<HyperparameterChange> HyperparameterChangeFromProto(
    const v1::SetHyperparametersRequest& req);

// Step: the request as the session takes it (the session validates it against its state).
session::StepRequest StepRequestFromProto(const v1::StepRequest& req);

// RegisterRegion: the role, once the kind is known and carries its body (system_shm for
// REGION_KIND_SYSTEM_SHM, memfd for REGION_KIND_MEMFD). INVALID_ARGUMENT for an unknown role or
// kind or a missing body. The CUDA kinds pass here; their fields, and the refusal on a CPU
// daemon, are the service's checks, as is whether the caller may register memory at all.
absl::StatusOr<session::Role> RegionRoleFromProto(const v1::RegisterRegionRequest& req);
// RegisterRegion of REGION_ROLE_DOORBELLS: the buckets (each a list of parameter indices), once
// the kind is a host one with its body; INVALID_ARGUMENT for another kind or a bucket count
// outside [1, Doorbells::kMaxBuckets]. Session::RegisterDoorbells checks the indices.
absl::StatusOr<std::vector<session::DoorbellBucket>> DoorbellBucketsFromProto(
    const v1::RegisterRegionRequest& req);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_CONVERT_H_
