#include "server/comm/gloo_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace diond::comm {
namespace {

[[noreturn]] void Throw(const absl::Status& s, const std::string& what) {
  throw gloo::IoException(absl::StrCat("rendezvous store: ", what, ": ", s.ToString()));
}

}  // namespace

GlooStore::GlooStore(KeyValueStore* kv, std::string prefix, absl::Duration timeout)
    : kv_(kv), prefix_(std::move(prefix)), timeout_(timeout) {}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = kv_->Set(Key(key), absl::string_view(data.data(), data.size()));
  if (!s.ok()) Throw(s, absl::StrCat("set '", Key(key), "'"));
}

std::vector<char> GlooStore::get(const std::string& key) {
  const std::string k = Key(key);
  absl::Status s = kv_->Wait({k}, timeout_);
  if (!s.ok()) Throw(s, absl::StrCat("get '", k, "'"));
  absl::StatusOr<std::string> v = kv_->Get(k);
  if (!v.ok()) Throw(v.status(), absl::StrCat("get '", k, "'"));
  return std::vector<char>(v->begin(), v->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
}

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(Key(k));
  // Gloo passes its context timeout here; never wait longer than ours.
  absl::Duration t = std::min(absl::FromChrono(timeout), timeout_);
  absl::Status s = kv_->Wait(full, t);
  if (!s.ok()) Throw(s, "wait");
}

}  // namespace diond::comm
