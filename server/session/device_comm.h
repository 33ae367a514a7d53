// The collectives of one device session's step, on the session's device memory
// (docs/DISTRIBUTED.md "On device daemons"). The world phases of a device session
// (session_world.cc) pack, exchange and unpack in device buffers through this one Communicator,
// whatever carries the bytes:
//
// - a device communicator of the world (NCCL on a GPU daemon, comm::MemorySpace::kDevice) that
//   can queue on a stream (Communicator::OnStream; NCCL with plugin ABI 2.1): each collective is
//   queued on the session's stream behind the work that produced its input, with no host wait;
//   a failure shows later, in DeviceStatus (the session checks it after its read-backs);
// - a device communicator that cannot: the session's stream is synchronized first (the data was
//   produced there; the communicator runs on its own stream), then the call is forwarded with
//   the same device pointers;
// - otherwise the world's host communicator (Gloo), staged: the inputs are copied device -> host
//   through the session's Context, the host collective runs, and the outputs are copied back
//   host -> device. Each staged call therefore has two sync points and one host buffer.
//
// Either way the numbers are the host collective's: the sums run in the same order (NCCL's ring
// order may differ from Gloo's; bit-identity between a GPU world and a CPU world is promised only
// for the staged path).
//
// The wrapper sends nothing itself: the bytes sent are counted on the underlying communicators
// (the session adds both). Copies run on the session's compute thread (ComputeThread::Call runs
// nested calls inline, so the rules may call this from inside an update, e.g. compressed Dion's
// replica average). The byte variants stage like the float ones.
//
// Thread-safety: one step's; not shared between threads.
#ifndef DIOND_SERVER_SESSION_DEVICE_COMM_H_
#define DIOND_SERVER_SESSION_DEVICE_COMM_H_

#include <functional>
#include <memory>
#include <vector>

#include "kernels/context.h"
#include "server/comm/communicator.h"
#include "server/session/compute_thread.h"

namespace diond::session {

class StepDeviceComm final : public comm::Communicator {
 public:
  // `host` must be set (the world's host communicator); `device` may be null (no device
  // collectives in this world: stage through `host`). `ctx` is the session's device Context;
  // `compute` its compute thread (null: the calling thread).
  StepDeviceComm(const kernels::Context* ctx, ComputeThread* compute,
                 std::shared_ptr<comm::Communicator> host,
                 std::shared_ptr<comm::Communicator> device);

  comm::MemorySpace memory() const override { return comm::MemorySpace::kDevice; }
  // The underlying one's name, with "+staged" when the bytes cross through host buffers.
  absl::string_view backend() const override { return backend_name_; }
  bool staged() const { return device_ == nullptr; }
  // Whether the collectives are queued on the session's stream (no host wait each).
  bool queued() const { return queued_ != nullptr; }
  // The device communicator's health (Communicator::Poll; OK when staged). Queued collectives
  // fail asynchronously: after reading back what they produced, check this before trusting it.
  absl::Status DeviceStatus();
  // Runs f (a host read-back of what queued collectives produced) on the compute thread as a
  // bounded wait: past the device communicator's timeout (--peer_timeout) the World's heartbeat
  // aborts it, which ends the collectives and so the wait (Communicator::BeginQueuedWait). The
  // bound starts when f starts, not while the step waits for the compute thread behind other
  // sessions' work. Never an unbounded wait of the compute thread on a remote peer.
  absl::Status ReadBackQueued(const std::function<absl::Status()>& f);
  // After collectives queued on the session's stream whose results the host reads later, at a
  // wait that is not a read-back of this class (a sync point inside the rules, the step's final
  // wait): waits for the stream now as ReadBackQueued does, then returns DeviceStatus(), so the
  // wait behind them is bounded and their failure is known before their results are used. OK at
  // once when nothing was queued (staged or forwarded collectives wait where they run).
  absl::Status WaitQueued();
  // Compressed Dion's replica average on device memory (StepOptions::replica_average): the
  // all-reduce average, then WaitQueued (Dion reads P back right after, on the compute thread).
  absl::Status ReplicaAverage(absl::Span<float> data);

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

 private:
  // Waits for the session's stream.
  absl::Status SyncSession();
  // The communicator the device path calls (the queued view, else the device communicator);
  // null when staged.
  comm::Communicator* Direct() const;
  // What the device path does before a call: nothing when queued, else SyncSession().
  absl::Status BeforeDirect();
  // Device <-> host copies of `bytes` bytes through the session's Context, on its compute thread.
  absl::Status ToHost(const void* device, void* host, size_t bytes);
  absl::Status ToDevice(const void* host, void* device, size_t bytes);
  // The staged form of a collective reading `in` (in_bytes) and writing `out` (out_bytes):
  // copies `in` down, runs f(host_in, host_out), copies `out` up.
  template <typename F>
  absl::Status Staged(const void* in, size_t in_bytes, void* out, size_t out_bytes, F&& f);

  const kernels::Context* ctx_;
  ComputeThread* compute_;
  std::shared_ptr<comm::Communicator> host_;
  std::shared_ptr<comm::Communicator> device_;
  std::unique_ptr<comm::Communicator> queued_;  // device_->OnStream(session stream), or null
  std::string backend_name_;
  // Reused host staging (grown on demand; per step, so not a per-call allocation in a loop).
  std::vector<uint8_t> in_, out_;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_DEVICE_COMM_H_
