#include "server/session/layout.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded.h"

namespace diond::session {

absl::StatusOr<Layout> ComputeLayout(const std::vector<ParamSpec>& params) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Layout layout;
  int64_t offset = 0;
  for (const ParamSpec& p : params) {
    if (p.shape.size() > 8) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", Bounded(p.name), "' has ",
                                                     p.shape.size(), " dims; at most 8"));
    }
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("parameter '", Bounded(p.name), "' shape [",
                                                       absl::StrJoin(p.shape, ", "),
                                                       "] has a non-positive dimension"));
      }
      if (numel > kMax / d) {
        return absl::InvalidArgumentError(absl::StrCat("parameter '", Bounded(p.name), "' shape [",
                                                       absl::StrJoin(p.shape, ", "),
                                                       "] overflows int64"));
      }
      numel *= d;
    }
    const int64_t elem = static_cast<int64_t>(kernels::DTypeSize(p.dtype));
    if (numel > kMax / elem - kArenaAlignment) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", Bounded(p.name), "' is too large: ", numel, " elements"));
    }
    const int64_t bytes = numel * elem;
    if (offset > kMax - bytes - kArenaAlignment) {
      return absl::InvalidArgumentError("total arena size overflows int64");
    }
    TensorPlacement t;
    t.name = p.name;
    t.shape = p.shape;
    t.dtype = p.dtype;
    t.numel = numel;
    t.size_bytes = bytes;
    t.param_offset = offset;
    t.grad_offset = offset;
    layout.tensors.push_back(t);
    offset += (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
  }
  layout.param_arena_bytes = offset;
  layout.grad_arena_bytes = offset;
  return layout;
}

}  // namespace diond::session
