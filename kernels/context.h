// Execution context of the ops API: which device (and so which backend table) runs an op, with
// how many threads, where its owned tensors and temporaries come from, and (for a future CUDA
// backend) which stream it is queued on.
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
//   * One thread drives ops at a time per process, and it is always the same thread. The
//     pools are process-wide, so two threads calling ops concurrently (with any contexts)
//     oversubscribe the cores. Taking turns is not enough either: libgomp keeps one pool per
//     calling thread, and once its pools' threads outnumber the cores every idle worker spins
//     only ~100 iterations before sleeping on a futex, so each parallel region pays a wake-up
//     (docs/TOOLCHAIN.md P22). The daemon runs all compute on one thread
//     (server/session/compute_thread.h); CpuParallelCallerThreads() below counts the threads.
//   * OpenBLAS's and libgomp's idle workers spin briefly after a region; the hot loops keep to
//     one engine per phase (orthogonalization in both precisions: oneDNN + OpenMP only, with
//     Fp32GemmEngine::kAuto's choice of oneDNN for its f32 GEMMs and symmetric products, except
//     matrices below ~128³ multiply-adds, which use OpenBLAS; bf16_reference's float32_gemm
//     engine: OpenBLAS GEMMs + OpenMP rounding passes) so the other pool's spinning workers do
//     not steal the cores for long.
//
// Thread-safety: a Context is not thread-safe (its scratch arena is mutable through a const
// Context). Use one Context per driving thread.
#ifndef DIOND_KERNELS_CONTEXT_H_
#define DIOND_KERNELS_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace diond::kernels {

// Opaque stream of a device backend (a cudaStream_t for the CUDA plugin). Null on the CPU.
using StreamHandle = void*;

// Which library computes fp32 GEMMs when both could (ops.h GemmParams::engine overrides).
enum class Fp32GemmEngine { kAuto, kOpenBlas, kOneDnn };

struct OpsBackend;  // kernels/backend.h

struct ContextOptions {
  Device device;        // needs a registered backend (kernels/backend.h)
  int num_threads = 0;  // <= 0: number of online cores (DefaultCpuThreads())
  size_t scratch_block_bytes = size_t{64} << 20;
  StreamHandle stream = nullptr;  // must be null for the CPU
  Fp32GemmEngine fp32_gemm = Fp32GemmEngine::kAuto;
};

// Counters of the memory a Context hands out (Context::Allocate and its scratch arena's blocks),
// shared with the Buffers it made so that they stay valid after the Context is gone.
struct AllocationStats {
  std::atomic<int64_t> allocations{0};   // successful allocations, ever
  std::atomic<int64_t> bytes_in_use{0};  // bytes allocated and not yet freed
};

// An owning, contiguous tensor in the memory of a backend's device, made by Context::Allocate.
// Move-only; frees its bytes through the same backend when destroyed or Reset. Its views carry
// the device, so ops check that they run on the right Context.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  TensorView view() { return TensorView(data_, layout_, device_); }
  ConstTensorView view() const { return ConstTensorView(data_, layout_, device_); }
  ConstTensorView cview() const { return ConstTensorView(data_, layout_, device_); }
  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* As() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* As() const {
    return static_cast<const T*>(data_);
  }
  const TensorLayout& layout() const { return layout_; }
  DType dtype() const { return layout_.dtype; }
  Device device() const { return device_; }
  int64_t NumElements() const { return layout_.NumElements(); }
  size_t bytes() const { return static_cast<size_t>(NumElements()) * DTypeSize(layout_.dtype); }
  bool empty() const { return data_ == nullptr; }
  // Frees the bytes (if any); the Buffer becomes empty.
  void Reset();

 private:
  friend class Allocator;
  const OpsBackend* backend_ = nullptr;
  std::shared_ptr<AllocationStats> stats_;
  Device device_;
  void* data_ = nullptr;
  size_t capacity_ = 0;  // bytes passed to the backend's allocate
  TensorLayout layout_;
};

