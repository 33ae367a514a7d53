#include "server/rpc/peer_requests.h"

#include "absl/strings/str_cat.h"

namespace diond::rpc {

absl::Status CheckPeerSet(const v1::PeerSetRequest& req) {
  if (req.key().empty()) return absl::InvalidArgumentError("key is empty");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> PeerWaitKeys(const v1::PeerWaitRequest& req,
                                                      const comm::StoreLimits& limits) {
  if (req.timeout_ms() < 0 || req.timeout_ms() > kMaxPeerWaitMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms ", req.timeout_ms(), " outside [0, ", kMaxPeerWaitMs, "]"));
  }
  if (req.keys_size() > limits.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat("Wait for ", req.keys_size(),
                                                     " keys; the limit is ", limits.max_keys,
                                                     " (--world_max_keys)"));
  }
  for (const std::string& k : req.keys()) {
    if (static_cast<int64_t>(k.size()) > limits.max_key_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Wait for a key of ", k.size(), " bytes; the limit is ",
                       limits.max_key_bytes, " (--world_max_key_bytes)"));
    }
  }
  return std::vector<std::string>(req.keys().begin(), req.keys().end());
}

comm::JoinArgs JoinArgsFromProto(const v1::JoinRequest& req) {
  return comm::JoinArgs{req.rank(),        req.world_size(), req.address(),
                        req.incarnation(), req.rebuild(),    req.proof()};
}

}  // namespace diond::rpc
