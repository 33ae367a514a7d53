// The trainer's side of an overlapped step's doorbells (docs/DATA_PLANE.md "Overlapped step";
// the layout is server/memory/doorbell.h's, which the daemon reads).
//
// An overlapped step, per step N: Step(N) with StepOptions::asynchronous and ::overlap; then, as
// the gradients of each bucket are written, RingGradients(k, N); before the next use of bucket
// k's weights, WaitWeights(k, N); the step's result comes from WaitStep (or the next Step).
// Abandon(N) instead of the last ring gives the step up (the daemon commits nothing; WaitStep
// says ABORTED) so that it can be sent again, e.g. synchronously.
//
// Lifetime: RAII and move-only; destruction unregisters the page (best effort), unmaps and
// unlinks it. The Client passed to Create must outlive it.
//
// Thread-safety: each bucket's words may be rung and waited on from any thread; a ring is a
// store-release made after the bucket's gradient writes on the same thread.
#ifndef DIOND_CLIENT_CPP_DIOND_DOORBELLS_H_
#define DIOND_CLIENT_CPP_DIOND_DOORBELLS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "diond/client.h"
#include "diond/shm_arena.h"

namespace diond::client {

class DoorbellPage {
 public:
  // A POSIX shm page for buckets.size() buckets (1 .. 65536), each a list of parameter indices
  // (every parameter of the session in exactly one), registered as the session's
  // REGION_ROLE_DOORBELLS. The daemon's errors come back with their codes (INVALID_ARGUMENT
  // naming a bad bucket; FAILED_PRECONDITION for a second page); nothing is left behind.
  static absl::StatusOr<DoorbellPage> Create(const Client* client, const std::string& session_id,
                                             const std::vector<std::vector<int32_t>>& buckets);

  DoorbellPage(DoorbellPage&& other) noexcept;
  DoorbellPage& operator=(DoorbellPage&& other) noexcept;
  DoorbellPage(const DoorbellPage&) = delete;
  DoorbellPage& operator=(const DoorbellPage&) = delete;
  ~DoorbellPage();

  int buckets() const { return buckets_; }
  // Bucket k's gradients of `step` are written.
  void RingGradients(int k, int64_t step) const;
  // Gives step `step` up: the daemon's wait ends, nothing is committed, every weights word says
  // -step.
  void Abandon(int64_t step) const { RingGradients(0, -step); }
  // OK once bucket k's weights of `step` are written (or a skipped step left them); ABORTED
  // when the daemon failed the step (WaitStep has its error); DEADLINE_EXCEEDED at `deadline`.
  absl::Status WaitWeights(int k, int64_t step, absl::Time deadline) const;
  int64_t weights(int k) const;

 private:
  DoorbellPage() = default;
  void Reset();
  int64_t* word(int k, int which) const;

  const Client* client_ = nullptr;
  std::string session_id_, region_id_;
  ShmArena::Segment segment_;
  int buckets_ = 0;
};

}  // namespace diond::client

#endif  // DIOND_CLIENT_CPP_DIOND_DOORBELLS_H_
