// The arena layout of a session: every parameter (and its gradient) at a 256-byte-aligned offset
// in a flat arena, in declaration order. Sizes are checked for int64 overflow.
#ifndef DIOND_SERVER_SESSION_LAYOUT_H_
#define DIOND_SERVER_SESSION_LAYOUT_H_

#include "absl/status/statusor.h"
#include "server/session/types.h"

namespace diond::session {

// INVALID_ARGUMENT naming the parameter for a non-positive dimension, more than 8 dims, or a
// size that overflows int64. Gradients share the parameters' offsets in their own arena.
absl::StatusOr<Layout> ComputeLayout(const std::vector<ParamSpec>& params);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_LAYOUT_H_
