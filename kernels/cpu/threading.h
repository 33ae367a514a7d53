// The CPU backend's threading policy in code (the policy itself is documented in
// kernels/context.h): every op calls ApplyThreadPolicy(ctx) on entry.
#ifndef DIOND_KERNELS_CPU_THREADING_H_
#define DIOND_KERNELS_CPU_THREADING_H_

#include "kernels/context.h"

namespace diond::kernels::cpu {

// Sizes OpenBLAS's pthread pool and the calling thread's OpenMP pool (shared with oneDNN) to
// ctx.num_threads(). Cheap when nothing changes (the OpenBLAS value is cached process-wide).
void ApplyThreadPolicy(const Context& ctx);

// Number of online cores (>= 1).
int OnlineCores();

// OpenMP loops below this many elements run on the calling thread: forking the team costs more
// than the work (a few µs against ~1 ns per element).
inline constexpr int64_t kParallelGrain = int64_t{1} << 15;

}  // namespace diond::kernels::cpu

#endif  // DIOND_KERNELS_CPU_THREADING_H_
