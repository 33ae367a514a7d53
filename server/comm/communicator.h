// Collectives between the workers of a world (ARCHITECTURE.md §6): the interface the session
// layer uses, whatever the backend. GlooCommunicator (gloo_communicator.h) works on host memory
// over TCP; NcclCommunicator (nccl_communicator.h) on device memory through the CUDA plugin.
//
// Contract shared by every backend:
// - Every rank calls the same collectives in the same order with the same sizes (MPI rules).
// - Buffers are host memory for memory() == kHost and device memory for kDevice.
// - Errors: INVALID_ARGUMENT for mismatched sizes (checked before anything is sent);
//   UNAVAILABLE when a peer is lost or the communicator was aborted, naming the rank when known.
//   After UNAVAILABLE the communicator is aborted: every later call fails at once, and outputs
//   are unspecified. A new generation of the World brings a new communicator.
// - Byte accounting: each call adds the bytes this rank sends to bytes_sent() (ring volumes of
//   ALGORITHMS.md §15: all-reduce 2(W-1)/W*x, all-gather / reduce-scatter / all-to-all
//   (W-1)/W*x for x = the full-size buffer), and reports (op, bytes, seconds) to the observer.
//
// Thread-safety: calls are serialized internally; one collective runs at a time.
#ifndef DIOND_SERVER_COMM_COMMUNICATOR_H_
#define DIOND_SERVER_COMM_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace diond::comm {

enum class CollectiveOp {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kAllGatherV,
  kAllToAll,
  kBroadcast,
  kBarrier,
};
// "all_reduce", "reduce_scatter", ... (the metric label).
absl::string_view CollectiveOpName(CollectiveOp op);

// Receives every finished collective: op, bytes this rank sent, wall time, and the result.
using CollectiveObserver =
    std::function<void(CollectiveOp op, int64_t bytes_sent, double seconds, const absl::Status&)>;

enum class MemorySpace { kHost, kDevice };

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual MemorySpace memory() const = 0;
  // "gloo" or "nccl".
  virtual absl::string_view backend() const = 0;

  // data <- sum over ranks of data, in place.
  virtual absl::Status AllReduceSum(absl::Span<float> data) = 0;
  // data <- mean over ranks (sum, then scale by 1/W).
  virtual absl::Status AllReduceAverage(absl::Span<float> data) = 0;
  // input holds W equal blocks (input.size() == W * output.size()); output <- sum over ranks of
  // block rank().
  virtual absl::Status ReduceScatterSum(absl::Span<const float> input,
                                        absl::Span<float> output) = 0;
  // output (W * input.size()) <- every rank's input, rank j's at j * input.size().
  virtual absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output) = 0;
  // Variable blocks: rank j contributes counts[j] elements (input.size() == counts[rank()]),
  // output (sum of counts) holds them in rank order.
  virtual absl::Status AllGatherV(absl::Span<const float> input, absl::Span<const int64_t> counts,
                                  absl::Span<float> output) = 0;
  // input and output hold W equal blocks; output block j <- rank j's input block rank().
  virtual absl::Status AllToAll(absl::Span<const float> input, absl::Span<float> output) = 0;
  // data <- root's data.
  virtual absl::Status Broadcast(absl::Span<float> data, int root) = 0;
  virtual absl::Status Barrier() = 0;
  // Raw-byte variants (index lists, metadata); same semantics as the float ones.
  virtual absl::Status AllGatherBytes(absl::Span<const uint8_t> input,
                                      absl::Span<uint8_t> output) = 0;
  virtual absl::Status BroadcastBytes(absl::Span<uint8_t> data, int root) = 0;

  // Marks the communicator dead: later calls fail with UNAVAILABLE and `why`. In-flight calls
  // fail when their peers go (bounded by the timeout the communicator was built with); a backend
  // with collectives queued on device streams ends them here (OnAbort).
  void Abort(const absl::Status& why);
  // OK while usable; the abort reason afterwards.
  absl::Status status() const;
  // Checks the health without blocking; the World calls it at every heartbeat. A backend whose
  // collectives fail asynchronously (NCCL, queued on a stream) aborts itself here when one did.
  // Returns status() afterwards.
  virtual absl::Status Poll() { return status(); }

  // Device communicators that can queue on a caller's stream (docs/GPU.md "World sessions"): a
  // Communicator on the same connection whose collectives are queued on `stream` (an opaque
  // device stream, kernels::StreamHandle) behind the work queued there and return once queued,
  // with no host wait. A peer that never comes is ended by Poll / Abort of this communicator.
  // The view counts its bytes here, fails once this one is aborted, and must not outlive it.
  // UNIMPLEMENTED by default (host communicators; NCCL tables without stream-ordered calls).
  virtual absl::StatusOr<std::unique_ptr<Communicator>> OnStream(void* stream);
  // The caller's host is about to wait for this communicator's queued collectives (it reads
  // back what they produced), and is done waiting. In between, a backend with queued
  // collectives bounds the wait as a host collective is bounded: past its timeout (the world's
  // --peer_timeout) Poll aborts it, which ends the waiting kernels; that catches a peer that
  // heartbeats but never joins (its trainer is late). Waits may overlap (each Begin has its
  // End): every one stays bounded until its End. Call Begin right before the wait itself, not
  // before queueing behind other work for the thread that waits (that time would count).
  // Nothing to bound by default.
  virtual void BeginQueuedWait() {}
  virtual void EndQueuedWait() {}

  // Bytes this rank has sent since creation or the last TakeBytesSent().
  int64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Returns bytes_sent() and resets it to zero (per-step accounting).
  int64_t TakeBytesSent() { return bytes_sent_.exchange(0, std::memory_order_relaxed); }

 protected:
  Communicator(int rank, int size, CollectiveObserver observer)
      : rank_(rank), size_(size), observer_(std::move(observer)) {}
  // Checks AllGatherV's arguments against this communicator (one count per rank, none
  // negative, input.size() == counts[rank()], output.size() == their sum); on success stores
  // the largest count. INVALID_ARGUMENT naming the sizes otherwise.
  absl::Status CheckAllGatherV(absl::Span<const float> input, absl::Span<const int64_t> counts,
                               absl::Span<float> output, int64_t* largest) const;
  // Called by backends after every collective.
  void Record(CollectiveOp op, int64_t bytes, double seconds, const absl::Status& result);
  // Called once, by the first Abort, outside any lock of this class.
  virtual void OnAbort() {}

 private:
  const int rank_;
  const int size_;
  CollectiveObserver observer_;
  std::atomic<int64_t> bytes_sent_{0};
  mutable absl::Mutex abort_mu_;
  absl::Status aborted_ ABSL_GUARDED_BY(abort_mu_);
};

// Bytes one rank sends in the ring algorithms, for x bytes of full-size data over W ranks
// (ALGORITHMS.md §15). Used by tests and by backends whose engine does not report bytes.
int64_t RingAllReduceBytes(int64_t x, int w);
int64_t RingAllGatherBytes(int64_t x, int w);  // also reduce-scatter and all-to-all

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_COMMUNICATOR_H_
