// Step time of every algorithm over the matrices of one GPT-2-small transformer layer
// (768×768 ×4 for Q, K, V, O; 768×3072; 3072×768), both precision modes, through
// GroupOptimizer::Step (the daemon's path, staging and commit included).
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/optim/group_optimizer.h"

namespace {

using diond::optim::AlgorithmKind;

void BM_LayerStep(benchmark::State& state) {
  const auto kind = static_cast<AlgorithmKind>(state.range(0));
  const auto precision = static_cast<diond::optim::Precision>(state.range(1));
  const std::vector<diond::optim::ParamShape> shapes = {
      {768, 768}, {768, 768}, {768, 768}, {768, 768}, {768, 3072}, {3072, 768}};
  diond::optim::GroupConfig cfg;
  cfg.algorithm = kind;
  cfg.hyperparams = diond::optim::DefaultHyperparams(kind);
  cfg.precision = precision;
  auto opt = diond::optim::CreateGroupOptimizer(cfg, shapes);
  if (!opt.ok()) {
    state.SkipWithError(std::string(opt.status().message()).c_str());
    return;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> x, g;
  std::vector<float*> xp;
  std::vector<const float*> gp;
  for (const auto& s : shapes) {
    x.emplace_back(s[0] * s[1]);
    g.emplace_back(s[0] * s[1]);
    for (float& e : x.back()) e = 0.02f * nd(gen);
    for (float& e : g.back()) e = nd(gen);
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    xp.push_back(x[i].data());
    gp.push_back(g[i].data());
  }
  auto ctx = diond::kernels::Context::CpuDefault();
  for (auto _ : state) {
    auto s = (*opt)->Step(*ctx, xp, gp);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  state.SetLabel(std::string(diond::optim::AlgorithmName(kind)) + "/" +
                 std::string(diond::optim::PrecisionName(precision)));
}

void Args(benchmark::internal::Benchmark* b) {
  for (int k = 0; k <= static_cast<int>(AlgorithmKind::kLion); ++k) {
    const bool bf16 = diond::optim::HasBf16Path(static_cast<AlgorithmKind>(k));
    b->Args({k, 0});
    if (bf16) b->Args({k, 1});
  }
}

BENCHMARK(BM_LayerStep)->Apply(Args)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
