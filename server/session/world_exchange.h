// Phase 9 of a world step (docs/ARCHITECTURE.md §2; docs/DISTRIBUTED.md): the owners' results
// reach every rank by one all-gather-v. Each rank packs its block (its owned parameters' payloads,
// then its groups' squared update norms and its status), gathers every block, reads the others'
// norms and statuses, writes the others' whole parameters into its copies (Muon, NorMuon, AdamW,
// Lion) and applies their compact updates (Dion's P and Q, Dion2's and Dion3's slices) through
// the rules' own code, then compares the replicas' checksums.
//
// The phase is written once for both memories: where its buffers lie (host vectors for a host
// session, the device session's world buffers) is ExchangeWire's, the only place that knows.
//
// Internal to the session's implementation: included only by server/session/session*.cc and
// world_exchange.cc. Not thread-safe: one step's, run under the session's mutex.
#ifndef DIOND_SERVER_SESSION_WORLD_EXCHANGE_H_
#define DIOND_SERVER_SESSION_WORLD_EXCHANGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "server/comm/communicator.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace diond::session {

// The exchange's two buffers in the step's memory: `mine` (this rank's block, the all-gather-v's
// input) and `all` (every rank's blocks, its output), the communicator that moves them, and the
// four moves between them and the step's tensors or the host. Each move runs on the compute
// thread where it computes, and is complete when it returns.
class ExchangeWire {
 public:
  virtual ~ExchangeWire() = default;
  float* mine() const { return mine_; }
  float* all() const { return all_; }
  virtual comm::Communicator& comm() = 0;
  // The context of the checksums over the step's tensors.
  virtual const kernels::Context& step_context() const = 0;
  // mine[at, at + n) <- a step tensor (the step's memory, like the wire's) / host floats.
  virtual absl::Status PutStep(const float* src, int64_t at, int64_t n) = 0;
  virtual absl::Status PutHost(const float* src, int64_t at, int64_t n) = 0;
  // A step tensor <- all[at, at + n).
  virtual absl::Status GetStep(int64_t at, float* dst, int64_t n) = 0;
  // all[at, at + n) on the host, valid until the next GetHost.
  virtual absl::StatusOr<absl::Span<const float>> GetHost(int64_t at, int64_t n) = 0;
  // OK once what was read from `all` can be trusted (a queued collective fails asynchronously).
  virtual absl::Status Settled() = 0;

 protected:
  float* mine_ = nullptr;
  float* all_ = nullptr;
};

// Host vectors of `mine` and `total` floats; the host communicator; `ctx` a CPU context.
std::unique_ptr<ExchangeWire> MakeHostExchangeWire(comm::Communicator* comm,
                                                   const kernels::Context* ctx,
                                                   ComputeThread* compute, int64_t mine,
                                                   int64_t total);
// A device session's world buffers `mine` and `all` on dctx's device; the step's device
// collectives.
std::unique_ptr<ExchangeWire> MakeDeviceExchangeWire(const kernels::Context* dctx,
                                                     StepDeviceComm* dcomm, ComputeThread* compute,
                                                     float* mine, float* all);

class WorldExchange {
 public:
  // `run` has joined the world (run.comm set); `ctx` is the step's (the compact updates'
  // context).
  WorldExchange(Session& s, Session::StepRun& run, const kernels::Context& ctx);
  // The phase. A failed collective or read-back breaks the world session and is returned; a
  // failure of compute (this rank's or another's) goes into run.compute_status, for the caller.
  absl::Status Run();

 private:
  // The wire at the plan's sizes, in the step's memory (StepMemory::MakeExchangeWire).
  absl::Status MakeWire();
  // This rank's owned payloads into `mine`.
  void PackOwned();
  // The tail (norms, status) into `mine`, then the all-gather-v.
  absl::Status Gather();
  // Every rank's tail: the world's update norms and the ranks that failed; the others' whole
  // parameters and compact updates listed.
  absl::Status ReadTails();
  // The others' whole parameters into this rank's copies (Muon, NorMuon, AdamW, Lion).
  void ApplyWholeParameters();
  // The others' compact updates through the rules' own code (Dion, Dion2, Dion3).
  void ApplyCompactUpdates();
  absl::Status CompareChecksums();
  absl::Status Broken(absl::string_view what, const absl::Status& why);
  void Fail(absl::Status why);  // the first failure of compute wins

  Session& s_;
  Session::StepRun& run_;
  const kernels::Context& ctx_;
  const Session::WorldPart& w_;
  const std::string where_;
  // Block of rank j: its payloads (none when run.updates_exchanged), then per group its squared
  // update norm as two floats (hi, lo: a double to ~48 bits), then its status.
  const int64_t extra_;
  std::vector<int64_t> counts_;
  int64_t total_ = 0;
  std::unique_ptr<ExchangeWire> wire_;
  int64_t at_ = 0;                                   // end of the packed payloads in `mine`
  bool ok_here_ = true;                              // this rank's status as sent
  std::vector<int> failed_;                          // the other ranks that failed
  std::vector<std::pair<size_t, int64_t>> compact_;  // (parameter, offset in `all`)
  std::vector<std::pair<size_t, int64_t>> whole_;    // the others' parameters, (i, offset)
};

}  // namespace diond::session

#endif  // DIOND_SERVER_SESSION_WORLD_EXCHANGE_H_
