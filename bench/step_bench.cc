// Step time of every algorithm over the matrices of one GPT-2-small transformer layer
// (768×768 ×4 for Q, K, V, O; 768×3072; 3072×768), both precision modes, through
// GroupOptimizer::Step (the daemon's path, staging and commit included).
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"

namespace {

using diond::optim::AlgorithmKind;

void BM_LayerStep(benchmark::State& state) {
  const auto kind = static_cast<AlgorithmKind>(state.range(0));
  const auto precision = static_cast<diond::optim::Precision>(state.range(1));
  const std::vector<diond::optim::ParamShape> shapes = {{768, 768}, {768, 768},  {768, 768},
                                                        {768, 768}, {768, 3072}, {3072, 768}};
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

// ---- kbw: the passes over memory of one AdamW step (docs/BENCHMARKS.md, "Where AdamW's step
// goes"), over `n` parameters in one tensor, each pass alone, in the same process:
//   0 triad   out ← 1·b + 3·c (Axpby; counted as 12 bytes per element, as STREAM and
//             bench/compare_reference.py count it);
//   1 scan    AllFinite over the gradient (4 bytes; the daemon's finiteness scan);
//   2 adamw   the fused tracked AdamW (28 bytes; the in-place step, Σ(Δx)² included);
//   3 copy    CopyWithChange (12 bytes; the commit of a staged parameter).
// bytes_per_second counts those bytes; "of_triad" is not computed here (run the rows together
// and divide, or read compare_reference.py's figure).
void BM_AdamWPasses(benchmark::State& state) {
  const int pass = static_cast<int>(state.range(0));
  const int64_t n = state.range(1);
  auto ctx = diond::kernels::Context::CpuDefault(static_cast<int>(state.range(2)));
  std::vector<float> a(n, 0.0f), b(n, 0.01f), c(n, 0.0f), d(n, 0.0f);
  std::mt19937 gen(1);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < n; i += 97) b[i] = 0.01f * nd(gen);  // sparse noise: no init pass
  float sq = 0.0f;
  auto v = [](std::vector<float>& x) {
    return diond::kernels::MakeView(x.data(), {int64_t(x.size())});
  };
  auto cv = [](const std::vector<float>& x) {
    return diond::kernels::MakeView(x.data(), {int64_t(x.size())});
  };
  diond::kernels::AdamWParams p;
  p.lr = 0.01f;
  p.weight_decay = 0.01f;
  int64_t bytes_per = 0;
  const char* label = "";
  for (auto _ : state) {
    absl::Status s;
    bool finite = false;
    switch (pass) {
      case 0:
        s = diond::kernels::Axpby(*ctx, 1.0f, cv(b), 3.0f, cv(c), v(a));
        bytes_per = 12;
        label = "triad (Axpby)";
        break;
      case 1:
        s = diond::kernels::AllFinite(*ctx, cv(b), &finite);
        benchmark::DoNotOptimize(finite);
        bytes_per = 4;
        label = "finiteness scan (AllFinite)";
        break;
      case 2:
        s = diond::kernels::AdamWStep(*ctx, p, cv(b), v(a), v(c), v(d),
                                      diond::kernels::MakeView(&sq, {1}));
        ++p.step;
        bytes_per = 28;
        label = "fused AdamW, tracked";
        break;
      default:
        s = diond::kernels::CopyWithChange(*ctx, cv(b), v(a), diond::kernels::MakeView(&sq, {1}));
        bytes_per = 12;
        label = "commit copy (CopyWithChange)";
        break;
    }
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * bytes_per);
  state.SetLabel(label);
}
// 46.5M: the AdamW row of `compare_reference.py --layers 1`; 124.4M: 12 layers.
BENCHMARK(BM_AdamWPasses)
    ->ArgNames({"pass", "n", "threads"})
    ->ArgsProduct({{0, 1, 2, 3}, {46473216, 124439808}, {2}})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();
// ---- end kbw ------------------------------------------------------------------------------------

}  // namespace

BENCHMARK_MAIN();
