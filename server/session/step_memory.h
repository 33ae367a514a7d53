// Where one Step's tensors lie, and the passes of the step that depend on it
// (docs/ARCHITECTURE.md §2; docs/GPU.md "Device sessions"). The step's phases (session_step.cc)
// are written once over this interface; it has two implementations:
//   - Session::HostMemory (step_memory_host.cc): the trainer's arenas read and written in place,
//     other dtypes and master weights through the session's fp32 buffers;
//   - Session::DeviceSide (session_device.h): a device session's staging on its device, filled
//     and drained by queued copies on its stream, its phases captured as graphs where they can
//     be. Of the step's passes, only these reach the device runtime (kernels/device_runtime.h).
//
// Internal to the session's implementation: included only by server/session/session*.cc and
// step_memory_host.cc. Every method runs under the session's mutex (on the compute thread where
// it computes) and takes the session it belongs to.
#ifndef DIOND_SERVER_SESSION_STEP_MEMORY_H_
#define DIOND_SERVER_SESSION_STEP_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/context.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"
#include "server/session/world_exchange.h"

namespace diond::session {

class Session::StepMemory {
 public:
  virtual ~StepMemory() = default;
  // The context the update rules run on (and the state lives on) for a step on `ctx`.
  virtual const kernels::Context& UpdateContext(Session& s, const kernels::Context& ctx) = 0;
  // Before the phases: from the second step on, which phases run as captured graphs.
  virtual void PrepareStep(Session& s, StepRun& run) = 0;
  // Phase 1: the request's ready_event / done_event checked and opened (docs/DATA_PLANE.md "The
  // event protocol"); FAILED_PRECONDITION where the memory has no stream to order.
  virtual absl::Status PrepareEvents(Session& s, const StepRequest& request) = 0;
  // Once the new weights are written (or a step skipped): the session stream records done_event.
  virtual absl::Status RecordDoneEvent(Session& s, const StepRequest& request) = 0;
  // Phase 3: every gradient as fp32 (run.grads) and the finiteness scan (run.finite); then the
  // GRADIENTS region's check.
  virtual absl::Status ReadGradients(Session& s, StepRun& run) = 0;
  // Phase 2 (world): the step's collectives in this memory, given the world's device
  // communicator (null: none; NCCL where the world has one).
  virtual void JoinWorld(Session& s, StepRun& run,
                         std::shared_ptr<comm::Communicator> device_comm) = 0;
  // Phase 4 (world AVERAGE), or one bucket of an overlapped step: the gradients of of[j], rank
  // j's parameters, reduce-scattered to their owners in blocks of `block` floats per rank (those
  // gradients, padded, then this rank's `flags`; a null run.grads[i] counts as zeros) and
  // averaged: run.grads of this rank's of[rank] (null for a parameter no rank has), in memory
  // that lasts the step; `summed`: the flags summed over the world. A failed collective breaks
  // the world session.
  virtual absl::Status ReduceGradients(Session& s, StepRun& run,
                                       const std::vector<std::vector<size_t>>& of, int64_t block,
                                       const std::vector<float>& flags,
                                       std::vector<float>* summed) = 0;
  // Phase 6: every parameter as fp32 (run.params; run.via_scratch where it is a copy).
  virtual absl::Status ReadParameters(Session& s, StepRun& run) = 0;
  // Phase 7: every group's update staged (Session::StageGroups); nothing changes yet.
  virtual absl::Status Stage(Session& s, StepRun& run, const kernels::Context& ctx) = 0;
  // Whether Stage also wrote the new weights (phase 8): a local device session's, in one graph.
  virtual bool StageWritesWeights(const Session& s) const = 0;
  // Phase 10, after the exchange: the new weights into the trainer's arena (narrowed where they
  // were read through a copy).
  virtual absl::Status WriteWeights(Session& s, StepRun& run) = 0;
  // Phase 9 (world): the exchange's buffers of `mine` and `total` floats (world_exchange.h).
  virtual absl::StatusOr<std::unique_ptr<ExchangeWire>> MakeExchangeWire(Session& s, StepRun& run,
                                                                         int64_t mine,
                                                                         int64_t total) = 0;
  // Phase 11: parameter i's updated copy becomes its master weights.
  virtual void CommitMaster(Session& s, size_t i) = 0;
  // A successful step's result carried the graph fallbacks (later steps carry none).
  virtual void FallbacksReported() = 0;

