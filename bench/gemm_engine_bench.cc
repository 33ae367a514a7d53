// f32 engine choice (ops.h Fp32GemmEngine::kAuto, kernels/cpu/gemm.cc): OpenBLAS against oneDNN
// on the GEMM shapes the rules run, and, for the symmetric products X·Xᵀ / XᵀX, OpenBLAS ssyrk
// against the lower block triangle of oneDNN f32 GEMMs (mirrored). Counter GFLOP/s counts the
// full product's 2·m·n·k (so a symmetric product above the GEMM rate means time saved). One
// engine per benchmark (OpenBLAS's workers spin ~0.1 s after a call and would slow a oneDNN call
// that follows at once); compare engines with --benchmark_repetitions, which runs the list
// repeatedly, and bench/gemm_engine_table.py, which prints the per-shape time ratios.
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/ops.h"

namespace diond::bench {
namespace {

using kernels::Context;
using kernels::ContextOptions;
using kernels::Fp32GemmEngine;
using kernels::MakeView;

std::unique_ptr<Context> Ctx(int threads, Fp32GemmEngine e) {
  ContextOptions o;
  o.num_threads = threads;
  o.fp32_gemm = e;
  auto ctx = Context::Create(o);
  return ctx.ok() ? std::move(*ctx) : nullptr;
}

std::vector<float> Random(int64_t n, int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// mode 0: C[m×n] = op(A)·op(B), ta/tb from range(3..4), batch range(5).
// mode 1: symmetric product, n×n result, inner size k: range(0) = n, range(2) = k,
//         range(3) = 1 for XᵀX (X k×n), 0 for X·Xᵀ (X n×k).
void BM_Engine(benchmark::State& state, int mode, Fp32GemmEngine engine) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool ta = state.range(3) != 0, tb = state.range(4) != 0;
  const int64_t batch = state.range(5);
  const int threads = static_cast<int>(state.range(6));
  auto ctx = Ctx(threads, engine);
  if (!ctx) {
    state.SkipWithError("context");
    return;
  }
  const auto a = Random(batch * m * k, 1), b = Random(batch * k * n, 2);
  std::vector<float> c(batch * m * n);
  auto run = [&]() {
    if (mode == 1) {
      auto x = ta ? MakeView(a.data(), {batch, k, m}) : MakeView(a.data(), {batch, m, k});
      return kernels::SymmetricProduct(*ctx, ta ? kernels::GramSide::kAtA : kernels::GramSide::kAAt,
                                       1.0f, x, 0.0f, MakeView(c.data(), {batch, m, m}));
    }
    kernels::GemmParams p;
    p.trans_a = ta ? kernels::Trans::kYes : kernels::Trans::kNo;
    p.trans_b = tb ? kernels::Trans::kYes : kernels::Trans::kNo;
    auto av = ta ? MakeView(a.data(), {batch, k, m}) : MakeView(a.data(), {batch, m, k});
    auto bv = tb ? MakeView(b.data(), {batch, n, k}) : MakeView(b.data(), {batch, k, n});
    return kernels::Gemm(*ctx, p, av, bv, MakeView(c.data(), {batch, m, n}));
  };
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = run();
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  const double flop = 2.0 * batch * m * (mode == 1 ? m : n) * k * state.iterations();
  state.counters["GFLOP/s"] = total > 0 ? flop / total / 1e9 : 0;
}

// {m, n, k, trans_a, trans_b, batch}; symmetric: {n, n, k, tall (XᵀX), 0, batch}.
const std::vector<std::vector<int64_t>> kGemmShapes = {
    {768, 768, 768, 0, 0, 1},     // Muon square: A·A, B·Y
    {768, 3072, 768, 0, 0, 1},    // wide B·Y
    {3072, 768, 768, 0, 0, 1},    // tall Y·B
    {768, 768, 3072, 0, 1, 1},    // wide Gram Y·Yᵀ as a GEMM
    {768, 768, 3072, 1, 0, 1},    // tall Gram Yᵀ·Y as a GEMM
    {768, 192, 3072, 0, 0, 1},    // Dion ¼: P = M·Q (768×3072 M)
    {3072, 192, 768, 1, 0, 1},    // Dion ¼: R = Mᵀ·P
    {3072, 192, 768, 0, 0, 1},    // Dion ¼: P = M·Q (3072×768 M)
    {768, 192, 3072, 1, 0, 1},    // Dion ¼: R = Mᵀ·P (3072×768 M)
    {768, 192, 768, 0, 0, 1},     // Dion ¼ square
    {768, 768, 768, 0, 0, 4},     // batched (4 × 768²)
    {2048, 2048, 2048, 0, 0, 1},  // the ceiling shape
    {64, 64, 64, 0, 0, 1},        // small
    {768, 1, 768, 0, 0, 1},       // matrix-vector
};
const std::vector<std::vector<int64_t>> kSymShapes = {
    {768, 768, 768, 0, 0, 1},     // Gram of 768², and A·A (A symmetric)
    {768, 768, 3072, 0, 0, 1},    // wide Y·Yᵀ
    {768, 768, 3072, 1, 0, 1},    // tall Yᵀ·Y (Y 3072×768)
    {1024, 1024, 1024, 0, 0, 1},  // orthogonalize_bench square
    {1024, 1024, 4096, 0, 0, 1},  // orthogonalize_bench wide
    {768, 768, 768, 0, 0, 4},     // batched
    {2048, 2048, 2048, 0, 0, 1},
};

// Registered shape by shape, OpenBLAS then oneDNN, so the two runs of a shape are adjacent in
// time (a machine shared with other work drifts between them less).
const bool kRegistered = [] {
  for (int mode : {0, 1}) {
    for (const auto& s : mode == 0 ? kGemmShapes : kSymShapes) {
      for (Fp32GemmEngine e : {Fp32GemmEngine::kOpenBlas, Fp32GemmEngine::kOneDnn}) {
        const std::string name = std::string(mode == 0 ? "BM_F32Gemm/" : "BM_F32Symmetric/") +
                                 (e == Fp32GemmEngine::kOpenBlas ? "openblas" : "onednn");
        std::vector<int64_t> args = s;
        args.push_back(2);  // threads
        benchmark::RegisterBenchmark(name.c_str(), BM_Engine, mode, e)
            ->Args(args)
            ->ArgNames({"m", "n", "k", "ta", "tb", "batch", "threads"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->MinTime(0.3);
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace diond::bench
