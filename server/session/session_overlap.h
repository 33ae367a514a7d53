// The overlapped step's phases (docs/DATA_PLANE.md "Overlapped step"; session_overlap.cc): an
// asynchronous Step staged bucket by bucket as the trainer's doorbells ring.
//
// Internal to the session's implementation: included only by server/session/session*.cc. Every
// function takes the session it works on; the step's run under its mutex (the wait for a
// doorbell releases it).
#ifndef DIOND_SERVER_SESSION_SESSION_OVERLAP_H_
#define DIOND_SERVER_SESSION_SESSION_OVERLAP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "kernels/context.h"
#include "server/memory/shm_region.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace diond::session {

struct Session::Overlap {
  // Binds the doorbell page `open` maps, with its buckets (RegisterShmDoorbells and
  // RegisterMemfdDoorbells' common part).
  static absl::StatusOr<std::string> RegisterDoorbells(
      Session& self, const std::string& name, int64_t offset, int64_t size,
      const std::vector<DoorbellBucket>& buckets,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<memory::ShmRegion>>()> open);
  // The buckets as parameter indices, each parameter in exactly one (INVALID_ARGUMENT naming the
  // first that is not).
  static absl::StatusOr<std::vector<std::vector<size_t>>> CheckBuckets(
      const Session& self, const std::vector<DoorbellBucket>& buckets);
  // The buckets' event handles (session_overlap_device.cc): every bucket with both or none
  // (INVALID_ARGUMENT naming the first that differs, or a handle not 64 bytes), and only on a
  // device session with a stream (FAILED_PRECONDITION).
  static absl::Status CheckBucketEvents(const Session& self,
                                        const std::vector<DoorbellBucket>& buckets);
  // A device session's: the checked events opened (DeviceSide::OpenBucketEvents); else nothing.
  static absl::Status OpenBucketEvents(Session& self, const std::vector<DoorbellBucket>& buckets);
  // Phase 1 of StepRequest.overlap: its preconditions (asynchronous, a doorbell page, no
  // ready_event / done_event of its own).
  static absl::Status ValidateOverlapLocked(Session& self, const StepRequest& request);
  // The step's phases bucket by bucket as the doorbells ring, then FinishStepLocked, which rings
  // each bucket's weights doorbell as its weights are written (all at once for a skipped step;
  // all -N for a failed one).
  static absl::StatusOr<StepResult> OverlappedStepLocked(Session& self, StepRun& run,
                                                         const kernels::Context& update_ctx);
  static absl::StatusOr<StepResult> OverlappedPhases(Session& self, StepRun& run,
                                                     const kernels::Context& update_ctx,
                                                     std::vector<int>* order);
  // Every parameter read and every group's staged step begun (nothing staged yet).
  static absl::Status BeginOverlapPhase(Session& self, StepRun& run,
                                        const kernels::Context& update_ctx);
  // The next bucket rung for this step (the session's mutex released while it waits).
  static absl::StatusOr<int> WaitForBucketPhase(Session& self, StepRun& run,
                                                const std::vector<bool>& taken);
  // The new weights (in the parameters' copies) into the arena bucket by bucket in the reverse
  // of `order`, each bucket's weights doorbell rung right after its write (and its done event);
  // a bucket whose write met a shrunk PARAMETERS region is not rung (FinishStepLocked then fails
  // the step).
  static absl::Status WriteBucketsPhase(Session& self, StepRun& run, const std::vector<int>& order);
  // Bucket k's gradients read and scanned, then, while all are finite, its part of every group
  // staged.
  static absl::Status StageBucketPhase(Session& self, StepRun& run, size_t k);
  // Every group's part for `params` whose gradients were read (null ones skipped).
  static absl::Status StagePartsPhase(Session& self, StepRun& run,
                                      const std::vector<size_t>& params);

  // A world session's overlapped step (session_overlap_world.cc; docs/DISTRIBUTED.md
  // "Overlapped step"). The step's kind, in slots appended to the world's first all-reduce
  // (AgreeGradientsPhase): whether it overlaps, and a fingerprint of the buckets.
  static constexpr size_t kAgreementSlots = 33;
  static void PutAgreement(const Session& self, const StepRun& run, float* slots);
  // FAILED_PRECONDITION naming what differs across the ranks (`sums`: the slots all-reduced).
  static absl::Status CheckAgreement(const Session& self, const StepRun& run, const float* sums);
  // The buckets in declaration order on every rank, then DecideWorldPhase.
  static absl::StatusOr<StepResult> WorldPhases(Session& self, StepRun& run,
                                                const kernels::Context& update_ctx,
                                                std::vector<int>* order);
  // Bucket k's gradients reduce-scattered to their owners and averaged (AVERAGE, and
  // DION_COMPRESSED's other groups; StepMemory::ReduceGradients), with this rank's non-finite
  // flag and `give_up`; `gave_up`: some rank gave up (the average is not used then).
  static absl::Status ReduceBucketPhase(Session& self, StepRun& run, size_t k, bool give_up,
                                        bool* gave_up);
  // Bucket k's updates, once this rank staged its part (`mine`: its failure so far): one
  // all-gather-v of every rank's block (its parameters of the bucket but compressed Dion's, each
  // a compact update or its new value, then a flag: sent, gave up, or nothing staged after a
  // non-finite value), then the others' updates into this rank's copies. `gave_up`: some rank
  // gave up; nothing staged somewhere: run.finite false on every rank. A failed collective
  // breaks the world session.
  static absl::Status ExchangeBucketPhase(Session& self, StepRun& run,
                                          const kernels::Context& update_ctx, size_t k,
                                          absl::Status* mine, bool* gave_up);
  // What this rank stages among `params`: its own, and the compressed Dion matrices.
  static std::vector<size_t> OwnedOf(const Session& self, const std::vector<size_t>& params);
  // After the last bucket under max_grad_norm: the clip (of the averaged gradients under
  // AVERAGE: a collective), then, all finite, every owned gradient staged.
  static absl::Status ClipAndStagePhase(Session& self, StepRun& run);
  // Every rank's give-up and non-finite flags summed, then the same outcome on every rank:
  // failed (nothing committed), skipped, or the exchange and the write-back (FinishStepLocked).
  static absl::StatusOr<StepResult> DecideWorldPhase(Session& self, StepRun& run,
                                                     const kernels::Context& update_ctx,
                                                     const absl::Status& mine,
                                                     const std::vector<int>& order);
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_SESSION_OVERLAP_H_
