// Session::Step's entry and the asynchronous mode (docs/DATA_PLANE.md "Asynchronous Step").
//
// An asynchronous Step is validated on the caller's thread (its errors answer at once), then
// queued: a thread of the session's runs the same StepLocked a synchronous Step runs, under the
// session's mutex, so its numbers are the synchronous ones bit for bit. At most one step is
// queued per session. Until its outcome is collected (by the next Step or a Step with `wait`)
// the queued step owns the trainer's regions and the session's state: the calls that would
// read or change them are refused (StepQueue::Refuse), so that their effect never depends
// on whether the queued step has run yet. Snapshot (checkpoints) waits for the update instead;
// CloseSession, AttachSession and the daemon's shutdown wait for the whole step and drop its
// outcome (DrainQueuedStep). A world session's queued step runs its collectives on that thread,
// where they meet the other ranks' (synchronous or queued alike).
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/session/session.h"
#include "server/session/session_device.h"
#include "server/session/step_memory.h"

namespace diond::session {

Session::~Session() { DrainQueuedStep(/*closing=*/true); }

bool Session::CancelDoorbellWaits() {
  cancel_waits_.fetch_add(1);
  return in_doorbell_wait_.load();
}

int64_t Session::DrainQueuedStep(bool closing) {
  absl::MutexLock lock(&mu_);
  // An overlapped step waiting for its doorbells (without the mutex) gives up: its trainer is
  // gone or replaced, and its buckets may never be rung.
  cancel_waits_.fetch_add(1);
  if (closing) queue_.Close();
  if (queue_.queued()) queue_.Await(StepQueue::State::kDone);
  if (closing) {
    // The trainer's GPU memory is unmapped, and its events destroyed, when the session closes,
    // not whenever the last reference to the session (an RPC still finishing) goes: the
    // trainer may free them next.
    for (Role r : {Role::kParameters, Role::kGradients}) {
      if (arenas_.binding(r).cuda != nullptr) arenas_.binding(r).Clear();
    }
    if (device_ != nullptr) device_->DestroyEvents();
  }
  if (!queue_.queued()) return 0;
  StepQueue::Outcome q = queue_.Take();
  if (!q.status.ok()) {
    DIOND_LOG(WARNING) << "session " << id_ << ": the asynchronous step " << q.step_index
                       << " failed and its error was never collected: " << q.status;
  }
  return q.step_index;
}

absl::StatusOr<StepResult> Session::Step(const StepRequest& request, const kernels::Context& ctx,
                                         std::function<void(const StepResult&)> after_async) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  last_used_ = start;
  std::vector<StepResult> previous;
  if (queue_.closing()) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' is being closed"));
  }
  if (queue_.queued()) {
    // Every Step waits for the queued one; what it then does depends on the index it names.
    queue_.Await(StepQueue::State::kDone);
  }
  if (request.wait) {
    if (request.step_index != 0 &&
        request.step_index != (queue_.queued() ? queue_.step_index() : last_step_index_)) {
      return absl::FailedPreconditionError(
          absl::StrCat("Step with wait names step_index ", request.step_index, ", but ",
                       queue_.queued() ? absl::StrCat("step ", queue_.step_index(), " is queued")
                                       : std::string("no asynchronous step is queued")));
    }
    if (!queue_.queued()) {
      // Nothing queued (or a retried wait whose answer was lost): the recorded last step.
      if (last_result_.has_value() && last_result_->step_index == last_step_index_) {
        StepResult r = *last_result_;
        r.replayed = true;
        return r;
      }
      return absl::FailedPreconditionError(
          queue_.last_failure().empty()
              ? std::string("Step with wait: no asynchronous step is queued and no step is "
                            "recorded")
              : absl::StrCat("Step with wait: no asynchronous step is queued; the last one "
                             "failed (",
                             queue_.last_failure(), ")"));
    }
    StepQueue::Outcome q = queue_.Take();
    if (!q.status.ok()) {
      return absl::Status(
          q.status.code(),
          absl::StrCat("asynchronous step ", q.step_index, " failed: ", q.status.message(),
                       " (the session is at step ", last_step_index_, ")"));
    }
    return q.result;
  }
  if (queue_.queued()) {
    const int64_t queued_index = queue_.step_index();
    if (request.step_index == queued_index) {
      // A retry of the queued step (its answer was lost): the queued step's answer.
      StepQueue::Outcome q = queue_.Take();
      if (!q.status.ok()) {
        return absl::Status(
            q.status.code(),
            absl::StrCat("asynchronous step ", q.step_index, " failed: ", q.status.message(),
                         " (the session is at step ", last_step_index_, ")"));
      }
      q.result.replayed = true;
      return q.result;
    }
    if (request.step_index != queued_index + 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("step_index ", request.step_index, " is out of order: step ", queued_index,
                       " is queued (asynchronous); the next Step is ", queued_index + 1, " (or ",
                       queued_index, " or a Step with wait to collect it)"));
    }
    if (queue_.failed()) {
      // The failure is this call's answer; the next step did not run.
      StepQueue::Outcome q = queue_.Take();
      return absl::Status(
          q.status.code(),
          absl::StrCat("asynchronous step ", q.step_index, " failed: ", q.status.message(),
                       "; step ", request.step_index, " was not run (the session is at step ",
                       last_step_index_, ": retry step ", q.step_index, ")"));
    }
    // The next step: validated before the queued one's result is taken, so that an invalid
    // request leaves that result to be collected.
    std::optional<StepResult> replay;
    if (absl::Status s = ValidateStepLocked(request, &replay); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (the asynchronous step ", queued_index,
                                       " succeeded; its result is still to collect)"));
    }
    previous.push_back(queue_.Take().result);
  }
  if (request.asynchronous) {
    std::optional<StepResult> replay;
    DIOND_RETURN_IF_ERROR(ValidateStepLocked(request, &replay));
    if (replay.has_value()) {
      replay->previous = std::move(previous);
      return *replay;  // the recorded answer, as a synchronous Step gives it
    }
    // The queued thread runs the step under mu_, as a synchronous Step does.
    queued_cancel_gen_ = cancel_waits_.load();
    queue_.Start(
        request.step_index,
        [this, request, ctx = &ctx]()
            ABSL_NO_THREAD_SAFETY_ANALYSIS { return StepLocked(request, *ctx, absl::Now()); },
        std::move(after_async));
    StepResult r;
    r.step_index = request.step_index;
    r.queued = true;
    r.previous = std::move(previous);
    return r;
  }
  absl::StatusOr<StepResult> r = StepLocked(request, ctx, start);
  if (!r.ok()) {
    if (previous.empty()) return r.status();
    return absl::Status(
        r.status().code(),
        absl::StrCat(r.status().message(), " (the asynchronous step ", previous[0].step_index,
                     " before it succeeded: Step it again to get its answer)"));
  }
  if (!r->replayed) queue_.StepApplied();
  r->previous = std::move(previous);
  return r;
}

}  // namespace diond::session
