// The daemon world as the session layer sees it (ARCHITECTURE.md §6): this daemon's rank, the
// world size, the current Communicator, and the news that the world broke.
//
// Life cycle:
// 1. World::Join registers with the coordinator (bounded by join_timeout; retried while the
//    coordinator is unreachable or a lost predecessor still holds the rank). A world-size
//    mismatch or a bad rank fails at once with FAILED_PRECONDITION / INVALID_ARGUMENT.
// 2. A background thread heartbeats every heartbeat_interval. Once every rank is live, a second
//    thread builds a GlooCommunicator for that generation, under the generation's own key prefix
//    (and, with WorldOptions::device_communicator_factory, a device communicator beside it).
// 3. When a rank is lost (coordinator's verdict, seen at the next heartbeat), the coordinator is
//    unreachable for peer_timeout, or a collective fails, the world is *broken*: the communicator
//    is aborted (pending and later calls fail with UNAVAILABLE and the reason, which names the
//    lost rank), the broken callbacks run, and the world rebuilds when the membership is complete
//    again (a restarted daemon rejoins as a new incarnation: new generation, new prefix).
//
// Thread-safety: all methods are thread-safe. Callbacks run on the World's background threads;
// they must not call back into the World's destructor.
#ifndef DIOND_SERVER_COMM_WORLD_H_
#define DIOND_SERVER_COMM_WORLD_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/comm/communicator.h"
#include "server/comm/key_value_store.h"
#include "server/comm/membership.h"

namespace diond::comm {

struct WorldOptions {
  int rank = 0;
  int world_size = 1;
  // Host or IP other daemons reach this one at; the Gloo TCP device binds it (--peer_listen).
  std::string address = "127.0.0.1";
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Seconds(60);
  CollectiveObserver collective_observer;
  // Device collectives (NCCL on a GPU daemon; docs/DISTRIBUTED.md "On device daemons").
  // When set, every generation also gets a communicator on device memory, built by this factory
  // right after the host one, under its own key prefix ("<generation prefix>dev/"). A failure
  // fails the generation like a failed Gloo build. Unset: device sessions stage through Gloo.
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
      KeyValueStore* kv, const std::string& prefix, int rank, int size, absl::Duration timeout,
      CollectiveObserver observer)>
      device_communicator_factory;
  // Metrics and logs hooks; each may be empty.
  std::function<void(int live_ranks)> on_peers;
  std::function<void(uint64_t generation)> on_ready;
  std::function<void(uint64_t generation, const absl::Status& why)> on_broken;
};

class World {
 public:
  // `membership` and `kv` must outlive the World (rank 0: the Coordinator and its store;
  // others: an rpc::PeerClient).
  static absl::StatusOr<std::unique_ptr<World>> Join(const WorldOptions& options,
                                                     MembershipService* membership,
                                                     KeyValueStore* kv);
  ~World();

  int rank() const { return options_.rank; }
  int size() const { return options_.world_size; }
  uint64_t incarnation() const { return incarnation_; }

  // OK when a communicator for the current generation is up; otherwise UNAVAILABLE saying why
  // (forming, or broken and by whom).
  absl::Status status() const;
  // The current communicator, or status(). Holders may keep it: after a break it stays valid but
  // aborted (every call fails with UNAVAILABLE).
  absl::StatusOr<std::shared_ptr<Communicator>> communicator() const;
  // The current generation's device communicator (memory() == kDevice), or null when the
  // options have no factory or no generation is up. Like communicator(): kept valid but aborted
  // after a break.
  std::shared_ptr<Communicator> device_communicator() const;
  // Generation of the current communicator (the "epoch"); 0 while none is up.
  uint64_t epoch() const;
  // Blocks until a communicator is up (OK) or `timeout` passes (the last status()).
  absl::Status WaitReady(absl::Duration timeout) const;
  // The last membership the coordinator reported.
  MembershipView membership() const;
  // Adds a callback for "the world broke" (generation that ended, reason).
  void AddBrokenCallback(std::function<void(uint64_t generation, const absl::Status& why)> cb);

 private:
  World(const WorldOptions& options, MembershipService* membership, KeyValueStore* kv);
  absl::StatusOr<MembershipView> JoinWithRetry(bool rebuild, absl::Duration bound);
  void HeartbeatLoop();
  void BuildLoop();
  // Aborts the communicator of `generation` (if still current) and runs the callbacks.
  void Break(uint64_t generation, const absl::Status& why);
  void UpdateView(const MembershipView& v);

  const WorldOptions options_;
  MembershipService* membership_;
  KeyValueStore* kv_;
  const uint64_t incarnation_;
  const std::string proof_;  // JoinArgs::proof of this process

  mutable absl::Mutex mu_;
  MembershipView view_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Communicator> comm_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Communicator> device_comm_ ABSL_GUARDED_BY(mu_);  // with comm_, or null
  uint64_t comm_generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_generation_ ABSL_GUARDED_BY(mu_) = 0;  // last generation whose build failed
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void(uint64_t, const absl::Status&)>> broken_callbacks_
      ABSL_GUARDED_BY(mu_);
  std::thread heartbeat_;
  std::thread builder_;
};

}  // namespace diond::comm

#endif  // DIOND_SERVER_COMM_WORLD_H_
