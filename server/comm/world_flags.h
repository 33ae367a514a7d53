// Derivation of a daemon's rank and coordinator address from its environment, for the --rank,
// --coordinator and --peer_service flags (docs/OPERATIONS.md, "World"). Pure functions.
#ifndef DIOND_SERVER_COMM_WORLD_FLAGS_H_
#define DIOND_SERVER_COMM_WORLD_FLAGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond::comm {

// The rank: `flag_rank` when >= 0; else JOB_COMPLETION_INDEX (`job_index`, an indexed Job) when
// set; else the StatefulSet ordinal, the trailing "-<N>" of `hostname`; else 0 when
// world_size == 1. INVALID_ARGUMENT names what was tried.
absl::StatusOr<int> DeriveRank(int flag_rank, int world_size, absl::string_view hostname,
                               const char* job_index);

// "<statefulset>-0.<service>:<port>" for a pod named "<statefulset>-<N>" behind the headless
// service `service`. INVALID_ARGUMENT if the hostname has no ordinal.
absl::StatusOr<std::string> CoordinatorFromService(absl::string_view hostname,
                                                   absl::string_view service, int port);

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_WORLD_FLAGS_H_
