#include "server/comm/agreement.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace diond::comm {

absl::StatusOr<std::vector<std::string>> ExchangeValues(KeyValueStore& kv,
                                                        const std::string& prefix, int rank,
                                                        int size, absl::string_view value,
                                                        absl::Duration timeout,
                                                        std::optional<std::vector<int>>* missing) {
  DIOND_RETURN_IF_ERROR(kv.Set(absl::StrCat(prefix, rank), value));
  std::vector<std::string> keys;
  keys.reserve(size);
  for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat(prefix, r));
  if (absl::Status waited = kv.Wait(keys, timeout); !waited.ok()) {
    if (missing != nullptr) {
      missing->emplace();
      for (int r = 0; r < size; ++r) {
        if (!kv.Get(keys[r]).ok()) (*missing)->push_back(r);
      }
    }
    return waited;
  }
  std::vector<std::string> values;
  for (int r = 0; r < size; ++r) {
    DIOND_ASSIGN_OR_RETURN(std::string v, kv.Get(keys[r]));
    values.push_back(std::move(v));
  }
  return values;
}

}  // namespace diond::comm
