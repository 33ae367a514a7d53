// The shard plan of a world session (docs/DISTRIBUTED.md "Shard plan"): which rank owns (runs the
// update rule of, and holds the optimizer state of) each parameter. Whole parameters, never
// slices, so the owner runs exactly the single-process code path.
//
// Assignment, a pure function of the spec and the world size, identical on every worker:
// parameters are batched by (group, shape) in order of first appearance, as the reference's
// megabatches (ALGORITHMS.md §2.4, §15.1). A batch of N parameters is cut into blocks of
// per_rank = ⌈N/W⌉; parameter j of the batch goes to rank (start + ⌊j/per_rank⌋) mod W. The start
// of each batch is the rank with the least accumulated cost so far, ties broken in rotating
// order after the previous batch's last rank, so single matrices (N = 1) spread over the ranks
// and big batches stay balanced. Cost models the update's work (ParamCost).
//
// The hash covers everything that must agree for the ranks to compute the same thing: world
// size, gradient sync, every group's algorithm and options, every parameter's name, shape, dtype
// and group, the master-weights and non-finite policies, and the owners.
//
// Thread-safety: plain values and pure functions.
#ifndef DIOND_SERVER_SESSION_SHARD_PLAN_H_
#define DIOND_SERVER_SESSION_SHARD_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/session/types.h"

namespace diond::session {

struct ShardPlan {
  int world_size = 1;
  std::vector<int> owner;    // per parameter (declaration order)
  std::vector<double> load;  // accumulated cost per rank
  uint64_t hash = 0;

  // Parameters owned by `rank`, in declaration order.
  std::vector<size_t> Owned(int rank) const;
};

// Relative cost of one step of parameter `shape` under `config`: m·n·min(m, n) for the
// orthogonalizing algorithms (Muon, NorMuon, Dion2/NorDion2 count their selected fraction of
// the rows), m·n·r for Dion, numel for AdamW and Lion.
double ParamCost(const optim::GroupConfig& config, const std::vector<int64_t>& shape);

// INVALID_ARGUMENT for world_size < 1 or a parameter naming an unknown group.
absl::StatusOr<ShardPlan> ComputeShardPlan(const SessionSpec& spec, int world_size);

// The canonical text the hash is taken over (exposed for tests and diagnostics).
std::string ShardPlanCanonicalText(const SessionSpec& spec, const ShardPlan& plan);

// 16 lower-case hex digits.
std::string ShardPlanHashHex(uint64_t hash);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SHARD_PLAN_H_
