// Dion's orthonormalizations (kernels/ops.h ThinQr, CholeskyQr, RandomizedCholeskyQr) on the
// GPT-2-small shapes of Dion rank 1 (P: 768×768 square, 3072×768 tall) and rank ¼ (3072×192,
// 768×192), with the sketch size Dion uses (128·⌈1.25·r/128⌉ rows). GFLOP/s counts a nominal
// cost, so that rows of one op compare across builds: ThinQr 4mn² − 4n³/3 (geqrf + orgqr),
// CholeskyQr 2mn² (Gram, half of it, + the triangular solve), RandomizedCholeskyQr 2smn + 2mn²
// + CholeskyQr's.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/context.h"
#include "kernels/ops.h"

namespace diond::bench {
namespace {

enum class Factorization { kThinQr, kCholeskyQr, kRandomizedCholeskyQr };

void BM_Factorize(benchmark::State& state, Factorization f) {
  const int64_t m = state.range(0), n = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const int64_t s =
      128 * ((static_cast<int64_t>(std::ceil(1.25 * static_cast<double>(n))) + 127) / 128);
  kernels::ContextOptions copts;
  copts.num_threads = threads;
  auto ctx_or = kernels::Context::Create(copts);
  if (!ctx_or.ok()) {
    state.SkipWithError(std::string(ctx_or.status().message()).c_str());
    return;
  }
  const kernels::Context& ctx = **ctx_or;
  std::mt19937 rng(7);
  std::normal_distribution<float> d;
  std::vector<float> a(m * n), q(m * n), sketch(s * m);
  for (float& x : a) x = d(rng);
  for (float& x : sketch) x = d(rng) / std::sqrt(static_cast<float>(s));
  const auto av = kernels::MakeView(a.data(), {m, n});
  const auto qv = kernels::MakeView(q.data(), {m, n});
  const auto sv = kernels::MakeView(sketch.data(), {s, m});
  for (auto _ : state) {
    absl::Status st;
    switch (f) {
      case Factorization::kThinQr:
        st = kernels::ThinQr(ctx, av, qv);
        break;
      case Factorization::kCholeskyQr:
        st = kernels::CholeskyQr(ctx, av, qv);
        break;
      case Factorization::kRandomizedCholeskyQr:
        st = kernels::RandomizedCholeskyQr(ctx, av, sv, qv);
        break;
    }
    if (!st.ok()) {
      state.SkipWithError(std::string(st.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(q.data());
  }
  const double md = static_cast<double>(m), nd = static_cast<double>(n),
               sd = static_cast<double>(s);
  double flop = 0.0;
  switch (f) {
    case Factorization::kThinQr:
      flop = 4.0 * md * nd * nd - 4.0 * nd * nd * nd / 3.0;
      break;
    case Factorization::kCholeskyQr:
      flop = 2.0 * md * nd * nd;
      break;
    case Factorization::kRandomizedCholeskyQr:
      flop = 2.0 * sd * md * nd + 4.0 * md * nd * nd;
      break;
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      flop, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["GFLOP/s"].value /= 1e9;
}

void SquareShapes(benchmark::internal::Benchmark* b) {
  b->Args({768, 768, 2})->Args({192, 192, 2});
  b->ArgNames({"m", "n", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.5);
}
void TallShapes(benchmark::internal::Benchmark* b) {
  b->Args({3072, 768, 2})->Args({3072, 192, 2})->Args({768, 192, 2});
  b->ArgNames({"m", "n", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.5);
}

BENCHMARK_CAPTURE(BM_Factorize, ThinQr, Factorization::kThinQr)->Apply(SquareShapes);
BENCHMARK_CAPTURE(BM_Factorize, CholeskyQr, Factorization::kCholeskyQr)->Apply(TallShapes);
BENCHMARK_CAPTURE(BM_Factorize, RandomizedCholeskyQr, Factorization::kRandomizedCholeskyQr)
    ->Apply(TallShapes);

}  // namespace
}  // namespace diond::bench
