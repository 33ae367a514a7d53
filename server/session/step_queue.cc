#include "server/session/step_queue.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace diond::session {

StepQueue::StepQueue(absl::Mutex* mu, const std::string* session_id)
    : mu_(mu), session_id_(session_id) {}

StepQueue::~StepQueue() { DIOND_CHECK(!thread_.joinable()) << "a queued step was never drained"; }

absl::Status StepQueue::Refuse(absl::string_view what) const {
  if (!outcome_.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": step ", outcome_->step_index,
      " was queued by an asynchronous Step and its result has not been collected; until then "
      "the step owns the session's regions and state. Collect it first (Step with wait, or "
      "the next Step)"));
}

void StepQueue::Await(State state) {
  auto reached = [this, state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !outcome_.has_value() || static_cast<int>(state_) >= static_cast<int>(state);
  };
  mu_->Await(absl::Condition(&reached));
}

StepQueue::Outcome StepQueue::Take() {
  Outcome o = std::move(*outcome_);
  outcome_.reset();
  // The thread set kDone under the mutex and touches nothing of the session after it.
  if (thread_.joinable()) thread_.join();
  return o;
}

void StepQueue::Start(int64_t step_index, std::function<absl::StatusOr<StepResult>()> step,
                      std::function<void(const StepResult&)> after) {
  DIOND_CHECK(!outcome_.has_value()) << "a step is queued already";
  outcome_.emplace();
  outcome_->step_index = step_index;
  state_ = State::kRunning;
  thread_ = std::thread([this, step_index, step = std::move(step), after = std::move(after)] {
    Run(step_index, step, after);
  });
}

void StepQueue::Run(int64_t step_index, const std::function<absl::StatusOr<StepResult>()>& step,
                    const std::function<void(const StepResult&)>& after) {
  absl::StatusOr<StepResult> r;
  {
    absl::MutexLock lock(mu_);
    r = step();
    if (r.ok()) last_failure_.clear();
    state_ = State::kCompleting;
  }
  if (r.ok() && after) after(*r);
  if (!r.ok()) {
    DIOND_LOG(WARNING) << "session " << *session_id_ << ": asynchronous step " << step_index
                       << " failed (answered by the next Step): " << r.status();
  }
  absl::MutexLock lock(mu_);
  if (r.ok()) {
    outcome_->result = *std::move(r);
  } else {
    outcome_->status = r.status();
    last_failure_ = absl::StrCat("step ", step_index, ": ", r.status().ToString());
  }
  state_ = State::kDone;
}

}  // namespace diond::session
