// The daemon's one compute thread: every pass of optimizer math of every session (the steps'
// phases, session creation, GetState / SetState, checkpoints) runs on it.
//
// Why one thread and not one mutex: libgomp keeps one OpenMP thread pool per thread that opens
// a parallel region (oneDNN's primitives and the CPU backend's loops share it). With pools from
// more than one calling thread, its count of managed threads exceeds the cores, and every idle
// worker then spins only ~100 iterations (its "throttled" spin count, whatever GOMP_SPINCOUNT
// says) before it sleeps on a futex: each of the thousands of parallel regions of a step pays a
// futex wake-up. gRPC hands successive Steps to different threads, so serializing them with a
// mutex still made two pools (docs/TOOLCHAIN.md P22; docs/BENCHMARKS.md has the measurement).
//
// Run/Call post the work, block until it has run, and return its result; work posted by the
// thread itself runs inline (nested calls never deadlock). The caller's log context (session,
// step) goes with the work. Work must not block on anything that waits for this thread (a
// collective with a peer, another session's lock): the step's network phases run on the
// caller's thread, between compute passes.
//
// Thread-safety: thread-safe.
#ifndef DIOND_SERVER_SESSION_COMPUTE_THREAD_H_
#define DIOND_SERVER_SESSION_COMPUTE_THREAD_H_

#include <cstdint>
#include <deque>
#include <string>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace diond::session {

class ComputeThread {
 public:
  // Starts the thread, named `name` (pthread_setname_np: 15 characters at most; its OpenMP
  // workers inherit the name).
  explicit ComputeThread(std::string name = "diond-compute");
  ~ComputeThread();  // runs what is queued, then joins
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;

  // Runs f on the compute thread; returns once it has returned.
  void Run(absl::FunctionRef<void()> f);
  // Runs f on the compute thread; returns its status.
  absl::Status Call(absl::FunctionRef<absl::Status()> f);

  // True on the compute thread itself.
  bool OnThread() const { return std::this_thread::get_id() == id_; }
  // Work items run so far (nested inline calls are not counted).
  int64_t tasks_run() const;

 private:
  struct Task;
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<Task*> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t tasks_run_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
  std::thread::id id_;
};

// Run/Call on `compute`, or on the calling thread when it is null (a Session made without a
// SessionManager: tests, tools).
void RunOnCompute(ComputeThread* compute, absl::FunctionRef<void()> f);
absl::Status CallOnCompute(ComputeThread* compute, absl::FunctionRef<absl::Status()> f);

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_COMPUTE_THREAD_H_
