#include "server/session/compute_thread.h"

#include <pthread.h>

#include <exception>
#include <utility>

#include "common/logging.h"

namespace diond::session {

struct ComputeThread::Task {
  absl::FunctionRef<void()> f;
  LogContextSnapshot log_context;
  std::exception_ptr error;  // what f threw (std::bad_alloc), rethrown on the caller's thread
  bool done = false;         // guarded by the thread's mu_
};

ComputeThread::ComputeThread(std::string name) {
  thread_ = std::thread([this] { Loop(); });
  id_ = thread_.get_id();
  if (name.size() > 15) name.resize(15);
  pthread_setname_np(thread_.native_handle(), name.c_str());
}

ComputeThread::~ComputeThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void ComputeThread::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](ComputeThread* t) { return t->stop_ || !t->queue_.empty(); }, this));
    if (queue_.empty()) return;  // stop_, and nothing left to run
    Task* task = queue_.front();
    queue_.pop_front();
    mu_.Unlock();
    {
      ScopedLogContext log_context(task->log_context.session, task->log_context.step);
      try {
        task->f();
      } catch (...) {
        task->error = std::current_exception();
      }
    }
    mu_.Lock();
    ++tasks_run_;
    task->done = true;
  }
}

void ComputeThread::Run(absl::FunctionRef<void()> f) {
  if (OnThread()) {
    f();
    return;
  }
  Task task{f, CurrentLogContext(), nullptr, false};
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(&task);
    mu_.Await(absl::Condition(&task.done));
  }
  if (task.error) std::rethrow_exception(task.error);
}

absl::Status ComputeThread::Call(absl::FunctionRef<absl::Status()> f) {
  absl::Status status;
  Run([&] { status = f(); });
  return status;
}

int64_t ComputeThread::tasks_run() const {
  absl::MutexLock lock(&mu_);
  return tasks_run_;
}

void RunOnCompute(ComputeThread* compute, absl::FunctionRef<void()> f) {
  if (compute == nullptr) {
    f();
  } else {
    compute->Run(f);
  }
}

absl::Status CallOnCompute(ComputeThread* compute, absl::FunctionRef<absl::Status()> f) {
  return compute == nullptr ? f() : compute->Call(f);
}

}  // namespace diond::session
