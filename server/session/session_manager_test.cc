// In-process tests of the session manager's policies: memory limits, the idle reaper (with and
// without a state directory) and checkpoint round trips. The RPC surface is tested against the
// real daemon in tests/service.
#include "server/session/session_manager.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "common/status_matchers.h"
#include "common/strict_json.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/recording_backend.h"
#include "server/checkpoint/directory_store.h"
#include "server/checkpoint/manifest.h"
#include "server/checkpoint/store.h"
#include "server/session/layout.h"
#include "server/session/process_watch.h"

namespace diond::session {
namespace {

using checkpoint::LatestCheckpoint;
using checkpoint::SessionMarkedClosed;
using checkpoint::SpecFromJson;
using checkpoint::SpecToJson;
using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using strict_json::JsonDepth;
using ::testing::Contains;
using ::testing::HasSubstr;

SessionSpec SmallSpec() {
  SessionSpec spec;
  spec.client_name = "test";
  GroupSpec muon;
  muon.name = "m";
  muon.config.algorithm = optim::AlgorithmKind::kMuon;
  muon.config.hyperparams = optim::DefaultHyperparams(muon.config.algorithm);
  GroupSpec adamw;
  adamw.name = "a";
  adamw.config.algorithm = optim::AlgorithmKind::kAdamW;
  adamw.config.hyperparams = optim::DefaultHyperparams(adamw.config.algorithm);
  spec.groups = {muon, adamw};
  spec.params = {{"w", {8, 6}, DType::kF32, "m"}, {"b", {6}, DType::kF32, "a"}};
  return spec;
}

std::string TempDir() {
  char t[] = "/tmp/diond_mgr_test_XXXXXX";
  return mkdtemp(t);
}

TEST(Layout, OffsetsAreAlignedAndSizesChecked) {
  auto l = ComputeLayout({{"a", {3}, DType::kF32, "g"},
                          {"b", {2, 2}, DType::kBf16, "g"},
                          {"c", {1}, DType::kF16, "g"}});
  ASSERT_THAT(l, IsOk());
  EXPECT_EQ(l->tensors[0].param_offset, 0);
  EXPECT_EQ(l->tensors[1].param_offset, 256);
  EXPECT_EQ(l->tensors[1].size_bytes, 8);
  EXPECT_EQ(l->tensors[2].param_offset, 512);
  EXPECT_EQ(l->param_arena_bytes, 768);
  EXPECT_THAT(ComputeLayout({{"x", {int64_t{1} << 62, 4}, DType::kF32, "g"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  EXPECT_THAT(ComputeLayout({{"x", {3, 0}, DType::kF32, "g"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-positive")));
}

TEST(SessionManager, MaxSessionBytesAndBudgetAreEnforcedWithNumbers) {
  // Muon 8x6 holds one momentum (48 floats), AdamW 6 holds m, v (6 each) and step_dev: 61
  // floats = 244 bytes of state.
  ManagerOptions o;
  o.max_session_bytes = 200;
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  EXPECT_THAT((*m)->CreateSession(SmallSpec()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("244")));
  ManagerOptions b;
  b.memory_budget_bytes = 400;
  auto m2 = SessionManager::Create(b);
  ASSERT_THAT(m2, IsOk());
  EXPECT_THAT((*m2)->CreateSession(SmallSpec()), IsOk());
  EXPECT_THAT((*m2)->CreateSession(SmallSpec()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("400")));
  EXPECT_EQ((*m2)->List().size(), 1u);
}

TEST(SessionManager, IdleSessionsAreClosedAndCheckpointedFirst) {
  std::string dir = TempDir();
  ManagerOptions o;
  o.idle_timeout = absl::Hours(1);  // the reaper thread never fires during the test
  o.state_dir = dir;
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  auto s = (*m)->CreateSession(SmallSpec());
  ASSERT_THAT(s, IsOk());
  std::string id = (*s)->id();
  std::vector<NamedTensor> params = {{"w", {8, 6}, std::vector<float>(48, 0.5f)},
                                     {"b", {6}, std::vector<float>(6, -1.0f)}};
  ASSERT_THAT((*s)->SetState(params), IsOk());
  (*m)->ReapIdleSessions(absl::Now());  // not idle yet
  EXPECT_EQ((*m)->List().size(), 1u);
  (*m)->ReapIdleSessions(absl::Now() + absl::Hours(2));
  EXPECT_TRUE((*m)->List().empty());
  auto latest = LatestCheckpoint(dir, id);
  ASSERT_THAT(latest, IsOk());
  auto restored = (*m)->LoadCheckpoint(*latest);
  ASSERT_THAT(restored, IsOk());
  auto state = (*restored)->GetState(/*include_parameters=*/true);
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ((*state)[0].name, "w");
  EXPECT_EQ((*state)[0].data, params[0].data);
}

// Found by session_fuzz: a control character in a LoadCheckpoint path reached the message raw.
TEST(SessionManager, CheckpointPathsAreEchoedOnOneLine) {
  ManagerOptions o;
  o.state_dir = TempDir();
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  auto loaded = (*m)->LoadCheckpoint("no\nsuch\r/step-1");
  EXPECT_THAT(loaded.status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no?such?")));
  EXPECT_EQ(std::string(loaded.status().message()).find_first_of("\n\r"), std::string::npos);
  EXPECT_TRUE((*m)->List().empty());
}

// Every pass of compute of every API runs on the manager's one compute thread, whatever thread
// calls: libgomp keeps one OpenMP pool per thread that runs a parallel region, and two pools on
// these cores throttle every idle worker's spinning (compute_thread.h). Each call below comes
// from a thread of its own that never ran an op, so an API that computed on its caller's thread
// would count that thread.
TEST(SessionManager, EveryPassOfComputeRunsOnTheComputeThread) {
  auto on_fresh_thread = [](auto f) { std::thread(f).join(); };
  const int before = kernels::CpuParallelCallerThreads();
  ManagerOptions o;
  o.compute_threads = 2;  // ops with more than one thread are the ones counted
  o.state_dir = TempDir();
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  std::unique_ptr<SessionManager> m;
  on_fresh_thread([&] {
    auto made = SessionManager::Create(o);
    ASSERT_THAT(made, IsOk());
    m = *std::move(made);
  });
  SessionSpec spec = SmallSpec();
  spec.params[0].dtype = DType::kBf16;  // the arena's bf16 <-> fp32 conversions are ops too
  GroupSpec dion2;
  dion2.name = "d";
  dion2.config.algorithm = optim::AlgorithmKind::kDion2;
  dion2.config.hyperparams = optim::DefaultHyperparams(dion2.config.algorithm);
  spec.groups.push_back(dion2);
  spec.params.push_back({"v", {16, 12}, DType::kF32, "d"});
  std::shared_ptr<Session> s;
  on_fresh_thread([&] {
    auto made = m->CreateSession(spec);
    ASSERT_THAT(made, IsOk());
    s = *made;
  });
  ASSERT_NE(s, nullptr);
  const std::vector<NamedTensor> params = {{"w", {8, 6}, std::vector<float>(48, 0.5f)},
                                           {"b", {6}, std::vector<float>(6, -1.0f)},
                                           {"v", {16, 12}, std::vector<float>(192, 0.25f)}};
  on_fresh_thread([&] { ASSERT_THAT(s->SetState(params), IsOk()); });
  std::vector<TensorWrite> grads;
  for (const TensorPlacement& t : s->layout().tensors) {
    std::string bytes(static_cast<size_t>(t.size_bytes), '\0');
    for (size_t k = 0; k + 1 < bytes.size(); k += 2) bytes[k + 1] = 0x3c;  // small positives
    grads.push_back({t.name, 0, bytes});
  }
  on_fresh_thread([&] { ASSERT_THAT(s->ApplyGradientWrites(grads), IsOk()); });
  for (int64_t k = 1; k <= 3; ++k) {
    on_fresh_thread([&] {
      StepRequest r;
      r.step_index = k;
      auto step = m->Step(s->id(), r);
      ASSERT_THAT(step, IsOk());
      EXPECT_FALSE(step->skipped);
      EXPECT_GT(step->compute_micros, 0);
    });
  }
  std::string path;
  on_fresh_thread([&] {
    auto state = s->GetState(/*include_parameters=*/true);
    ASSERT_THAT(state, IsOk());
    EXPECT_NE((*state)[0].data, params[0].data);  // the steps changed the weights
    auto saved = m->SaveCheckpoint(s->id(), "");
    ASSERT_THAT(saved, IsOk());
    path = saved->first;
  });
  on_fresh_thread([&] { ASSERT_THAT(m->Close(s->id()), IsOk()); });
  on_fresh_thread([&] {
    auto loaded = m->LoadCheckpoint(path);
    ASSERT_THAT(loaded, IsOk());
    EXPECT_EQ((*loaded)->last_step_index(), 3);
  });
  EXPECT_EQ(kernels::CpuParallelCallerThreads() - before, 1)
      << "an API ran CPU ops on its caller's thread instead of the compute thread";
}

// Found by session_fuzz: Step echoed an unknown group_step name raw.
TEST(SessionManager, StepEchoesGroupNamesOnOneLine) {
  auto m = SessionManager::Create({});
  ASSERT_THAT(m, IsOk());
  auto s = (*m)->CreateSession(SmallSpec());
  ASSERT_THAT(s, IsOk());
  StepRequest r;
  r.step_index = 1;
  r.group_step["no\npe"] = 0;
  auto step = (*m)->Step((*s)->id(), r);
  EXPECT_THAT(step.status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no?pe")));
  EXPECT_EQ(std::string(step.status().message()).find('\n'), std::string::npos);
  EXPECT_EQ((*s)->last_step_index(), 0);
}

TEST(SessionManager, CheckpointsAreRecordedAndFailuresReported) {
  std::string dir = TempDir();
  ManagerOptions o;
  o.state_dir = dir;
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  std::vector<std::string> failed;
  int written = 0;
  ManagerObserver obs;
  obs.on_checkpoint = [&](const std::string&, const std::string&, int64_t) { ++written; };
  obs.on_checkpoint_failed = [&](const std::string& id, const absl::Status&) {
    failed.push_back(id);
  };
  auto m = SessionManager::Create(o, obs);
  ASSERT_THAT(m, IsOk());
  auto s = (*m)->CreateSession(SmallSpec());
  ASSERT_THAT(s, IsOk());
  const std::string id = (*s)->id();
  SessionInfo fresh = (*m)->List()[0];
  EXPECT_EQ(fresh.last_checkpoint_step, 0);
  EXPECT_TRUE(fresh.last_checkpoint_path.empty());
  EXPECT_EQ(fresh.last_step_time, absl::InfinitePast());
  ASSERT_EQ(fresh.groups.size(), 2u);
  EXPECT_EQ(fresh.groups[0].name, "m");
  EXPECT_EQ(fresh.groups[0].algorithm, optim::AlgorithmKind::kMuon);
  EXPECT_EQ(fresh.groups[0].parameters, 1);
  EXPECT_EQ(fresh.groups[1].algorithm, optim::AlgorithmKind::kAdamW);

  ASSERT_THAT((*s)->SetState({{"w", {8, 6}, std::vector<float>(48, 0.5f)},
                              {"b", {6}, std::vector<float>(6, -1.0f)}}),
              IsOk());
  auto saved = (*m)->SaveCheckpoint(id, "");
  ASSERT_THAT(saved, IsOk());
  SessionInfo info = (*m)->List()[0];
  EXPECT_EQ(info.last_checkpoint_path, saved->first);
  EXPECT_NE(info.last_checkpoint_time, absl::InfinitePast());
  EXPECT_EQ(written, 1);

  // An unknown session is the request's fault, not a checkpoint failure.
  EXPECT_THAT((*m)->SaveCheckpoint("s-none", ""), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(failed.empty());
  // A directory that cannot be written (a regular file in its place) is a failure, reported.
  const std::string blocked = dir + "/blocked";
  FILE* f = std::fopen(blocked.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_FALSE((*m)->SaveCheckpoint(id, blocked).ok());
  EXPECT_EQ(failed, std::vector<std::string>{id});
  EXPECT_EQ(written, 1);
}

TEST(SessionManager, IdleReaperWithoutStateDirJustCloses) {
  ManagerOptions o;
  o.idle_timeout = absl::Hours(1);
  std::vector<std::string> reaped;
  ManagerObserver obs;
  obs.on_session_reaped = [&](const std::string& id, const std::string& reason) {
    reaped.push_back(id + " " + reason);
  };
  auto m = SessionManager::Create(o, obs);
  ASSERT_THAT(m, IsOk());
  auto s = (*m)->CreateSession(SmallSpec());
  ASSERT_THAT(s, IsOk());
  (*m)->ReapIdleSessions(absl::Now() + absl::Hours(2));
  EXPECT_TRUE((*m)->List().empty());
  EXPECT_EQ(reaped, std::vector<std::string>{(*s)->id() + " idle"});
}

// A trainer process for the orphan reaper: a forked child that sleeps until Kill().
class Trainer {
 public:
  Trainer() {
    pid_ = fork();
    if (pid_ == 0) {
      for (;;) pause();
    }
    id_ = IdentifyProcess(pid_);
  }
  ~Trainer() { Kill(); }
  const ProcessId& id() const { return id_; }
  // SIGKILL and reap: from then on the process is gone for every way of looking.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  ProcessId id_;
};

std::set<std::string> Ids(SessionManager& m) {
  std::set<std::string> ids;
  for (const SessionInfo& s : m.List()) ids.insert(s.id);
  return ids;
}

// The reaper thread looks with the real clock and a grace of an hour never fires during a test;
// the calls below pass their own `now`.
ManagerOptions OrphanOptions() {
  ManagerOptions o;
  o.orphan_grace = absl::Hours(1);
  return o;
}

TEST(SessionManager, AnOrphanIsClosedAfterTheGraceAndCheckpointedFirst) {
  ManagerOptions o = OrphanOptions();
  o.state_dir = TempDir();
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  std::vector<std::string> reaped;
  ManagerObserver obs;
  obs.on_session_reaped = [&](const std::string& id, const std::string& reason) {
    reaped.push_back(id + " " + reason);
  };
  auto m = SessionManager::Create(o, obs);
  ASSERT_THAT(m, IsOk());
  Trainer crashing, living;
  ASSERT_TRUE(crashing.id().known());
  ASSERT_TRUE(living.id().known());
  auto orphan = (*m)->CreateSession(SmallSpec(), crashing.id());
  auto alive = (*m)->CreateSession(SmallSpec(), living.id());
  auto tcp = (*m)->CreateSession(SmallSpec());  // no known process: a TCP or in-process caller
  SessionSpec world_spec = SmallSpec();
  world_spec.world_key = "job";  // a world of one: no daemon world attached
  auto world = (*m)->CreateSession(world_spec, crashing.id());
  SessionSpec named_spec = SmallSpec();
  named_spec.session_name = "job/rank-0";
  auto named = (*m)->CreateSession(named_spec, crashing.id());
  for (auto* s : {&orphan, &alive, &tcp, &world, &named}) ASSERT_THAT(*s, IsOk());
  const std::vector<NamedTensor> params = {{"w", {8, 6}, std::vector<float>(48, 0.5f)},
                                           {"b", {6}, std::vector<float>(6, -1.0f)}};
  ASSERT_THAT((*orphan)->SetState(params), IsOk());
  const std::string id = (*orphan)->id();

  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).size(), 5u) << "no process has exited yet";

  crashing.Kill();
  const absl::Time t1 = absl::Now();
  (*m)->ReapOrphanSessions(t1);  // found orphaned now: the grace starts
  (*m)->ReapOrphanSessions(t1 + absl::Minutes(59));
  EXPECT_EQ(Ids(**m).size(), 5u) << "within the grace";
  EXPECT_TRUE(reaped.empty());
  (*m)->ReapOrphanSessions(t1 + absl::Minutes(61));
  EXPECT_EQ(Ids(**m),
            (std::set<std::string>{(*alive)->id(), (*tcp)->id(), (*world)->id(), (*named)->id()}));
  EXPECT_EQ(reaped, std::vector<std::string>{id + " orphan"});
  // Checkpointed before the close, as the idle reaper does.
  auto latest = LatestCheckpoint(o.state_dir, id);
  ASSERT_THAT(latest, IsOk());
  auto restored = (*m)->LoadCheckpoint(*latest);
  ASSERT_THAT(restored, IsOk());
  auto state = (*restored)->GetState(/*include_parameters=*/true);
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ((*state)[0].data, params[0].data);
  // Nobody is left to re-attach: --recover does not bring it back (its checkpoints stay).
  EXPECT_TRUE(SessionMarkedClosed(o.state_dir, id));
  // The others stay, however long: a live trainer, an unknown one, a world session, a named
  // session (--orphan_grace_named=0).
  (*m)->ReapOrphanSessions(t1 + absl::Hours(100));
  EXPECT_EQ(Ids(**m).count((*alive)->id()) + Ids(**m).count((*tcp)->id()) +
                Ids(**m).count((*world)->id()) + Ids(**m).count((*named)->id()),
            4u);
  EXPECT_EQ(reaped.size(), 1u);
}

TEST(SessionManager, ANamedOrphanFollowsItsOwnGraceAndAnAttacherKeepsIt) {
  ManagerOptions o = OrphanOptions();
  o.orphan_grace_named = absl::Hours(3);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  SessionSpec spec = SmallSpec();
  spec.session_name = "job/rank-0";
  Trainer first;
  auto s = (*m)->CreateSession(spec, first.id());
  ASSERT_THAT(s, IsOk());
  const std::string id = (*s)->id();
  first.Kill();
  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).count(id), 1u) << "--orphan_grace_named, not --orphan_grace, applies";
  // A restarted trainer re-attaches: it owns the session now.
  Trainer second;
  ASSERT_THAT((*m)->Attach("job/rank-0", "", {}, /*admin=*/true, second.id()), IsOk());
  (*m)->ReapOrphanSessions(t0 + absl::Hours(10));
  EXPECT_EQ(Ids(**m).count(id), 1u) << "the attacher lives";
  second.Kill();
  const absl::Time t1 = absl::Now() + absl::Hours(10);
  (*m)->ReapOrphanSessions(t1);
  (*m)->ReapOrphanSessions(t1 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).count(id), 1u);
  (*m)->ReapOrphanSessions(t1 + absl::Hours(4));
  EXPECT_EQ(Ids(**m).count(id), 0u) << "both trainers exited";
}

TEST(SessionManager, AnUnknownAttacherExemptsTheSession) {
  ManagerOptions o = OrphanOptions();
  o.orphan_grace_named = absl::Hours(1);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  SessionSpec spec = SmallSpec();
  spec.session_name = "job/rank-0";
  Trainer local;
  auto s = (*m)->CreateSession(spec, local.id());
  ASSERT_THAT(s, IsOk());
  // Attached over TCP: nobody can tell when that trainer is gone.
  ASSERT_THAT((*m)->Attach("job/rank-0", "", {}, /*admin=*/true), IsOk());
  local.Kill();
  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(5));
  EXPECT_EQ(Ids(**m).count((*s)->id()), 1u);
}

// A trainer that forked: its child uses the session over a connection of its own and is noted
// at its first call; the session lives while either lives.
TEST(SessionManager, AProcessThatUsesTheSessionKeepsItAlive) {
  auto m = SessionManager::Create(OrphanOptions());
  ASSERT_THAT(m, IsOk());
  Trainer parent, child;
  auto s = (*m)->CreateSession(SmallSpec(), parent.id());
  ASSERT_THAT(s, IsOk());
  const std::string id = (*s)->id();
  (*m)->NoteProcess(id, child.id());
  (*m)->NoteProcess(id, ProcessId{});       // an unknown caller changes nothing
  (*m)->NoteProcess("s-none", child.id());  // nor does an unknown session
  parent.Kill();
  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).count(id), 1u) << "the child lives";
  child.Kill();
  const absl::Time t1 = absl::Now() + absl::Hours(2);
  (*m)->ReapOrphanSessions(t1);
  (*m)->ReapOrphanSessions(t1 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).count(id), 0u);
}

// A call that still comes after the last process exited (a forked child on its parent's
// connection is seen as its parent) restarts the grace.
TEST(SessionManager, TheGraceCountsFromTheLastUse) {
  auto m = SessionManager::Create(OrphanOptions());
  ASSERT_THAT(m, IsOk());
  Trainer trainer;
  auto s = (*m)->CreateSession(SmallSpec(), trainer.id());
  ASSERT_THAT(s, IsOk());
  trainer.Kill();
  (*m)->ReapOrphanSessions(absl::Now() - absl::Hours(5));  // orphaned long ago
  ASSERT_THAT((*s)->SetState({{"b", {6}, std::vector<float>(6, 1.0f)}}), IsOk());  // used now
  const absl::Time used = absl::Now();
  (*m)->ReapOrphanSessions(used + absl::Minutes(30));
  EXPECT_EQ(Ids(**m).count((*s)->id()), 1u);
  (*m)->ReapOrphanSessions(used + absl::Minutes(61));
  EXPECT_EQ(Ids(**m).count((*s)->id()), 0u);
}

TEST(SessionManager, AnOrphanWhoseCheckpointFailsIsKeptAndTriedAgainAGraceLater) {
  ManagerOptions o = OrphanOptions();
  o.state_dir = TempDir();
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  Trainer trainer;
  auto s = (*m)->CreateSession(SmallSpec(), trainer.id());
  ASSERT_THAT(s, IsOk());
  ASSERT_THAT((*s)->SetState({{"w", {8, 6}, std::vector<float>(48, 0.5f)},
                              {"b", {6}, std::vector<float>(6, -1.0f)}}),
              IsOk());
  const std::string id = (*s)->id();
  // A regular file where the session's checkpoint directory goes: the checkpoint fails.
  const std::string blocker = o.state_dir + "/" + id;
  FILE* f = std::fopen(blocker.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  trainer.Kill();
  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2));
  EXPECT_EQ(Ids(**m).count(id), 1u) << "no checkpoint, no close";
  ASSERT_EQ(std::remove(blocker.c_str()), 0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2) + absl::Minutes(30));
  EXPECT_EQ(Ids(**m).count(id), 1u) << "the next try waits a grace";
  (*m)->ReapOrphanSessions(t0 + absl::Hours(3) + absl::Minutes(1));
  EXPECT_EQ(Ids(**m).count(id), 0u);
  EXPECT_THAT(LatestCheckpoint(o.state_dir, id), IsOk());
}

// A trainer that crashed before it registered its arenas leaves a session without weights:
// nothing a checkpoint could hold, nor lose. It is closed without one (the idle reaper too).
TEST(SessionManager, AReapedSessionThatNeverHeldWeightsIsClosedWithoutACheckpoint) {
  ManagerOptions o = OrphanOptions();
  o.idle_timeout = absl::Hours(1);
  o.state_dir = TempDir();
  o.checkpoints = std::make_shared<checkpoint::DirectoryStore>(o.state_dir);
  auto m = SessionManager::Create(o);
  ASSERT_THAT(m, IsOk());
  Trainer trainer;
  auto orphan = (*m)->CreateSession(SmallSpec(), trainer.id());
  auto idle = (*m)->CreateSession(SmallSpec());
  ASSERT_THAT(orphan, IsOk());
  ASSERT_THAT(idle, IsOk());
  EXPECT_FALSE((*orphan)->HoldsParameters());
  trainer.Kill();
  const absl::Time t0 = absl::Now();
  (*m)->ReapOrphanSessions(t0);
  (*m)->ReapOrphanSessions(t0 + absl::Hours(2));
  EXPECT_EQ(Ids(**m), std::set<std::string>{(*idle)->id()});
  EXPECT_FALSE(LatestCheckpoint(o.state_dir, (*orphan)->id()).ok());
  (*m)->ReapIdleSessions(t0 + absl::Hours(2));
  EXPECT_TRUE(Ids(**m).empty());
}

TEST(SessionManager, TheOrphanGraceMustNotBeNegative) {
  ManagerOptions o;
  o.orphan_grace = absl::Seconds(-1);
  EXPECT_THAT(SessionManager::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--orphan_grace")));
}

TEST(SessionManager, CheckpointEveryNeedsStateDir) {
  ManagerOptions o;
  o.checkpoint_every = 2;
  EXPECT_THAT(SessionManager::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--state_dir")));
}

TEST(Checkpoint, SpecSurvivesJson) {
  SessionSpec spec = SmallSpec();
  spec.groups[0].config.hyperparams.nesterov = true;
  spec.groups[0].config.split_sizes = {4, 4};
  spec.groups[0].config.precision = optim::Precision::kBf16Reference;
  spec.non_finite = NonFinitePolicy::kError;
  auto back = SpecFromJson(SpecToJson(spec));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(SpecToJson(*back), SpecToJson(spec));
  EXPECT_TRUE(back->groups[0].config.hyperparams.nesterov);
  EXPECT_EQ(back->groups[0].config.split_sizes, (std::vector<int64_t>{4, 4}));
  EXPECT_THAT(SpecFromJson("{not json"), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(Checkpoint, SpecFromJsonNamesTheBadField) {
  const std::string good = SpecToJson(SmallSpec());
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) t.replace(at, from.size(), to);
    return t;
  };
  EXPECT_THAT(SpecFromJson(edit("\"lr\": 0.01", "\"lr\": \"abc\"")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("groups[0].lr: expected a number, got string")));
  EXPECT_THAT(SpecFromJson(edit("\"dtype\": \"f32\"", "\"dtype\": \"f64\"")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("params[0].dtype: 'f64'")));
  EXPECT_THAT(SpecFromJson(edit("\"nesterov\": false", "\"nesterov\": 1")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("groups[0].nesterov")));
  EXPECT_THAT(SpecFromJson(edit("\"num_heads\": 1", "\"num_heads\": -3")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("num_heads: -3 is out of range")));
  EXPECT_THAT(SpecFromJson(edit("\"fp32_master_weights\": false,", "")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("fp32_master_weights: missing")));
  EXPECT_THAT(SpecFromJson(std::string(100000, '[') + std::string(100000, ']')),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("nested")));
}

TEST(Checkpoint, JsonDepthSkipsStringsAndStopsAtTheLimit) {
  EXPECT_EQ(JsonDepth("{\"a\": [1, {\"b\": []}]}", 32), 4);
  EXPECT_EQ(JsonDepth("{\"a\": \"[[[[{{{{\\\"[[[\"}", 32), 1);
  EXPECT_EQ(JsonDepth(std::string(1000000, '['), 32), 33);
}

TEST(SessionNames, ValidNamesAndWhyOthersAreRefused) {
  for (const char* ok : {"job-17/rank-0", "a", "x.y_z-1/2/3"}) {
    EXPECT_THAT(ValidateSessionName(ok), IsOk()) << ok;
  }
  EXPECT_THAT(ValidateSessionName(""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateSessionName(std::string(201, 'a')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("201 bytes")));
  for (const char* bad : {"a//b", "/a", "a/", "a/../b", "./a", "a b", "a\n"}) {
    EXPECT_THAT(ValidateSessionName(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

// Found by manifest_fuzz: a control character in a session name reached the message raw.
TEST(SessionNames, TheRefusalStaysOneLine) {
  absl::Status s = ValidateSessionName("runs/line\nbreak\r\x1b[31m");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("runs/line?break")));
  EXPECT_EQ(std::string(s.message()).find_first_of("\n\r\x1b"), std::string::npos) << s;
}

TEST(SessionManager, AttachKeepsTheWeightsAndChecksTheOwnerHook) {
  auto m = SessionManager::Create({});
  ASSERT_THAT(m, IsOk());
  SessionSpec spec = SmallSpec();
  spec.session_name = "job/0";
  spec.owner = "uid:1000";
  auto s = (*m)->CreateSession(spec);
  ASSERT_THAT(s, IsOk());
  EXPECT_THAT((*m)->CreateSession(spec), StatusIs(absl::StatusCode::kAlreadyExists));
  std::vector<NamedTensor> params = {{"w", {8, 6}, std::vector<float>(48, 0.25f)},
                                     {"b", {6}, std::vector<float>(6, 2.0f)}};
  ASSERT_THAT((*s)->SetState(params), IsOk());
  EXPECT_THAT((*m)->Attach("job/0", "uid:1001"), StatusIs(absl::StatusCode::kPermissionDenied));
  std::vector<ParamSpec> other = spec.params;
  other[0].shape = {6, 8};
  EXPECT_THAT((*m)->Attach("job/0", "uid:1000", other),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("[6,8]")));
  auto again = (*m)->Attach("job/0", "uid:1000", spec.params);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ((*again)->id(), (*s)->id());
  auto state = (*again)->GetState(/*include_parameters=*/true);
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ((*state)[0].data, params[0].data);
  EXPECT_THAT((*m)->Attach("job/1", ""), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_THAT((*m)->Close((*s)->id()), IsOk());
  EXPECT_THAT((*m)->CreateSession(spec), IsOk());  // the name is free again
}

TEST(SessionManager, SessionStateLivesOnTheComputeDeviceItIsGiven) {
  // The daemon's compute device reaches the sessions: a manager on the test device (the recording
  // backend, forwarding to the CPU's table) makes every session a device session, whose staging is
  // allocated through that device's table (and its state too once the rules run on devices,
  // DeviceRuntime::rules_on_device); a manager on the CPU calls nothing of the test device.
  using kernels::testing::RecordingBackend;
  ASSERT_THAT(RecordingBackend::Install(kernels::FindOpsBackend(kernels::DeviceType::kCpu)),
              IsOk());
  std::map<kernels::DeviceType, std::vector<std::string>> log;
  std::map<kernels::DeviceType, int64_t> state_bytes;
  for (kernels::DeviceType type : {kernels::DeviceType::kTest, kernels::DeviceType::kCpu}) {
    ManagerOptions o;
    o.compute_device.type = type;
    auto m = SessionManager::Create(o);
    ASSERT_THAT(m, IsOk());
    RecordingBackend::ClearLog();
    auto s = (*m)->CreateSession(SmallSpec());
    ASSERT_THAT(s, IsOk());
    log[type] = RecordingBackend::Log();
    state_bytes[type] = (*s)->StateBytes();
  }
  RecordingBackend::Uninstall();
  // Muon's momentum and AdamW's m, v and step_dev: one buffer per state of each shape bucket.
  EXPECT_THAT(log[kernels::DeviceType::kTest], Contains("allocate"));
  EXPECT_TRUE(log[kernels::DeviceType::kCpu].empty())
      << log[kernels::DeviceType::kCpu].size() << " calls on the test device";
  EXPECT_EQ(state_bytes[kernels::DeviceType::kTest], 244);
  EXPECT_EQ(state_bytes[kernels::DeviceType::kCpu], 244);
}

}  // namespace
}  // namespace diond::session
