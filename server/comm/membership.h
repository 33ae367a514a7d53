// World membership: who is in the world, which generation it is in, and the coordinator that
// decides both (ARCHITECTURE.md §6).
//
// Rank 0's daemon runs the Coordinator; every daemon (rank 0 too) talks to it through the
// MembershipService interface: directly in rank 0, over the Peer gRPC service elsewhere
// (rpc::PeerClient). A *generation* is one formation of the world; it grows by one whenever a
// rank is lost or a new daemon process (incarnation) takes a rank, so communicators built for an
// older generation are known to be dead.
//
// A rank is lost when the coordinator has not heard a heartbeat for
// peer_timeout - heartbeat_interval; members learn it at their next heartbeat, so every survivor
// knows within peer_timeout.
//
// Thread-safety: Coordinator is thread-safe.
#ifndef DIOND_SERVER_COMM_MEMBERSHIP_H_
#define DIOND_SERVER_COMM_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/comm/memory_store.h"

namespace diond::comm {

struct MemberInfo {
  int rank = -1;
  std::string address;
  uint64_t incarnation = 0;
  bool live = false;
};

struct MembershipView {
  uint64_t generation = 0;
  int world_size = 0;
  std::vector<MemberInfo> members;  // ranks that ever joined, by rank
  bool complete = false;            // every rank live
  std::string broken_reason;        // why the last generation ended; empty if none
  uint64_t coordinator_incarnation = 0;
  int live_count() const;
};

struct JoinArgs {
  int rank = -1;
  int world_size = 0;
  std::string address;
  uint64_t incarnation = 0;
  // The caller's communicator failed while the membership did not change: start a new
  // generation so that everybody rebuilds.
  bool rebuild = false;
  // A secret the joining process chose (NewProof); while the rank is live, Join and Heartbeat
  // for it must carry the same one. Never part of a MembershipView.
  std::string proof;
};

// Longest address a member may register (a DNS name is at most 253 bytes).
inline constexpr size_t kMaxMemberAddressBytes = 255;

// What a member calls. Implemented by Coordinator (in-process) and rpc::PeerClient (remote).
class MembershipService {
 public:
  virtual ~MembershipService() = default;
  // FAILED_PRECONDITION on a world-size mismatch, INVALID_ARGUMENT for a rank out of range,
  // ALREADY_EXISTS if a live daemon of another incarnation holds the rank, PERMISSION_DENIED if
  // the same incarnation comes without the proof of its first Join, UNAVAILABLE if the
  // coordinator cannot be reached. INVALID_ARGUMENT for an address over kMaxMemberAddressBytes
  // or a proof that is not 16 to 64 bytes.
  virtual absl::StatusOr<MembershipView> Join(const JoinArgs& args) = 0;
  // NOT_FOUND if (rank, incarnation) is not a live member (declared lost): Join again.
  // PERMISSION_DENIED if `proof` is not the one the rank joined with.
  virtual absl::StatusOr<MembershipView> Heartbeat(int rank, uint64_t incarnation,
                                                   const std::string& proof) = 0;
  virtual absl::StatusOr<MembershipView> GetMembership() = 0;
};

struct CoordinatorOptions {
  int world_size = 1;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration peer_timeout = absl::Seconds(10);
  StoreLimits store_limits;
  // Called (outside the lock) when a rank is declared lost, with the new generation.
  std::function<void(int rank, uint64_t generation, const std::string& reason)> on_rank_lost;
};

class Coordinator : public MembershipService {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator() override;

  absl::StatusOr<MembershipView> Join(const JoinArgs& args) override;
  absl::StatusOr<MembershipView> Heartbeat(int rank, uint64_t incarnation,
                                           const std::string& proof) override;
  absl::StatusOr<MembershipView> GetMembership() override;

  // The rendezvous data the Peer service serves.
  MemoryKeyValueStore* store() { return &store_; }
  uint64_t incarnation() const { return incarnation_; }
  // Runs one liveness check at `now` (the monitor thread calls it every heartbeat interval).
  void CheckLiveness(absl::Time now);

 private:
  MembershipView ViewLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NewGenerationLocked(std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  const uint64_t incarnation_;
  MemoryKeyValueStore store_;
  mutable absl::Mutex mu_;
  struct Slot {
    MemberInfo info;
    std::string proof;
    absl::Time last_seen;
  };
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::string broken_reason_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread monitor_;
};

// A random non-zero 64-bit id for one daemon process.
uint64_t NewIncarnation();
// 32 random bytes: one daemon process's membership proof (JoinArgs::proof).
std::string NewProof();

// The key prefix of one generation's rendezvous data.
std::string GenerationPrefix(uint64_t coordinator_incarnation, uint64_t generation);

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_MEMBERSHIP_H_
