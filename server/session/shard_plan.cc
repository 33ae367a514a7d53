#include "server/session/shard_plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/optim/option_table.h"

namespace diond::session {

absl::string_view GradientSyncName(GradientSync s) {
  switch (s) {
    case GradientSync::kReplicated:
      return "REPLICATED";
    case GradientSync::kAverage:
      return "AVERAGE";
    case GradientSync::kDionCompressed:
      return "DION_COMPRESSED";
  }
  return "?";
}

std::vector<size_t> ShardPlan::Owned(int rank) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < owner.size(); ++i) {
    if (owner[i] == rank) out.push_back(i);
  }
  return out;
}

double ParamCost(const optim::GroupConfig& config, const std::vector<int64_t>& shape) {
  double numel = 1;
  for (int64_t d : shape) numel *= static_cast<double>(d);
  using optim::AlgorithmKind;
  if (config.algorithm == AlgorithmKind::kAdamW || config.algorithm == AlgorithmKind::kLion ||
      shape.size() < 2) {
    return numel;
  }
  const double m = static_cast<double>(shape[shape.size() - 2]);
  const double n = static_cast<double>(shape.back());
  const double mn = std::min(m, n);
  switch (config.algorithm) {
    case AlgorithmKind::kDion: {
      const int64_t r =
          optim::DionRank(static_cast<int64_t>(m), static_cast<int64_t>(n),
                          config.hyperparams.rank_fraction, config.hyperparams.rank_multiple_of);
      return numel * static_cast<double>(r);
    }
    case AlgorithmKind::kDion2:
    case AlgorithmKind::kNorDion2: {
      const double k = static_cast<double>(
          optim::SelectionCount(static_cast<int64_t>(mn), config.hyperparams.fraction));
      return numel * k;
    }
    default:
      return numel * mn;
  }
}

absl::StatusOr<ShardPlan> ComputeShardPlan(const SessionSpec& spec, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " must be >= 1"));
  }
  std::map<std::string, size_t> group_index;
  for (size_t g = 0; g < spec.groups.size(); ++g) group_index.emplace(spec.groups[g].name, g);
  // Batches by (group, shape), in order of first appearance.
  std::vector<std::vector<size_t>> batches;
  std::map<std::pair<size_t, std::vector<int64_t>>, size_t> batch_of;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    auto it = group_index.find(spec.params[i].group);
    if (it == group_index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", spec.params[i].name,
                                                     "' names unknown group '",
                                                     spec.params[i].group, "'"));
    }
    auto [b, inserted] =
        batch_of.emplace(std::make_pair(it->second, spec.params[i].shape), batches.size());
    if (inserted) batches.emplace_back();
    batches[b->second].push_back(i);
  }
  ShardPlan plan;
  plan.world_size = world_size;
  plan.owner.assign(spec.params.size(), 0);
  plan.load.assign(static_cast<size_t>(world_size), 0.0);
  const int w = world_size;
  int next = 0;  // rotation point: where the previous batch ended
  for (const std::vector<size_t>& batch : batches) {
    const size_t g = group_index[spec.params[batch[0]].group];
    const double cost = ParamCost(spec.groups[g].config, spec.params[batch[0]].shape);
    const int64_t n = static_cast<int64_t>(batch.size());
    const int64_t per_rank = (n + w - 1) / w;
    // Start at the least-loaded rank, ties broken in rotating order from `next`.
    int start = next;
    for (int k = 1; k < w; ++k) {
      const int r = (next + k) % w;
      if (plan.load[r] < plan.load[start]) start = r;
    }
    int last = start;
    for (int64_t j = 0; j < n; ++j) {
      const int r = static_cast<int>((start + j / per_rank) % w);
      plan.owner[batch[static_cast<size_t>(j)]] = r;
      plan.load[r] += cost;
      last = r;
    }
    next = (last + 1) % w;
  }
  // FNV-1a 64 over the canonical text.
  const std::string text = ShardPlanCanonicalText(spec, plan);
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  plan.hash = h;
  return plan;
}

std::string ShardPlanCanonicalText(const SessionSpec& spec, const ShardPlan& plan) {
  std::string t = absl::StrCat(
      "W=", plan.world_size, ";sync=", GradientSyncName(spec.gradient_sync),
      ";master=", spec.fp32_master_weights ? 1 : 0,
      ";nonfinite=", spec.non_finite == NonFinitePolicy::kSkip ? "skip" : "error", "\n");
  for (const GroupSpec& g : spec.groups) {
    const optim::GroupConfig& c = g.config;
    absl::StrAppend(&t, "group ", g.name, " ", optim::AlgorithmName(c.algorithm), " ",
                    optim::PrecisionName(c.precision));
    // Every option of the table (kernels/optim/options.def), exactly: a new row is in the hash
    // without an edit here.
    for (const optim::OptionRow& row : optim::OptionTable()) {
      const optim::OptionValue v = row.get(c.hyperparams);
      absl::StrAppend(&t, " ", row.member, "=",
                      row.type == optim::OptionType::kDouble ? absl::StrFormat("%.17g", v.number)
                                                             : absl::StrCat(v.integer));
    }
    absl::StrAppend(&t, " heads=", c.num_heads, " split=", absl::StrJoin(c.split_sizes, ","),
                    " flatten=", c.flatten ? 1 : 0, " seed=", c.seed,
                    // Only when set, so that the default's text (and plan hash) is unchanged.
                    c.bf16_matmul == optim::Bf16MatmulEngine::kAuto
                        ? ""
                        : absl::StrCat(" bf16mm=", optim::Bf16MatmulEngineName(c.bf16_matmul)),
                    "\n");
  }
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    absl::StrAppend(&t, "param ", p.name, " [", absl::StrJoin(p.shape, ","), "] ",
                    kernels::DTypeName(p.dtype), " ", p.group, " -> ",
                    i < plan.owner.size() ? plan.owner[i] : -1, "\n");
  }
  return t;
}

std::string ShardPlanHashHex(uint64_t hash) { return absl::StrFormat("%016x", hash); }

}  // namespace diond::session
