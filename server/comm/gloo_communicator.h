// The Gloo backend of Communicator: host buffers over Gloo's TCP transport (TOOLCHAIN.md §4).
//
// Performance rules of this Debian Gloo build (TOOLCHAIN.md P10-P13):
// - Gloo's options API and per-call algorithm construction are 10-100x slower than reusing a
//   legacy algorithm object bound to persistent buffers. So every collective copies into
//   persistent staging buffers owned by a cached algorithm object (one per op and size, a few per
//   op, least recently used evicted; every rank evicts alike because every rank makes the same
//   calls). The copies cost far less than the transfer.
// - all-reduce: AllreduceRingChunked (ring, 2(W-1)/W*x). Never BCUBE.
// - reduce-scatter: ReduceScatterHalvingDoubling when W is a power of two (result at the START
//   of the buffer); otherwise a pairwise exchange of blocks plus a local sum, which has the same
//   (W-1)/W*x volume for any W.
// - all-gather and all-to-all: a pairwise exchange on bound buffers with clear-to-send
//   notifications (the pattern of Gloo's BroadcastOneToAll), (W-1)/W*x; variable all-gather
//   blocks are padded to the largest block. Not gloo::AllgatherRing: it writes a peer's next
//   call straight into the cached output buffer, which a slower rank may not have copied out
//   yet (a world step then applies a peer's next update).
// - broadcast: BroadcastOneToAll; barrier: BarrierAllToAll.
// Every Gloo exception becomes UNAVAILABLE naming the peer's rank when the message names its
// address, and aborts the communicator. Gloo counts elements in int: one call moves < 2 GiB.
//
// Thread-safety: thread-safe; collectives are serialized.
#ifndef DIOND_SERVER_COMM_GLOO_COMMUNICATOR_H_
#define DIOND_SERVER_COMM_GLOO_COMMUNICATOR_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/comm/communicator.h"
#include "server/comm/key_value_store.h"

namespace gloo {
class Context;
}

namespace diond::comm {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Host name or IP the TCP device binds and advertises (--peer_listen); "" = first interface.
  std::string hostname = "127.0.0.1";
  // Rendezvous key prefix; unique per world generation (GenerationPrefix).
  std::string prefix;
  // Bounds the rendezvous and every transfer (--peer_timeout).
  absl::Duration timeout = absl::Seconds(10);
  CollectiveObserver observer;
  int cache_entries_per_op = 4;
  // Tests only: runs on this rank after a collective's transfer and before its result is copied
  // out of the cached buffers (makes this rank the slow one, deterministically).
  std::function<void(CollectiveOp)> after_transfer_for_testing;
};

class GlooCommunicator final : public Communicator {
 public:
  // Connects a full mesh through `kv` (which must outlive this call only). UNAVAILABLE when a
  // peer does not arrive within the timeout.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(KeyValueStore* kv,
                                                                  const GlooOptions& options);
  ~GlooCommunicator() override;

  MemorySpace memory() const override { return MemorySpace::kHost; }
  absl::string_view backend() const override { return "gloo"; }

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

  struct Impl;

 private:
  GlooCommunicator(int rank, int size, CollectiveObserver observer);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_GLOO_COMMUNICATOR_H_
