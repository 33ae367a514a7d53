// The NCCL backend of Communicator: device buffers, through the CUDA plugin's C ABI
// (kernels/cuda/plugin_api.h, DiondNcclApiV1), so the daemon itself links no CUDA library.
// Rank 0 makes the NCCL unique id and publishes it in the world's KeyValueStore under the
// generation's prefix; the other ranks wait for it there.
//
// Collectives are synchronous on the communicator's own stream and bounded by `timeout`; a
// failure aborts the NCCL comm and this communicator (UNAVAILABLE). Bytes are counted with the
// ring formulas (NCCL does not report them). AllGatherV is padded to the largest block through a
// device staging buffer.
//
// Stream-ordered (plugin NCCL table version 2): OnStream(stream) gives a view whose collectives
// are queued on the caller's stream and return once queued (AllGatherV as one NCCL group of
// broadcasts, no padding). Their failures arrive asynchronously: Poll (the World's heartbeat)
// asks NCCL and aborts on an error, and Abort (a lost peer, the world breaking) aborts the NCCL
// comm, which ends the kernels still waiting on the stream. A view's collective after that fails
// at once; work that read the stream meanwhile read garbage, so the caller checks status() after
// its host read-backs (the session does after the exchange). A peer that heartbeats but never
// joins is caught by the read-back's bound: between BeginQueuedWait and EndQueuedWait, Poll
// aborts once `timeout` has passed, as a Gloo collective would time out.
//
// Thread-safety: thread-safe; collectives are serialized.
#ifndef DIOND_SERVER_COMM_NCCL_COMMUNICATOR_H_
#define DIOND_SERVER_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cuda/plugin_api.h"
#include "server/comm/communicator.h"
#include "server/comm/key_value_store.h"

namespace diond::comm {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;      // CUDA device index
  std::string prefix;  // the generation's key prefix
  absl::Duration timeout = absl::Seconds(10);
  CollectiveObserver observer;
};

class NcclCommunicator final : public Communicator {
 public:
  // FAILED_PRECONDITION if the plugin has no NCCL table; UNAVAILABLE if the id
  // exchange or NCCL's init fails or times out.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const DiondCudaPluginV1* plugin,
                                                                  KeyValueStore* kv,
                                                                  const NcclOptions& options);
  ~NcclCommunicator() override;

  MemorySpace memory() const override { return MemorySpace::kDevice; }
  absl::string_view backend() const override { return "nccl"; }

  absl::Status AllReduceSum(absl::Span<float> data) override;
  absl::Status AllReduceAverage(absl::Span<float> data) override;
  absl::Status ReduceScatterSum(absl::Span<const float> input, absl::Span<float> output) override;
  absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output) override;
  absl::Status AllGatherV(absl::Span<const float> input, absl::Span<const int64_t> counts,
                          absl::Span<float> output) override;
  absl::Status AllToAll(absl::Span<const float> input, absl::Span<float> output) override;
  absl::Status Broadcast(absl::Span<float> data, int root) override;
  absl::Status Barrier() override;
  absl::Status AllGatherBytes(absl::Span<const uint8_t> input, absl::Span<uint8_t> output) override;
  absl::Status BroadcastBytes(absl::Span<uint8_t> data, int root) override;

  absl::Status Poll() override;
  absl::StatusOr<std::unique_ptr<Communicator>> OnStream(void* stream) override;
  // A host wait for the queued collectives: Poll aborts past `timeout` after BeginQueuedWait.
  void BeginQueuedWait() override;
  void EndQueuedWait() override;

 protected:
  void OnAbort() override;

 private:
  class StreamView;
  NcclCommunicator(const NcclOptions& options, const DiondNcclApiV1* api);
  // Runs f(err) under the lock, aborting on failure; counts `bytes` when it succeeded.
  template <typename F>
  absl::Status Run(CollectiveOp op, int64_t bytes, const char* form, F&& f);
  // A synchronous call: f(timeout_ms, err).
  template <typename F>
  absl::Status Call(CollectiveOp op, int64_t bytes, F&& f);
  // A stream-ordered call: f(timeout_ms, err) queues it (the timeout bounds the enqueue only);
  // bytes are counted when it was queued.
  template <typename F>
  absl::Status Queue(CollectiveOp op, int64_t bytes, F&& f);
  // Once aborted: aborts and frees the NCCL comm (ending queued kernels) if not done yet.
  void DestroyCommIfAborted() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Device scratch of at least `bytes` (grown on demand).
  absl::StatusOr<void*> Scratch(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  NcclOptions options_;
  const DiondNcclApiV1* api_;
  void* comm_ = nullptr;
  absl::Mutex mu_;
  void* scratch_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t scratch_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // One float for the views' barriers (never reallocated: a queued barrier may still use it).
  void* barrier_ ABSL_GUARDED_BY(mu_) = nullptr;
  // When each open host wait for queued collectives (BeginQueuedWait) times out; an End retires
  // the earliest, so while any wait is open the earliest deadline left is at most its own. Its
  // own lock: Poll must see them while a collective holds mu_.
  absl::Mutex wait_mu_;
  std::multiset<absl::Time> wait_deadlines_ ABSL_GUARDED_BY(wait_mu_);
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_NCCL_COMMUNICATOR_H_
