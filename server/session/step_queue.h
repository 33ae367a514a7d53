// A session's asynchronous step (docs/DATA_PLANE.md "Asynchronous Step"): at most one step
// queued, the thread that runs it, and its outcome until it is collected; also the session's
// closing flag and the last asynchronous failure, which the next Steps quote.
//
// Until its outcome is collected the queued step owns the trainer's regions and the session's
// state: the session refuses (Refuse) the calls that would read or change them, so that their
// effect never depends on whether the queued step has run yet.
//
// Thread-safety: the queue is part of its session and is guarded by the session's mutex, given
// to the constructor: every method requires it held. The queued step's thread takes it itself.
#ifndef DIOND_SERVER_SESSION_STEP_QUEUE_H_
#define DIOND_SERVER_SESSION_STEP_QUEUE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/session/types.h"

namespace diond::session {

// A queued step's outcome. (At namespace scope: clang decides std::optional<T>::emplace()'s
// constructibility of a nested T while the enclosing class is still incomplete.)
struct QueuedStepOutcome {
  int64_t step_index = 0;
  absl::Status status;
  StepResult result;
};

class StepQueue {
 public:
  // kRunning until the step's update ran, kCompleting while its `after` runs (only snapshots
  // and bookkeeping may then touch the session), kDone until collected.
  enum class State { kRunning, kCompleting, kDone };
  using Outcome = QueuedStepOutcome;

  // `mu`: the session's mutex; `session_id` (the session's, outliving the queue) names it in
  // the log.
  StepQueue(absl::Mutex* mu, const std::string* session_id);
  ~StepQueue();  // the session drains the queue first (DIOND_CHECK)
  StepQueue(const StepQueue&) = delete;
  StepQueue& operator=(const StepQueue&) = delete;

  bool queued() const { return outcome_.has_value(); }
  // The queued step's index and whether it ended (kDone) with an error; queued() first.
  int64_t step_index() const { return outcome_->step_index; }
  bool failed() const { return !outcome_->status.ok(); }

  // FAILED_PRECONDITION "<what>: step N was queued by an asynchronous Step ..." while a step is
  // queued and not yet collected; OK otherwise.
  absl::Status Refuse(absl::string_view what) const;
  // Blocks (releasing the session's mutex) until the queued step, if any, reached `state`.
  void Await(State state);
  // The finished (kDone) step's outcome; its thread is joined. queued() first.
  Outcome Take();
  // Queues step `step_index`: a thread runs `step` under the session's mutex, then, if it
  // succeeded, `after` without the mutex (may be empty), and records the outcome (kDone).
  // Nothing may be queued already.
  void Start(int64_t step_index, std::function<absl::StatusOr<StepResult>()> step,
             std::function<void(const StepResult&)> after);

  // The last asynchronous step that failed ("step N: <status>"), until a step is applied: the
  // out-of-order error quotes it, so that a lost answer never hides the failure.
  const std::string& last_failure() const { return last_failure_; }
  void StepApplied() { last_failure_.clear(); }
  // The session is being closed: every later Step is refused.
  bool closing() const { return closing_; }
  void Close() { closing_ = true; }

 private:
  void Run(int64_t step_index, const std::function<absl::StatusOr<StepResult>()>& step,
           const std::function<void(const StepResult&)>& after);

  absl::Mutex* const mu_;
  const std::string* const session_id_;
  std::optional<Outcome> outcome_ ABSL_GUARDED_BY(mu_);
  State state_ ABSL_GUARDED_BY(mu_) = State::kDone;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // joined when the outcome is taken
  std::string last_failure_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_STEP_QUEUE_H_
