// Shared state of the benchmarks in one process: the GEMM ceilings measured first (registration
// order), read by the orthogonalization benchmarks to report a fraction of the ceiling of the same
// precision and thread count.
#ifndef DIOND_BENCH_BENCH_COMMON_H_
#define DIOND_BENCH_BENCH_COMMON_H_

#include <string>

namespace diond::bench {

// precision: "fp32" or "bf16". Records the best GFLOP/s seen for (precision, threads).
void RecordCeiling(const std::string& precision, int threads, double gflops);
// 0 when no ceiling was measured for that pair (e.g. a --benchmark_filter excluded it).
double Ceiling(const std::string& precision, int threads);

}  // namespace diond::bench

#endif  // DIOND_BENCH_BENCH_COMMON_H_
