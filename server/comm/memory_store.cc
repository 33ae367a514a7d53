#include "server/comm/memory_store.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/bounded.h"

namespace diond::comm {

MemoryKeyValueStore::MemoryKeyValueStore(StoreLimits limits)
    : limits_(limits), timer_([this] { TimerLoop(); }) {}

MemoryKeyValueStore::~MemoryKeyValueStore() {
  std::list<Waiter> pending;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    pending.swap(waiters_);
  }
  timer_.join();
  for (auto& w : pending) w.done(absl::UnavailableError("the rendezvous store is shutting down"));
}

bool MemoryKeyValueStore::HasAll(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (data_.find(k) == data_.end()) return false;
  }
  return true;
}

std::string MemoryKeyValueStore::Missing(const std::vector<std::string>& keys) const {
  // Bounded (the keys come from peers): at most 8 keys of at most 200 bytes each, then a count.
  std::string out;
  size_t missing = 0;
  for (const auto& k : keys) {
    if (data_.find(k) != data_.end()) continue;
    if (++missing <= 8) absl::StrAppend(&out, out.empty() ? "" : ", ", "'", Bounded(k), "'");
  }
  if (missing > 8) absl::StrAppend(&out, ", \xe2\x80\xa6 (", missing, " keys)");
  return out;
}

absl::Status MemoryKeyValueStore::Set(absl::string_view key, absl::string_view value) {
  std::vector<std::function<void(absl::Status)>> ready;
  {
    const int64_t key_bytes = static_cast<int64_t>(key.size());
    const int64_t value_bytes = static_cast<int64_t>(value.size());
    if (key_bytes > limits_.max_key_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("rendezvous key of ", key_bytes, " bytes is over the limit of ",
                       limits_.max_key_bytes, " (--world_max_key_bytes)"));
    }
    if (value_bytes > limits_.max_value_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "value of rendezvous key '", Bounded(key), "' is ", value_bytes,
          " bytes, over the limit of ", limits_.max_value_bytes, " (--world_max_value_bytes)"));
    }
    absl::MutexLock lock(&mu_);
    auto it = data_.find(key);
    const int64_t old_bytes =
        it == data_.end() ? 0 : key_bytes + static_cast<int64_t>(it->second.size());
    if (it == data_.end() && static_cast<int64_t>(data_.size()) >= limits_.max_keys) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the rendezvous store holds ", data_.size(), " keys, the limit ",
                       "(--world_max_keys); key '", Bounded(key), "' was not stored"));
    }
    if (bytes_ - old_bytes + key_bytes + value_bytes > limits_.max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("storing key '", Bounded(key), "' would take the rendezvous store to ",
                       bytes_ - old_bytes + key_bytes + value_bytes, " bytes, over the limit of ",
                       limits_.max_bytes, " (--world_max_store_bytes)"));
    }
    bytes_ += key_bytes + value_bytes - old_bytes;
    data_[std::string(key)] = std::string(value);
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (HasAll(it->keys)) {
        ready.push_back(std::move(it->done));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& f : ready) f(absl::OkStatus());
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryKeyValueStore::Get(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  auto it = data_.find(key);
  if (it == data_.end()) return absl::NotFoundError(absl::StrCat("no key '", Bounded(key), "'"));
  return it->second;
}

absl::Status MemoryKeyValueStore::Wait(const std::vector<std::string>& keys,
                                       absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all = [this, &keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return HasAll(keys); };
  if (mu_.AwaitWithTimeout(absl::Condition(&all), timeout)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("timed out after ", absl::FormatDuration(timeout),
                                                  " waiting for keys ", Missing(keys)));
}

void MemoryKeyValueStore::WaitAsync(std::vector<std::string> keys, absl::Duration timeout,
                                    std::function<void(absl::Status)> done) {
  {
    absl::MutexLock lock(&mu_);
    if (!HasAll(keys)) {
      waiters_.push_back(Waiter{std::move(keys), absl::Now() + timeout, std::move(done)});
      return;
    }
  }
  done(absl::OkStatus());
}

void MemoryKeyValueStore::CancelWaiters() {
  std::list<Waiter> pending;
  {
    absl::MutexLock lock(&mu_);
    pending.swap(waiters_);
  }
  for (auto& w : pending) w.done(absl::UnavailableError("the coordinator is shutting down"));
}

void MemoryKeyValueStore::DeletePrefix(absl::string_view prefix) {
  absl::MutexLock lock(&mu_);
  for (auto it = data_.lower_bound(prefix);
       it != data_.end() && absl::StartsWith(it->first, prefix);) {
    bytes_ -= static_cast<int64_t>(it->first.size() + it->second.size());
    it = data_.erase(it);
  }
}

int64_t MemoryKeyValueStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t MemoryKeyValueStore::size() const {
  absl::MutexLock lock(&mu_);
  return data_.size();
}

void MemoryKeyValueStore::TimerLoop() {
  // A 20 ms tick is far below any rendezvous timeout (seconds) and costs nothing measurable.
  while (true) {
    std::vector<std::pair<std::function<void(absl::Status)>, std::string>> expired;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (it->deadline <= now) {
          expired.emplace_back(std::move(it->done), Missing(it->keys));
          it = waiters_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [f, missing] : expired) {
      f(absl::DeadlineExceededError(absl::StrCat("timed out waiting for keys ", missing)));
    }
  }
}

}  // namespace diond::comm
