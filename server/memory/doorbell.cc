#include "server/memory/doorbell.h"

#include <time.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace diond::memory {
namespace {

constexpr char kMagic[8] = {'D', 'I', 'O', 'N', 'D', 'D', 'B', '1'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kSlotBytes = 64;
constexpr absl::Duration kFirstPoll = absl::Microseconds(20);
constexpr absl::Duration kLastPoll = absl::Milliseconds(1);

void Sleep(absl::Duration d) {
  const timespec ts = absl::ToTimespec(d);
  nanosleep(&ts, nullptr);
}

}  // namespace

int64_t Doorbells::BytesFor(int buckets) { return kHeaderBytes + kSlotBytes * buckets; }

absl::StatusOr<Doorbells> Doorbells::Attach(const ShmRegion* region) {
  const std::string where = region->Describe();
  if (region->size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("doorbells: ", where, " has ", region->size(),
                                                   " bytes, fewer than the header's 64"));
  }
  char magic[8];
  uint32_t version = 0, buckets = 0;
  std::memcpy(magic, region->data(), 8);
  std::memcpy(&version, region->data() + 8, 4);
  std::memcpy(&buckets, region->data() + 12, 4);
  if (absl::Status s = region->CheckIntact(); !s.ok()) return s;
  if (std::memcmp(magic, kMagic, 8) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbells: ", where, " does not start with \"DIONDDB1\""));
  }
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("doorbells: ", where, " has version ", version,
                                                   "; this daemon reads version ", kVersion));
  }
  if (buckets < 1 || buckets > static_cast<uint32_t>(kMaxBuckets)) {
    return absl::InvalidArgumentError(absl::StrCat("doorbells: ", where, " declares ", buckets,
                                                   " buckets; 1 to ", kMaxBuckets, " are allowed"));
  }
  const int n = static_cast<int>(buckets);
  if (region->size() < BytesFor(n)) {
    return absl::InvalidArgumentError(absl::StrCat("doorbells: ", where, " has ", region->size(),
                                                   " bytes; ", n, " buckets need ", BytesFor(n)));
  }
  return Doorbells(region, n);
}

int64_t* Doorbells::word(int k, int which) const {
  return reinterpret_cast<int64_t*>(region_->data() + kHeaderBytes + kSlotBytes * k +
                                    int64_t{8} * which);
}

int64_t Doorbells::gradients(int k) const { return __atomic_load_n(word(k, 0), __ATOMIC_ACQUIRE); }

int64_t Doorbells::weights(int k) const { return __atomic_load_n(word(k, 1), __ATOMIC_ACQUIRE); }

void Doorbells::RingWeights(int k, int64_t step) const {
  __atomic_store_n(word(k, 1), step, __ATOMIC_RELEASE);
}

void Doorbells::FailWeights(int64_t step) const {
  for (int k = 0; k < buckets_; ++k) __atomic_store_n(word(k, 1), -step, __ATOMIC_RELEASE);
}

absl::StatusOr<int> Doorbells::WaitAnyGradients(const std::vector<bool>& taken, int64_t step,
                                                absl::Time deadline,
                                                absl::FunctionRef<bool()> cancelled) const {
  absl::Duration poll = kFirstPoll;
  while (true) {
    for (int k = 0; k < buckets_; ++k) {
      const int64_t rung = gradients(k);
      if (region_->broken()) break;
      // A bucket already taken counts too: the trainer may abandon after ringing it.
      if (rung == -step) {
        return absl::AbortedError(absl::StrCat("the trainer abandoned step ", step, " (bucket ", k,
                                               "'s doorbell says -", step, ")"));
      }
      if (taken[static_cast<size_t>(k)]) continue;
      if (rung == step) return k;
      if (rung > step) {
        return absl::FailedPreconditionError(
            absl::StrCat("doorbells: bucket ", k, " was rung for step ", rung,
                         " while the daemon waits for step ", step));
      }
    }
    if (region_->broken()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "doorbells: ", region_->Describe(), " shrank while step ", step, " waited on it"));
    }
    if (cancelled()) {
      return absl::CancelledError(
          absl::StrCat("doorbells: the wait for step ", step, "'s gradients was cancelled"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      std::string missing;
      for (int k = 0, listed = 0; k < buckets_ && listed < 8; ++k) {
        if (taken[static_cast<size_t>(k)]) continue;
        absl::StrAppend(&missing, listed++ == 0 ? "" : ", ", k);
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "doorbells: step ", step, ": no gradients rung for bucket(s) ", missing, " in time"));
    }
    Sleep(std::min(poll, deadline - now));
    poll = std::min(poll * 2, kLastPoll);
  }
}

}  // namespace diond::memory
