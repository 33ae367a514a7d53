// libFuzzer target: a sequence of Peer requests (Set, Get, Wait, Join, Heartbeat, GetMembership)
// from arbitrary bytes, each decoded from protobuf wire bytes and handled as the Peer service
// handles it (server/rpc/peer_requests.cc, then comm::Coordinator and its MemoryKeyValueStore),
// against a small world with small store quotas. Properties, besides no crash and no sanitizer
// report:
//  - the store never holds more keys or bytes than its quotas; a refused Set changes nothing
//    and an accepted one is read back exactly;
//  - a WaitAsync callback runs exactly once;
//  - a live rank cannot be taken by another incarnation (ALREADY_EXISTS) nor re-joined or kept
//    alive without the proof of its first Join (PERMISSION_DENIED), checked against a model of
//    who holds which rank;
//  - a membership lists each rank at most once, inside the world, with a bounded address, and
//    its generation never goes back;
//  - every error message is bounded and one line.
// Input: one byte (world size 1..4), then records of one byte (the request: 0 Set, 1 Get, 2 Wait,
// 3 Join, 4 Heartbeat, 5 GetMembership), two bytes of length (little-endian) and that many bytes
// of the request's wire form; encode_records.py writes such inputs from text.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/logging.h"
#include "diond/v1/peer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/comm/membership.h"
#include "server/rpc/peer_requests.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::comm::Coordinator;
using diond::comm::MembershipView;

using diond::fuzz::Records;
using diond::fuzz::Require;

void RequireBounded(const absl::Status& s) { diond::fuzz::RequireBoundedMessage(s, 1024); }

struct Holder {
  uint64_t incarnation = 0;
  std::string proof;
};

