#include "server/comm/membership.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bounded.h"
#include "common/logging.h"
#include "openssl/crypto.h"

namespace diond::comm {

int MembershipView::live_count() const {
  int n = 0;
  for (const auto& m : members) n += m.live ? 1 : 0;
  return n;
}

uint64_t NewIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

std::string NewProof() {
  std::random_device rd;  // getrandom(2) on Linux
  std::string p(32, '\0');
  for (char& c : p) c = static_cast<char>(rd() & 0xff);
  return p;
}

namespace {
bool SameProof(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}
}  // namespace

std::string GenerationPrefix(uint64_t coordinator_incarnation, uint64_t generation) {
  return absl::StrCat("world/", absl::Hex(coordinator_incarnation), "/g", generation, "/");
}

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)), incarnation_(NewIncarnation()), store_(options_.store_limits) {
  slots_.resize(options_.world_size);
  monitor_ = std::thread([this] {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.heartbeat_interval / 2)) {
      mu_.Unlock();
      CheckLiveness(absl::Now());
      mu_.Lock();
    }
  });
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  monitor_.join();
}

MembershipView Coordinator::ViewLocked() const {
  MembershipView v;
  v.generation = generation_;
  v.world_size = options_.world_size;
  v.broken_reason = broken_reason_;
  v.coordinator_incarnation = incarnation_;
  for (const auto& s : slots_) {
    if (s.info.incarnation != 0) v.members.push_back(s.info);
  }
  v.complete = v.live_count() == options_.world_size;
  return v;
}

void Coordinator::NewGenerationLocked(std::string reason) {
  // Old generations' rendezvous data is never read again (each has its own prefix).
  store_.DeletePrefix(GenerationPrefix(incarnation_, generation_ > 1 ? generation_ - 1 : 0));
  ++generation_;
  broken_reason_ = std::move(reason);
}

absl::StatusOr<MembershipView> Coordinator::Join(const JoinArgs& a) {
  if (a.world_size != options_.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "world size mismatch: rank ", a.rank, " was started with --world_size=", a.world_size,
        " but the coordinator (rank 0) has --world_size=", options_.world_size));
  }
  if (a.rank < 0 || a.rank >= options_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", a.rank, " is outside [0, ", options_.world_size, ")"));
  }
  if (a.incarnation == 0) return absl::InvalidArgumentError("incarnation must be non-zero");
  if (a.address.size() > kMaxMemberAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat("address of rank ", a.rank, " is ",
                                                   a.address.size(), " bytes; the limit is ",
                                                   kMaxMemberAddressBytes));
  }
  if (a.proof.size() < 16 || a.proof.size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat("Join proof of rank ", a.rank, " is ",
                                                   a.proof.size(), " bytes; it must be 16 to 64"));
  }
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[a.rank];
  if (s.info.live && s.info.incarnation == a.incarnation && !SameProof(s.proof, a.proof)) {
    return absl::PermissionDeniedError(
        absl::StrCat("rank ", a.rank,
                     " is held by a live daemon and this Join does not carry the proof of "
                     "its first Join"));
  }
  if (s.info.live && s.info.incarnation != a.incarnation) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", a.rank, " is already held by a live daemon at ",
                     Bounded(s.info.address), " (incarnation ", absl::Hex(s.info.incarnation),
                     "); a duplicate --rank, or a restarted "
                     "daemon whose predecessor is not yet declared lost"));
  }
  const bool fresh = !s.info.live || s.info.incarnation != a.incarnation;
  s.info = MemberInfo{a.rank, a.address, a.incarnation, true};
  s.proof = a.proof;
  s.last_seen = absl::Now();
  if (fresh) {
    NewGenerationLocked(absl::StrCat("rank ", a.rank, " joined"));
    DIOND_LOG(INFO) << "world: rank " << a.rank << " joined from " << a.address << "; generation "
                    << generation_;
  } else if (a.rebuild) {
    NewGenerationLocked(absl::StrCat("rank ", a.rank, " asked for a rebuild"));
    DIOND_LOG(INFO) << "world: rank " << a.rank << " asked for a rebuild; generation "
                    << generation_;
  }
  return ViewLocked();
}

absl::StatusOr<MembershipView> Coordinator::Heartbeat(int rank, uint64_t incarnation,
                                                      const std::string& proof) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= options_.world_size || !slots_[rank].info.live ||
      slots_[rank].info.incarnation != incarnation) {
    return absl::NotFoundError(absl::StrCat("rank ", rank, " (incarnation ", absl::Hex(incarnation),
                                            ") is not a live member; join again"));
  }
  if (!SameProof(slots_[rank].proof, proof)) {
    return absl::PermissionDeniedError(
        absl::StrCat("heartbeat for rank ", rank, " does not carry the proof of the rank's Join"));
  }
  slots_[rank].last_seen = absl::Now();
  return ViewLocked();
}

absl::StatusOr<MembershipView> Coordinator::GetMembership() {
  absl::MutexLock lock(&mu_);
  return ViewLocked();
}

void Coordinator::CheckLiveness(absl::Time now) {
  // Lost after peer_timeout - heartbeat_interval of silence, so that survivors, who poll every
  // heartbeat_interval, learn it within peer_timeout.
  const absl::Duration limit =
      std::max(options_.peer_timeout - options_.heartbeat_interval, options_.heartbeat_interval);
  std::vector<std::pair<int, std::string>> lost;
  uint64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    for (auto& s : slots_) {
      if (!s.info.live || now - s.last_seen <= limit) continue;
      s.info.live = false;
      std::string reason =
          absl::StrCat("rank ", s.info.rank, " (", s.info.address, ") lost: no heartbeat for ",
                       absl::FormatDuration(now - s.last_seen));
      NewGenerationLocked(reason);
      lost.emplace_back(s.info.rank, std::move(reason));
    }
    generation = generation_;
  }
  for (auto& [rank, reason] : lost) {
    DIOND_LOG(WARNING) << "world: " << reason << "; generation " << generation;
    if (options_.on_rank_lost) options_.on_rank_lost(rank, generation, reason);
  }
}

}  // namespace diond::comm
