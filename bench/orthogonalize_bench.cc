// Orthogonalization throughput: NS5 and Polar Express on 1024x1024, 1024x4096 and 4096x1024 in
// both precision modes. Effective GFLOP/s counts the reference's 4m²n + 2m³ flops per iteration
// (m <= n; ALGORITHMS.md §18 benchmark) × 5 iterations, whatever the kernel actually does, and
// "of_ceiling" divides it by the GEMM ceiling of the same precision and thread count measured
// earlier in the same process (ceilings_bench.cc; fp32: the faster of OpenBLAS and oneDNN).
#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "benchmark/benchmark.h"
#include "kernels/optim/orthogonalize.h"

namespace diond::bench {
namespace {

using kernels::BFloat16;
using kernels::Context;
using kernels::OrthoMethod;
using kernels::OrthoPrecision;

void BM_Orthogonalize(benchmark::State& state, OrthoMethod method, OrthoPrecision precision,
                      kernels::Bf16Matmul bf16_matmul = kernels::Bf16Matmul::kReferenceF32Gemm,
                      kernels::Fp32GemmEngine fp32_engine = kernels::Fp32GemmEngine::kAuto) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  kernels::ContextOptions copts;
  copts.num_threads = threads;
  copts.fp32_gemm = fp32_engine;  // the fp32 mode's GEMMs and symmetric products
  auto ctx_or = Context::Create(copts);
  if (!ctx_or.ok()) {
    state.SkipWithError(std::string(ctx_or.status().message()).c_str());
    return;
  }
  auto& ctx = *ctx_or;
  std::mt19937 rng(5);
  std::normal_distribution<float> d;
  std::vector<float> g(rows * cols), out32(rows * cols);
  for (float& x : g) x = d(rng);
  std::vector<BFloat16> out16(rows * cols);
  kernels::OrthogonalizeOptions o;
  o.method = method;
  o.precision = precision;
  o.bf16_matmul = bf16_matmul;
  const bool bf16 = precision == OrthoPrecision::kBf16Reference;
  // The default bf16_reference matmuls are f32 GEMMs (orthogonalize.h); only the oneDNN variant
  // runs on the bf16 ceiling.
  const bool onednn = bf16 && bf16_matmul == kernels::Bf16Matmul::kOneDnnBf16;
  kernels::TensorView out =
      bf16 ? kernels::TensorView(kernels::MakeView(out16.data(), {rows, cols}))
           : kernels::TensorView(kernels::MakeView(out32.data(), {rows, cols}));
  double total_s = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s =
        kernels::Orthogonalize(*ctx, o, kernels::MakeView(g.data(), {rows, cols}), out);
    total_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  const double m = static_cast<double>(std::min(rows, cols)),
               n = static_cast<double>(std::max(rows, cols));
  const double flop = 5.0 * (4.0 * m * m * n + 2.0 * m * m * m);
  const double gflops = total_s > 0 ? flop * state.iterations() / total_s / 1e9 : 0.0;
  const double ceiling = Ceiling(onednn ? "bf16" : "fp32", threads);
  state.counters["eff_GFLOP/s"] = gflops;
  state.counters["ceiling_GFLOP/s"] = ceiling;
  state.counters["of_ceiling"] = ceiling > 0 ? gflops / ceiling : 0.0;
  state.SetLabel(onednn ? "bf16_reference (oneDNN bf16 matmul)"
                 : bf16 ? "bf16_reference"
                 : fp32_engine == kernels::Fp32GemmEngine::kOpenBlas ? "fp32 (OpenBLAS)"
                                                                     : "fp32");
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (auto [m, n] : std::vector<std::pair<int, int>>{{1024, 1024}, {1024, 4096}, {4096, 1024}}) {
    b->Args({m, n, 2});
  }
  b->ArgNames({"m", "n", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

BENCHMARK_CAPTURE(BM_Orthogonalize, PE_fp32, OrthoMethod::kPolarExpress, OrthoPrecision::kFp32)
    ->Apply(Shapes);
// The fp32 mode with every GEMM and symmetric product on OpenBLAS (ssyrk), as before kAuto
// chose oneDNN (docs/BENCHMARKS.md "f32 engines").
BENCHMARK_CAPTURE(BM_Orthogonalize, PE_fp32openblas, OrthoMethod::kPolarExpress,
                  OrthoPrecision::kFp32, kernels::Bf16Matmul::kReferenceF32Gemm,
                  kernels::Fp32GemmEngine::kOpenBlas)
    ->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Orthogonalize, PE_bf16, OrthoMethod::kPolarExpress,
                  OrthoPrecision::kBf16Reference)
    ->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Orthogonalize, PE_bf16onednn, OrthoMethod::kPolarExpress,
                  OrthoPrecision::kBf16Reference, kernels::Bf16Matmul::kOneDnnBf16)
    ->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Orthogonalize, NS5_fp32, OrthoMethod::kNewtonSchulz5, OrthoPrecision::kFp32)
    ->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Orthogonalize, NS5_bf16, OrthoMethod::kNewtonSchulz5,
                  OrthoPrecision::kBf16Reference)
    ->Apply(Shapes);

}  // namespace
}  // namespace diond::bench
