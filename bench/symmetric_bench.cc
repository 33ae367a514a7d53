// bf16 X·Xᵀ: the half-work scheme (SymmetricProductBf16: the lower triangle in column panels of
// bf16 GEMMs, mirrored) against one full bf16 GEMM X·Xᵀ, on the same X, into an f32 or a bf16 C
// (the orthogonalizer's oneDNN mode uses bf16). Counters: effective GFLOP/s counted as the full
// product's 2·n²·k, so a ratio above 1 over the GEMM means time saved. The blocks are those the
// orthogonalizer picks (a fifth of n rounded up to 32, at least 64).
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/ops.h"

namespace diond {
namespace {

using kernels::BFloat16;
using kernels::MakeView;

void RunSym(benchmark::State& state, bool blocked, bool bf16_out) {
  const int64_t n = state.range(0), k = state.range(1), block = state.range(2);
  auto ctx = kernels::Context::CpuDefault(static_cast<int>(state.range(3)));
  std::mt19937 rng(1);
  std::normal_distribution<float> d;
  std::vector<BFloat16> x(n * k);
  for (auto& v : x) v = kernels::FloatToBf16(d(rng));
  std::vector<float> c(n * n);
  std::vector<BFloat16> c16(n * n);
  auto out = [&] { return bf16_out ? MakeView(c16.data(), {n, n}) : MakeView(c.data(), {n, n}); };
  kernels::GemmParams p;
  p.trans_b = kernels::Trans::kYes;
  double total_s = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s =
        blocked
            ? kernels::SymmetricProductBf16(*ctx, MakeView(x.data(), {n, k}), block, out())
            : kernels::Gemm(*ctx, p, MakeView(x.data(), {n, k}), MakeView(x.data(), {n, k}), out());
    total_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  state.counters["eff_GFLOP/s"] =
      total_s > 0 ? 2.0 * n * n * k * state.iterations() / total_s / 1e9 : 0.0;
}

void Args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    b->Args({768, 768, 160, threads});
    b->Args({768, 3072, 160, threads});
    b->Args({192, 3072, 64, threads});
    b->Args({1024, 1024, 224, threads});
    b->Args({1024, 4096, 224, threads});
    b->Args({2048, 2048, 416, threads});
  }
  b->ArgNames({"n", "k", "block", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK_CAPTURE(RunSym, bf16_xxt_full_gemm, false, false)->Apply(Args);
BENCHMARK_CAPTURE(RunSym, bf16_xxt_lower_blocks, true, false)->Apply(Args);
BENCHMARK_CAPTURE(RunSym, bf16_xxt_full_gemm_bf16out, false, true)->Apply(Args);
BENCHMARK_CAPTURE(RunSym, bf16_xxt_lower_blocks_bf16out, true, true)->Apply(Args);

}  // namespace
}  // namespace diond
