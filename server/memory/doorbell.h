// The doorbells of an overlapped step (docs/DATA_PLANE.md "Overlapped step"): words in a page of
// the trainer's shared memory through which the trainer says "bucket k of step N has its
// gradients" and the daemon answers "bucket k's weights of step N are written".
//
// Layout (little-endian; the client libraries write the header, diond/doorbell.py):
//   [0, 8)     "DIONDDB1"
//   [8, 12)    u32 version, 1
//   [12, 16)   u32 buckets K, 1 .. kMaxBuckets
//   [64 + 64k, +8)       i64 gradients[k]: the trainer's; N once bucket k's gradients of step N
//                        are written (and every write of them is visible before this one); -N
//                        on any bucket: the trainer abandons step N (it fails, nothing committed)
//   [64 + 64k + 8, +8)   i64 weights[k]: the daemon's; N once bucket k's weights of step N are
//                        written (or left as they were: a skipped step), -N when step N failed
// Each bucket has its own cache line. Each side writes only its own words, steps in order.
//
// The trainer's guarantee: once any weights word says N or -N, the daemon has finished reading
// every gradient of step N (the words are rung after the decision, which follows the last
// bucket's read, or after the step failed), so the trainer may zero or overwrite them. An
// abandon is heard only while the daemon still waits for a bucket: a trainer decides before it
// rings its last one.
//
// A ring is one aligned 8-byte store-release, a wait an acquire load polled with a backoff from
// 20 us to 1 ms (no futex: a trainer in Python rings with a plain store). The region is a
// ShmRegion, so a trainer that shrinks it costs a failed wait, never the daemon (its SIGBUS
// guard).
#ifndef DIOND_SERVER_MEMORY_DOORBELL_H_
#define DIOND_SERVER_MEMORY_DOORBELL_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/memory/shm_region.h"

namespace diond::memory {

class Doorbells {
 public:
  static constexpr int kMaxBuckets = 65536;
  // Bytes a page of `buckets` doorbells takes.
  static int64_t BytesFor(int buckets);

  // Checks the header of `region` (which must outlive the result): INVALID_ARGUMENT naming what
  // is wrong (the magic, the version, the bucket count, a region too small for it);
  // FAILED_PRECONDITION when the region shrank.
  static absl::StatusOr<Doorbells> Attach(const ShmRegion* region);

  int buckets() const { return buckets_; }

  // Waits until one bucket not yet taken (taken[k] false; taken.size() == buckets()) is rung for
  // `step`, and returns the lowest such k. ABORTED as soon as any bucket, taken or not, says
  // -step (the trainer abandons the step); DEADLINE_EXCEEDED at `deadline`; CANCELLED as soon
  // as `cancelled()` says so (asked between polls); FAILED_PRECONDITION when the region shrank or
  // a bucket says a step after `step` (the trainer is ahead of the daemon).
  absl::StatusOr<int> WaitAnyGradients(const std::vector<bool>& taken, int64_t step,
                                       absl::Time deadline,
                                       absl::FunctionRef<bool()> cancelled) const;
  // The trainer's word of bucket k, as it is now.
  int64_t gradients(int k) const;

  // Bucket k's weights of `step` are written.
  void RingWeights(int k, int64_t step) const;
  // Step `step` failed: every bucket's weights word says -step.
  void FailWeights(int64_t step) const;
  int64_t weights(int k) const;

 private:
  Doorbells(const ShmRegion* region, int buckets) : region_(region), buckets_(buckets) {}
  int64_t* word(int k, int which) const;

  const ShmRegion* region_;
  int buckets_;
};

}  // namespace diond::memory

#endif  // DIOND_SERVER_MEMORY_DOORBELL_H_