// A copyable handle on a Context's allocator: it allocates Buffers with the same backend, device
// and counters as Context::Allocate, and stays valid after the Context is gone (objects that
// allocate later, e.g. GroupOptimizer::ReleaseState, keep one). Default-constructed: every
// Allocate fails with FAILED_PRECONDITION.
class Allocator {
 public:
  Allocator() = default;
  absl::StatusOr<Buffer> Allocate(DType dtype, const std::vector<int64_t>& shape) const;
  Device device() const { return device_; }

 private:
  friend class Context;
  const OpsBackend* backend_ = nullptr;
  Device device_;
  std::shared_ptr<AllocationStats> stats_;
};

class Context {
 public:
  // INVALID_ARGUMENT for a device without a registered backend (today: any but the CPU, unless
  // a test registered one), a non-null stream on the CPU, or num_threads > 1024.
  static absl::StatusOr<std::unique_ptr<Context>> Create(const ContextOptions& options = {});

  // A CPU context with default options; never fails. Convenient for tests and tools. Defined by
  // the CPU backend (kernels/cpu), so only code that links it can call it.
  static std::unique_ptr<Context> CpuDefault(int num_threads = 0);

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context();

  Device device() const { return options_.device; }
  int num_threads() const { return num_threads_; }
  StreamHandle stream() const { return options_.stream; }
  Fp32GemmEngine fp32_gemm_engine() const { return options_.fp32_gemm; }
  // Scratch memory for temporaries; ops rewind it to where it was before they return. Its blocks
  // come from the backend's allocator and count in allocation_count().
  ScratchArena& scratch() const { return *scratch_; }
  // The backend table of device() (kernels/backend.h); ops dispatch through it.
  const OpsBackend& backend() const { return *backend_; }

  // An uninitialized contiguous tensor of `shape` (0..3 dims, each >= 0) on device(), from the
  // backend's allocator. INVALID_ARGUMENT for a bad shape, RESOURCE_EXHAUSTED when the device is
  // out of memory (naming the bytes). Zeros: the same, then every byte zero.
  absl::StatusOr<Buffer> Allocate(DType dtype, const std::vector<int64_t>& shape) const;
  absl::StatusOr<Buffer> Zeros(DType dtype, const std::vector<int64_t>& shape) const;
  // A handle that allocates like Allocate (same backend, device and counters).
  Allocator allocator() const;

  // Allocations made through this Context (Allocate, Zeros, scratch blocks) since it was created,
  // and the bytes of those still alive. A step that allocates nothing leaves the first unchanged.
  int64_t allocation_count() const { return stats_->allocations.load(); }
  int64_t bytes_in_use() const { return stats_->bytes_in_use.load(); }

  // Changes the thread count used by later ops (<= 0: number of cores).
  void SetNumThreads(int num_threads);

  // kernels/graph.h only: routes this context's ops through `table` (its recording table) until
  // called again with nullptr, which restores the device's registered table. Buffers allocated
  // meanwhile are freed through the registered table.
  void InterposeBackend(const OpsBackend* table);

 private:
  Context(const ContextOptions& options, const OpsBackend* backend);
  static void* ArenaAllocate(void* user, size_t bytes);
  static void ArenaDeallocate(void* user, void* p, size_t bytes);
  ContextOptions options_;
  const OpsBackend* backend_;
  const OpsBackend* registered_;  // backend_ unless a table is interposed
  int num_threads_ = 1;
  std::shared_ptr<AllocationStats> stats_;
  std::unique_ptr<ScratchArena> scratch_;
};

// How many distinct threads of this process have run a CPU op with a thread count above one
// (each such thread owns an OpenMP pool; see THREADING POLICY). Monotonic; the daemon expects 1
// (its compute thread) and warns otherwise.
int CpuParallelCallerThreads();
// Counts the calling thread for CpuParallelCallerThreads, once (the CPU backend calls it on
// entry of every op whose thread count is above one).
void NoteCpuParallelCaller();

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_CONTEXT_H_
