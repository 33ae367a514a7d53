// Execution context of the ops API: which device runs an op, with how many threads, where its
// temporaries come from, and (for a future CUDA backend) which stream it is queued on.
//
// Every op takes `const Context&` explicitly; there is no global "current device".
//
// THREADING POLICY (the one policy of the CPU backend; ARCHITECTURE.md §3, TOOLCHAIN.md §5/§12):
//   * A Context has one thread count T (default: number of online cores).
//   * The CPU backend has exactly two thread pools, both sized T: OpenBLAS's pthread pool
//     (openblas_set_num_threads) and the OpenMP pool (omp_set_num_threads), which oneDNN and our
//     own elementwise/reduction loops share. We create no other threads.
//   * Every op applies T on entry (ScopedThreadPolicy in kernels/cpu/threading.h; cheap when
//     unchanged) and runs to completion on the calling thread before returning, so at any
//     moment at most one pool is busy: an op runs a BLAS call OR an OpenMP/oneDNN region, never
//     both, and never nests one inside the other (no BLAS call inside an OpenMP region).
//   * Batched ops loop over matrices sequentially, each matrix using all T threads; they never
//     run matrices concurrently on separate threads (that would multiply T).
//   * One thread drives ops at a time per process. The pools are process-wide, so two threads
//     calling ops concurrently (with any contexts) oversubscribe the cores; the daemon's step
//     pipeline serializes compute on one thread.
//   * OpenBLAS's and libgomp's idle workers spin briefly after a region; the hot loops keep to
//     one engine per phase (fp32 orthogonalization: OpenBLAS only; bf16: oneDNN + OpenMP only)
//     so the other pool's spinning workers do not steal the cores.
//
// Thread-safety: a Context is not thread-safe (its scratch arena is mutable through a const
// Context). Use one Context per driving thread.
#ifndef DIOND_KERNELS_CONTEXT_H_
#define DIOND_KERNELS_CONTEXT_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace diond::kernels {

// Opaque stream of a device backend (a cudaStream_t for the CUDA plugin). Null on the CPU.
using StreamHandle = void*;

// Which library computes fp32 GEMMs when both could (ops.h GemmParams::engine overrides).
enum class Fp32GemmEngine { kAuto, kOpenBlas, kOneDnn };

struct ContextOptions {
  Device device;                 // only kCpu is implemented
  int num_threads = 0;           // <= 0: number of online cores (DefaultCpuThreads())
  size_t scratch_block_bytes = size_t{64} << 20;
  StreamHandle stream = nullptr; // must be null for the CPU
  Fp32GemmEngine fp32_gemm = Fp32GemmEngine::kAuto;
};

class Context {
 public:
  // INVALID_ARGUMENT for a non-CPU device, a non-null stream on the CPU, or num_threads > 1024.
  static absl::StatusOr<std::unique_ptr<Context>> Create(const ContextOptions& options = {});

  // A CPU context with default options; never fails. Convenient for tests and tools.
  static std::unique_ptr<Context> CpuDefault(int num_threads = 0);

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const { return options_.device; }
  int num_threads() const { return num_threads_; }
  StreamHandle stream() const { return options_.stream; }
  Fp32GemmEngine fp32_gemm_engine() const { return options_.fp32_gemm; }
  // Scratch memory for temporaries; ops rewind it to where it was before they return.
  ScratchArena& scratch() const { return *scratch_; }

  // Changes the thread count used by later ops (<= 0: number of cores).
  void SetNumThreads(int num_threads);

 private:
  explicit Context(const ContextOptions& options);
  ContextOptions options_;
  int num_threads_ = 1;
  std::unique_ptr<ScratchArena> scratch_;
};

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_CONTEXT_H_
