// The Peer service's request validation and conversion (proto -> domain), apart from the gRPC
// handlers so that the fuzz target tests/fuzz/peer_fuzz.cc runs exactly what the service runs.
#ifndef DIOND_SERVER_RPC_PEER_REQUESTS_H_
#define DIOND_SERVER_RPC_PEER_REQUESTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "diond/v1/peer.pb.h"
#include "server/comm/membership.h"
#include "server/comm/memory_store.h"

namespace diond::rpc {

// Longest a single Wait may park (clients loop for longer waits).
inline constexpr int64_t kMaxPeerWaitMs = int64_t{10} * 60 * 1000;

// Set: INVALID_ARGUMENT for an empty key (the store checks the quotas).
absl::Status CheckPeerSet(const v1::PeerSetRequest& req);
// Wait: the keys to wait for, or INVALID_ARGUMENT for a timeout outside [0, kMaxPeerWaitMs] and
// RESOURCE_EXHAUSTED for more keys, or a longer key, than `limits` allow.
absl::StatusOr<std::vector<std::string>> PeerWaitKeys(const v1::PeerWaitRequest& req,
                                                      const comm::StoreLimits& limits);
// Join: the coordinator's arguments (the coordinator validates them).
comm::JoinArgs JoinArgsFromProto(const v1::JoinRequest& req);

}  // namespace diond::rpc

#endif  // DIOND_SERVER_RPC_PEER_REQUESTS_H_
