#include "kernels/cpu/threading.h"

#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <atomic>

namespace diond::kernels::cpu {

int OnlineCores() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void ApplyThreadPolicy(const Context& ctx) {
  // openblas_set_num_threads is process-wide and not free (it may spawn or park workers), so it
  // is called only when the requested value changes.
  static std::atomic<int> blas_threads{-1};
  const int t = ctx.num_threads();
  if (t > 1) NoteCpuParallelCaller();
  if (blas_threads.load(std::memory_order_relaxed) != t) {
    openblas_set_num_threads(t);
    blas_threads.store(t, std::memory_order_relaxed);
  }
  // An OpenMP ICV of the calling thread; oneDNN reads it at every primitive execution.
  if (omp_get_max_threads() != t) omp_set_num_threads(t);
}

}  // namespace diond::kernels::cpu
