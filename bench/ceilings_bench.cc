// GEMM ceilings on this machine, measured through the ops API: f32 with OpenBLAS and with
// oneDNN, bf16 (f32 accumulation, bf16 output) with oneDNN, at 1 and 2 threads.
#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "benchmark/benchmark.h"
#include "cblas.h"
#include "kernels/ops.h"

namespace diond::bench {
namespace {

using kernels::BFloat16;
using kernels::Context;
using kernels::Fp32GemmEngine;
using kernels::GemmParams;
using kernels::MakeView;

std::vector<float> Random(int64_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

template <bool kBf16>
void RunGemm(benchmark::State& state, Fp32GemmEngine engine) {
  const int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  auto ctx = Context::CpuDefault(threads);
  const auto a = Random(n * n), b = Random(n * n);
  GemmParams p;
  p.engine = engine;
  std::vector<float> c(n * n);
  std::vector<BFloat16> a16(n * n), b16(n * n), c16(n * n);
  for (int64_t i = 0; i < n * n; ++i) {
    a16[i] = kernels::FloatToBf16(a[i]);
    b16[i] = kernels::FloatToBf16(b[i]);
  }
  double best = 0.0, total_s = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = kBf16
                         ? kernels::Gemm(*ctx, p, MakeView(a16.data(), {n, n}),
                                         MakeView(b16.data(), {n, n}), MakeView(c16.data(), {n, n}))
                         : kernels::Gemm(*ctx, p, MakeView(a.data(), {n, n}),
                                         MakeView(b.data(), {n, n}), MakeView(c.data(), {n, n}));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    best = std::max(best, 2.0 * n * n * n / dt / 1e9);
    total_s += dt;
  }
  const char* precision = kBf16 ? "bf16" : "fp32";
  // The ceiling is the mean rate over the timed iterations (what the GFLOP/s counter shows);
  // the best single iteration is reported alongside.
  const double mean = total_s > 0 ? 2.0 * n * n * n * state.iterations() / total_s / 1e9 : 0.0;
  RecordCeiling(precision, threads, mean);
  state.counters["GFLOP/s"] = mean;
  state.counters["best_GFLOP/s"] = best;
  // The OpenBLAS kernel set in use (OPENBLAS_CORETYPE or autodetected), for the report.
  state.SetLabel(std::string(precision) + " openblas:" + openblas_get_corename());
}

void BM_GemmF32(benchmark::State& state, Fp32GemmEngine engine) { RunGemm<false>(state, engine); }
void BM_GemmBf16(benchmark::State& state, Fp32GemmEngine engine) { RunGemm<true>(state, engine); }

void CeilingArgs(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({2048, threads});
  b->ArgNames({"n", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

BENCHMARK_CAPTURE(BM_GemmF32, f32_openblas, Fp32GemmEngine::kOpenBlas)->Apply(CeilingArgs);
BENCHMARK_CAPTURE(BM_GemmF32, f32_onednn, Fp32GemmEngine::kOneDnn)->Apply(CeilingArgs);
BENCHMARK_CAPTURE(BM_GemmBf16, bf16_onednn, Fp32GemmEngine::kAuto)->Apply(CeilingArgs);

}  // namespace
}  // namespace diond::bench