void CheckView(const MembershipView& v, int world_size, uint64_t* generation,
               const std::map<int, Holder>& live) {
  Require(v.world_size == world_size, "membership with another world size");
  Require(v.generation >= *generation, "generation went back");
  *generation = v.generation;
  std::set<int> ranks;
  int live_count = 0;
  for (const auto& m : v.members) {
    Require(m.rank >= 0 && m.rank < world_size, "member outside the world");
    Require(ranks.insert(m.rank).second, "rank listed twice");
    Require(m.address.size() <= diond::comm::kMaxMemberAddressBytes, "unbounded address");
    auto it = live.find(m.rank);
    Require(m.live == (it != live.end()), "liveness differs from the model");
    if (m.live) {
      ++live_count;
      Require(m.incarnation == it->second.incarnation, "live rank held by another incarnation");
    }
  }
  Require(v.complete == (live_count == world_size), "complete flag wrong");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  diond::fuzz::QuietLogs();  // the coordinator logs every Join
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  diond::comm::CoordinatorOptions options;
  options.world_size = 1 + data[0] % 4;
  Records in(reinterpret_cast<const char*>(data) + 1, size - 1);  // see the top of this file
  options.heartbeat_interval = absl::Hours(1);  // nobody is declared lost during one input
  options.peer_timeout = absl::Hours(2);
  options.store_limits.max_key_bytes = 300;  // above the 200-byte echo bound
  options.store_limits.max_value_bytes = 512;
  options.store_limits.max_keys = 8;
  options.store_limits.max_bytes = 2048;
  const diond::comm::StoreLimits limits = options.store_limits;
  std::atomic<int> waits{0}, wait_callbacks{0};
  {
    Coordinator coordinator(options);
    diond::comm::MemoryKeyValueStore* store = coordinator.store();
    std::map<int, Holder> live;
    uint64_t generation = 0;
    int kind = 0;
    std::string bytes;
    for (int op = 0; op < 64 && in.Next(&kind, &bytes); ++op) {
      switch (kind % 6) {
        case 0: {  // Set
          diond::v1::PeerSetRequest req;
          if (!req.ParseFromString(bytes)) break;
          const size_t keys_before = store->size();
          const int64_t bytes_before = store->bytes();
          auto before = store->Get(req.key());
          absl::Status s = diond::rpc::CheckPeerSet(req);
          if (s.ok()) s = store->Set(req.key(), req.value());
          if (s.ok()) {
            auto after = store->Get(req.key());
            Require(after.ok() && *after == req.value(), "stored value not read back");
          } else {
            RequireBounded(s);
            Require(store->size() == keys_before && store->bytes() == bytes_before,
                    "a refused Set changed the store");
            auto after = store->Get(req.key());
            Require(after.ok() == before.ok() && (!after.ok() || *after == *before),
                    "a refused Set changed the value");
          }
          Require(static_cast<int64_t>(store->size()) <= limits.max_keys, "key quota exceeded");
          Require(store->bytes() <= limits.max_bytes, "byte quota exceeded");
          break;
        }
        case 1: {  // Get
          diond::v1::PeerGetRequest req;
          if (!req.ParseFromString(bytes)) break;
          auto v = store->Get(req.key());
          if (!v.ok()) RequireBounded(v.status());
          break;
        }
        case 2: {  // Wait (parked: the store's destructor fails what is still waiting)
          diond::v1::PeerWaitRequest req;
          if (!req.ParseFromString(bytes)) break;
          auto keys = diond::rpc::PeerWaitKeys(req, limits);
          if (!keys.ok()) {
            RequireBounded(keys.status());
            break;
          }
          ++waits;
          store->WaitAsync(*std::move(keys), absl::Milliseconds(req.timeout_ms()),
                           [&wait_callbacks](absl::Status s) {
                             RequireBounded(s);
                             ++wait_callbacks;
                           });
          break;
        }
        case 3: {  // Join
          diond::v1::JoinRequest req;
          if (!req.ParseFromString(bytes)) break;
          const diond::comm::JoinArgs a = diond::rpc::JoinArgsFromProto(req);
          auto held = live.find(a.rank);
          auto v = coordinator.Join(a);
          if (held != live.end() && a.world_size == options.world_size && a.incarnation != 0 &&
              a.address.size() <= diond::comm::kMaxMemberAddressBytes && a.proof.size() >= 16 &&
              a.proof.size() <= 64) {
            if (held->second.incarnation != a.incarnation) {
              Require(absl::IsAlreadyExists(v.status()), "a live rank was taken over");
            } else if (held->second.proof != a.proof) {
              Require(absl::IsPermissionDenied(v.status()), "a Join without the proof passed");
            }
          }
          if (v.ok()) {
            Require(a.rank >= 0 && a.rank < options.world_size, "Join outside the world passed");
            live[a.rank] = Holder{a.incarnation, a.proof};
            CheckView(*v, options.world_size, &generation, live);
            bool listed = false;
            for (const auto& m : v->members) {
              listed |= m.rank == a.rank && m.address == a.address && m.live;
            }
            Require(listed, "a joined rank is not listed with its address");
          } else {
            RequireBounded(v.status());
          }
          break;
        }
        case 4: {  // Heartbeat
          diond::v1::HeartbeatRequest req;
          if (!req.ParseFromString(bytes)) break;
          auto v = coordinator.Heartbeat(req.rank(), req.incarnation(), req.proof());
          auto held = live.find(req.rank());
          const bool allowed = held != live.end() &&
                               held->second.incarnation == req.incarnation() &&
                               held->second.proof == req.proof();
          Require(v.ok() == allowed, "Heartbeat answer differs from the model");
          if (v.ok()) {
            CheckView(*v, options.world_size, &generation, live);
          } else {
            RequireBounded(v.status());
          }
          break;
        }
        default: {
          auto v = coordinator.GetMembership();
          Require(v.ok(), "GetMembership failed");
          CheckView(*v, options.world_size, &generation, live);
        }
      }
    }
  }
  Require(wait_callbacks.load() == waits.load(), "a Wait callback did not run exactly once");
  return 0;
}