  // ---- an overlapped step's passes (session_overlap.cc), bucket by bucket ----
  // Before the first bucket: what ReadGradients sets up (run.grads sized, run.finite true).
  virtual void BeginBuckets(Session& s, StepRun& run) = 0;
  // Bucket k's gradients, `params`: ReadGradients of those only (run.finite and'ed), read once
  // the trainer's ready event of the bucket completed where the page has events; then the
  // GRADIENTS region's check.
  virtual absl::Status ReadGradientsOf(Session& s, StepRun& run, size_t k,
                                       const std::vector<size_t>& params) = 0;
  // Bucket k's new weights, `params`, in the trainer's memory on return (WriteWeights of those
  // only); where the page has events, its done event recorded after them.
  virtual absl::Status WriteWeightsOf(Session& s, StepRun& run, size_t k,
                                      const std::vector<size_t>& params) = 0;
  // A skipped step: every bucket's done event recorded (the weights are as they were).
  virtual absl::Status RecordBucketsDone(Session& s) = 0;
};

// A host session's memory: the trainer's shm / memfd arenas or the daemon's host arenas.
struct Session::HostMemory final : Session::StepMemory {
  const kernels::Context& UpdateContext(Session& s, const kernels::Context& ctx) override;
  void PrepareStep(Session& s, StepRun& run) override {}
  absl::Status PrepareEvents(Session& s, const StepRequest& request) override;
  absl::Status RecordDoneEvent(Session& s, const StepRequest& request) override {
    return absl::OkStatus();
  }
  absl::Status ReadGradients(Session& s, StepRun& run) override;
  void BeginBuckets(Session& s, StepRun& run) override;
  absl::Status ReadGradientsOf(Session& s, StepRun& run, size_t k,
                               const std::vector<size_t>& params) override;
  // Parameter i's gradient as fp32 into run.grads[i], scanned while run.finite.
  absl::Status ReadGradient(Session& s, StepRun& run, size_t i);
  absl::Status ReduceGradients(Session& s, StepRun& run, const std::vector<std::vector<size_t>>& of,
                               int64_t block, const std::vector<float>& flags,
                               std::vector<float>* summed) override;
  void JoinWorld(Session& s, StepRun& run,
                 std::shared_ptr<comm::Communicator> device_comm) override {}
  absl::StatusOr<std::unique_ptr<ExchangeWire>> MakeExchangeWire(Session& s, StepRun& run,
                                                                 int64_t mine,
                                                                 int64_t total) override;
  absl::Status ReadParameters(Session& s, StepRun& run) override;
  absl::Status Stage(Session& s, StepRun& run, const kernels::Context& ctx) override;
  bool StageWritesWeights(const Session& s) const override { return false; }
  absl::Status WriteWeights(Session& s, StepRun& run) override;
  absl::Status WriteWeightsOf(Session& s, StepRun& run, size_t k,
                              const std::vector<size_t>& params) override;
  absl::Status RecordBucketsDone(Session& s) override { return absl::OkStatus(); }
  void CommitMaster(Session& s, size_t i) override;
  void FallbacksReported() override {}
};

namespace internal {

// INVALID_ARGUMENT unless each of the request's event handles is empty or 64 bytes.
absl::Status CheckEventHandles(const StepRequest& request);
// FAILED_PRECONDITION: the events need a device session's stream, and this session `how`.
absl::Status RefuseEvents(const StepRequest& request, absl::string_view how);

}  // namespace internal

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_STEP_MEMORY_H_
