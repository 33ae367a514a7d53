// Session::Step's entry and the asynchronous mode (docs/DATA_PLANE.md "Asynchronous Step").
//
// An asynchronous Step is validated on the caller's thread (its errors answer at once), then
// queued: a thread of the session's runs the same StepLocked a synchronous Step runs, under the
// session's mutex, so its numbers are the synchronous ones bit for bit. At most one step is
// queued per session. Until its outcome is collected (by the next Step or a Step with `wait`)
// the queued step owns the trainer's regions and the session's state: the calls that would
// read or change them are refused (RefuseIfQueuedLocked), so that their effect never depends
// on whether the queued step has run yet. Snapshot (checkpoints) waits for the update instead;
// CloseSession, AttachSession and the daemon's shutdown wait for the whole step and drop its
// outcome (DrainQueuedStep).
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/session/session.h"

namespace diond::session {

Session::~Session() { DrainQueuedStep(/*closing=*/true); }

absl::Status Session::RefuseIfQueuedLocked(absl::string_view what) {
  if (!queued_.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": step ", queued_->step_index,
      " was queued by an asynchronous Step and its result has not been collected; until then "
      "the step owns the session's regions and state. Collect it first (Step with wait, or "
      "the next Step)"));
}

void Session::AwaitQueuedLocked(QueuedState state) {
  auto reached = [this, state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queued_.has_value() || static_cast<int>(queued_->state) >= static_cast<int>(state);
  };
  mu_.Await(absl::Condition(&reached));
}

Session::QueuedStep Session::TakeQueuedLocked() {
  QueuedStep q = std::move(*queued_);
  queued_.reset();
  // The thread set kDone under mu_ and touches nothing of the session after it.
  if (queued_thread_.joinable()) queued_thread_.join();
  return q;
}

int64_t Session::DrainQueuedStep(bool closing) {
  absl::MutexLock lock(&mu_);
  if (closing) closing_ = true;
  if (queued_.has_value()) AwaitQueuedLocked(QueuedState::kDone);
  if (closing) {
    // The trainer's GPU memory is unmapped when the session closes, not whenever the last
    // reference to the session (an RPC still finishing) goes: the trainer may free it next.
    if (params_.cuda != nullptr) ClearBinding(params_);
    if (grads_.cuda != nullptr) ClearBinding(grads_);
  }
  if (!queued_.has_value()) return 0;
  QueuedStep q = TakeQueuedLocked();
  if (!q.status.ok()) {
    DIOND_LOG(WARNING) << "session " << id_ << ": the asynchronous step " << q.step_index
                       << " failed and its error was never collected: " << q.status;
  }
  return q.step_index;
}

void Session::RunQueuedStep(StepRequest request, const kernels::Context* ctx,
                            std::function<void(const StepResult&)> after_async) {
  absl::StatusOr<StepResult> r;
  {
    absl::MutexLock lock(&mu_);
    r = StepLocked(request, *ctx, absl::Now());
    if (r.ok()) last_async_failure_.clear();
    queued_->state = QueuedState::kCompleting;
  }
  if (r.ok() && after_async) after_async(*r);
  if (!r.ok()) {
    DIOND_LOG(WARNING) << "session " << id_ << ": asynchronous step " << request.step_index
                       << " failed (answered by the next Step): " << r.status();
  }
  absl::MutexLock lock(&mu_);
  if (r.ok()) {
    queued_->result = *std::move(r);
  } else {
    queued_->status = r.status();
    last_async_failure_ = absl::StrCat("step ", request.step_index, ": ", r.status().ToString());
  }
  queued_->state = QueuedState::kDone;
}

absl::StatusOr<StepResult> Session::Step(const StepRequest& request, const kernels::Context& ctx,
                                         std::function<void(const StepResult&)> after_async) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  last_used_ = start;
  std::vector<StepResult> previous;
  if (closing_) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' is being closed"));
  }
  if (queued_.has_value()) {
    // Every Step waits for the queued one; what it then does depends on the index it names.
    AwaitQueuedLocked(QueuedState::kDone);
  }
  if (request.wait) {
    if (request.step_index != 0 &&
        request.step_index != (queued_.has_value() ? queued_->step_index : last_step_index_)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Step with wait names step_index ", request.step_index, ", but ",
          queued_.has_value() ? absl::StrCat("step ", queued_->step_index, " is queued")
                              : std::string("no asynchronous step is queued")));
    }
    if (!queued_.has_value()) {
      // Nothing queued (or a retried wait whose answer was lost): the recorded last step.
      if (last_result_.has_value() && last_result_->step_index == last_step_index_) {
        StepResult r = *last_result_;
        r.replayed = true;
        return r;
      }
      return absl::FailedPreconditionError(
          last_async_failure_.empty()
              ? std::string("Step with wait: no asynchronous step is queued and no step is "
                            "recorded")
              : absl::StrCat("Step with wait: no asynchronous step is queued; the last one "
                             "failed (",
                             last_async_failure_, ")"));
    }
    QueuedStep q = TakeQueuedLocked();
    if (!q.status.ok()) {
      return absl::Status(
          q.status.code(),
          absl::StrCat("asynchronous step ", q.step_index, " failed: ", q.status.message(),
                       " (the session is at step ", last_step_index_, ")"));
    }
    return q.result;
  }
  if (queued_.has_value()) {
    const int64_t queued_index = queued_->step_index;
    if (request.step_index == queued_index) {
      // A retry of the queued step (its answer was lost): the queued step's answer.
      QueuedStep q = TakeQueuedLocked();
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
    if (!queued_->status.ok()) {
      // The failure is this call's answer; the next step did not run.
      QueuedStep q = TakeQueuedLocked();
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
    previous.push_back(TakeQueuedLocked().result);
  }
  if (request.asynchronous) {
    if (world_.has_value()) {
      return absl::FailedPreconditionError(
          "asynchronous Step is for local sessions; a world session steps synchronously");
    }
    std::optional<StepResult> replay;
    DIOND_RETURN_IF_ERROR(ValidateStepLocked(request, &replay));
    if (replay.has_value()) {
      replay->previous = std::move(previous);
      return *replay;  // the recorded answer, as a synchronous Step gives it
    }
    queued_.emplace();
    queued_->step_index = request.step_index;
    queued_thread_ =
        std::thread(&Session::RunQueuedStep, this, request, &ctx, std::move(after_async));
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
  if (!r->replayed) last_async_failure_.clear();
  r->previous = std::move(previous);
  return r;
}

}  // namespace diond::session
