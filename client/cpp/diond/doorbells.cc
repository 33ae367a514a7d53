#include "diond/doorbells.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "diond/internal/arena_view.h"

namespace diond::client {
namespace {

// server/memory/doorbell.h's layout.
constexpr char kMagic[8] = {'D', 'I', 'O', 'N', 'D', 'D', 'B', '1'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kSlotBytes = 64;
constexpr int kMaxBuckets = 65536;

}  // namespace

absl::StatusOr<DoorbellPage> DoorbellPage::Create(
    const Client* client, const std::string& session_id,
    const std::vector<std::vector<int32_t>>& buckets) {
  const int k = static_cast<int>(std::min<size_t>(buckets.size(), kMaxBuckets + 1));
  if (k < 1 || k > kMaxBuckets) {
    return absl::InvalidArgumentError(
        absl::StrCat("DoorbellPage: ", buckets.size(), " buckets; 1 to ", kMaxBuckets));
  }
  DoorbellPage page;
  auto seg = internal::CreateShmSegment(kHeaderBytes + kSlotBytes * k);
  if (!seg.ok()) return seg.status();
  page.segment_ = *std::move(seg);
  page.buckets_ = k;
  uint8_t* base = page.segment_.base;  // zeroed by ftruncate
  std::memcpy(base, kMagic, sizeof(kMagic));
  std::memcpy(base + 8, &kVersion, sizeof(kVersion));
  const uint32_t count = static_cast<uint32_t>(k);
  std::memcpy(base + 12, &count, sizeof(count));
  v1::RegisterRegionRequest req;
  req.set_session_id(session_id);
  req.set_role(v1::REGION_ROLE_DOORBELLS);
  req.set_kind(v1::REGION_KIND_SYSTEM_SHM);
  req.mutable_system_shm()->set_name(page.segment_.name);
  req.mutable_system_shm()->set_size_bytes(page.segment_.size_bytes);
  for (const std::vector<int32_t>& b : buckets) {
    req.add_buckets()->mutable_params()->Add(b.begin(), b.end());
  }
  auto resp = client->RegisterRegion(req);
  if (!resp.ok()) return resp.status();  // `page` unmaps and unlinks
  page.client_ = client;
  page.session_id_ = session_id;
  page.region_id_ = resp->region_id();
  return page;
}

DoorbellPage::DoorbellPage(DoorbellPage&& other) noexcept { *this = std::move(other); }

DoorbellPage& DoorbellPage::operator=(DoorbellPage&& other) noexcept {
  if (this != &other) {
    Reset();
    client_ = std::exchange(other.client_, nullptr);
    session_id_ = std::move(other.session_id_);
    region_id_ = std::move(other.region_id_);
    segment_ = std::exchange(other.segment_, ShmArena::Segment{});
    buckets_ = std::exchange(other.buckets_, 0);
  }
  return *this;
}

DoorbellPage::~DoorbellPage() { Reset(); }

void DoorbellPage::Reset() {
  if (client_ != nullptr && !region_id_.empty()) {
    client_->UnregisterRegion(session_id_, region_id_).IgnoreError();
  }
  client_ = nullptr;
  region_id_.clear();
  if (segment_.base != nullptr) {
    munmap(segment_.base, static_cast<size_t>(segment_.size_bytes));
    shm_unlink(("/" + segment_.name).c_str());
  }
  segment_ = ShmArena::Segment{};
  buckets_ = 0;
}

int64_t* DoorbellPage::word(int k, int which) const {
  return reinterpret_cast<int64_t*>(segment_.base + kHeaderBytes + kSlotBytes * k +
                                    int64_t{8} * which);
}

void DoorbellPage::RingGradients(int k, int64_t step) const {
  __atomic_store_n(word(k, 0), step, __ATOMIC_RELEASE);
}

int64_t DoorbellPage::weights(int k) const { return __atomic_load_n(word(k, 1), __ATOMIC_ACQUIRE); }

absl::Status DoorbellPage::WaitWeights(int k, int64_t step, absl::Time deadline) const {
  absl::Duration poll = absl::Microseconds(20);
  while (true) {
    const int64_t w = weights(k);
    if (w >= step) return absl::OkStatus();
    if (w == -step) {
      return absl::AbortedError(absl::StrCat("step ", step, " failed in the daemon (bucket ", k,
                                             "'s weights are the previous step's); WaitStep "
                                             "has its error"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("bucket ", k, "'s weights of step ", step, " were not written in time"));
    }
    absl::SleepFor(std::min(poll, deadline - now));
    poll = std::min(poll * 2, absl::Milliseconds(1));
  }
}

}  // namespace diond::client
