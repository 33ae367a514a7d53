// Load: 8 sessions x 200 steps from 8 concurrent client threads against one real daemon, over
// shm (half of the sessions with one segment for both arenas, half with two). Requires
//  - every session's final parameters and state equal, bit for bit, an in-process replay;
//  - no leaked mappings: while the sessions live the daemon maps our segments (so the probe
//    sees them); after they are closed (half unregister their regions first, half just close)
//    no mapping of our segments remains in /proc/<pid>/maps and the file-backed mappings are
//    exactly those after an identical warm-up round;
//  - every segment unlinked from /dev/shm.
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

constexpr int kSessions = 8;

// Lets the main thread inspect the daemon while all sessions are alive.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void ArriveAndWait() {
    std::unique_lock<std::mutex> l(mu_);
    if (++arrived_ == n_) cv_.notify_all();
    cv_.wait(l, [&] { return released_; });
  }
  void WaitForAll() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return arrived_ == n_; });
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  bool released_ = false;
};

// Small shapes of every family, so 1600 steps take seconds on 2 cores.
SessionDesc DescFor(int i) {
  SessionDesc d;
  switch (i % 4) {
    case 0:
      d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
      d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
      d.params = {{"w", {16, 12}, "m"}, {"v", {12, 16}, "m"}, {"b", {12}, "a"}};
      break;
    case 1:
      d.groups.push_back(MakeGroup("n", optim::AlgorithmKind::kNorMuon, 0.02));
      d.params = {{"w", {12, 16}, "n"}};
      break;
    case 2:
      d.groups.push_back(MakeGroup("d", optim::AlgorithmKind::kDion, 0.02));
      d.groups.push_back(MakeGroup("l", optim::AlgorithmKind::kLion, 0.001));
      d.params = {{"w", {16, 16}, "d"}, {"b", {8}, "l"}};
      break;
    default:
      d.groups.push_back(MakeGroup("d2", optim::AlgorithmKind::kDion2, 0.02));
      d.groups.push_back(MakeGroup("d3", optim::AlgorithmKind::kNorDion2, 0.02));
      d.params = {{"w", {24, 8}, "d2"}, {"x", {8, 24}, "d3"}};
      break;
  }
  return d;
}

struct Outcome {
  std::string error;
  TensorMap state;  // GetState(include_parameters) after the last step
};

std::vector<std::string> Maps(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

// File-backed mappings (path names, without addresses), sorted.
std::vector<std::string> FileMappings(pid_t pid) {
  std::vector<std::string> out;
  for (const std::string& l : Maps(pid)) {
    std::istringstream fields(l);
    std::string addr, perms, offset, dev, inode, path;
    fields >> addr >> perms >> offset >> dev >> inode;
    std::getline(fields >> std::ws, path);
    if (!path.empty() && path[0] != '[') out.push_back(perms + " " + path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::set<std::string> ShmMappings(pid_t pid) {
  std::set<std::string> out;
  for (const std::string& l : Maps(pid)) {
    if (absl::StrContains(l, kShmPrefix)) out.insert(l.substr(l.find(kShmPrefix)));
  }
  return out;
}

// One client: create, bind, upload, `steps` steps, record, then close (unregistering first when
// `unregister`).
void Client(Daemon* daemon, int i, int64_t steps, Barrier* barrier, Outcome* out) {
  const SessionDesc d = DescFor(i);
  auto fail = [&](const std::string& what, const grpc::Status& st) {
    out->error = absl::StrCat("session ", i, ": ", what, ": ", st.error_message());
  };
  auto s = CreateShmSession(daemon->stub(), d.Request(), /*two_segments=*/i % 2 == 1);
  if (s == nullptr) {
    out->error = "CreateShmSession failed";
    barrier->ArriveAndWait();
    return;
  }
  std::vector<Chunk> init;
  for (size_t p = 0; p < d.params.size(); ++p) {
    init.push_back({d.params[p].name, 0, FloatBytes(SyntheticValues(100 + i, 0, p, d.Numel(p)))});
  }
  grpc::Status st = SetState(daemon->stub(), s->id, init);
  if (!st.ok()) fail("SetState", st);
  for (int64_t t = 1; t <= steps && out->error.empty(); ++t) {
    for (size_t p = 0; p < d.params.size(); ++p) {
      s->WriteGrad(p, SyntheticValues(200 + i, t, p, d.Numel(p)));
    }
    v1::StepResponse resp;
    st = DoStep(daemon->stub(), s->id, t, &resp);
    if (!st.ok()) fail(absl::StrCat("Step ", t), st);
    if (resp.skipped()) out->error = absl::StrCat("session ", i, ": step ", t, " skipped");
  }
  if (out->error.empty()) {
    st = GetState(daemon->stub(), s->id, true, &out->state);
    if (!st.ok()) fail("GetState", st);
  }
  barrier->ArriveAndWait();
  if (i % 2 == 0) {
    for (const std::string& region : {s->param_region, s->grad_region}) {
      v1::UnregisterRegionRequest r;
      r.set_session_id(s->id);
      r.set_region_id(region);
      v1::UnregisterRegionResponse resp;
      st = daemon->stub().UnregisterRegion(Ctx().get(), r, &resp);
      if (!st.ok()) fail("UnregisterRegion", st);
    }
  }
  st = CloseSession(daemon->stub(), s->id);
  if (!st.ok()) fail("CloseSession", st);
}

// Runs kSessions concurrent clients; `during` runs while all sessions are alive.
std::vector<Outcome> Round(Daemon* daemon, int64_t steps, const std::function<void()>& during) {
  std::vector<Outcome> outcomes(kSessions);
  Barrier barrier(kSessions);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back(Client, daemon, i, steps, &barrier, &outcomes[i]);
  }
  barrier.WaitForAll();
  during();
  barrier.Release();
  for (auto& t : threads) t.join();
  return outcomes;
}

TEST(Load, EightConcurrentSessionsAreCorrectAndLeakNoMappings) {
  auto daemon = Daemon::Start();
  ASSERT_NE(daemon, nullptr);
  // Warm-up round: whatever the daemon maps once and keeps (lazily loaded code, caches) is in
  // place before the reference snapshot of its file-backed mappings.
  for (const Outcome& o : Round(daemon.get(), 5, [] {})) ASSERT_EQ(o.error, "");
  const std::vector<std::string> files_before = FileMappings(daemon->pid());
  ASSERT_TRUE(ShmMappings(daemon->pid()).empty());

  std::set<std::string> during;
  const std::vector<Outcome> outcomes =
      Round(daemon.get(), 200, [&] { during = ShmMappings(daemon->pid()); });
  // 8 sessions, 4 with one segment and 4 with two: 12 segments mapped by the daemon (regions in
  // the same segment may share a line or not, depending on page alignment).
  std::set<std::string> segments;
  for (const std::string& m : during) segments.insert(m.substr(0, m.find(' ')));
  EXPECT_EQ(segments.size(), 12u);

  EXPECT_TRUE(ShmMappings(daemon->pid()).empty()) << "the daemon still maps closed sessions' shm";
  // Every region is a file-backed (shm) mapping, so a leaked region shows here; anonymous
  // mappings are left out because malloc arenas and gRPC thread stacks grow with concurrency
  // on their own schedule (observed: +4..+9 anonymous entries between identical rounds).
  EXPECT_EQ(FileMappings(daemon->pid()), files_before);
  EXPECT_TRUE(LeftoverShmSegments().empty());

  auto ctx = kernels::Context::CpuDefault();
  for (int i = 0; i < kSessions; ++i) {
    SCOPED_TRACE(absl::StrCat("session ", i));
    ASSERT_EQ(outcomes[i].error, "");
    const SessionDesc d = DescFor(i);
    auto r = *Replay::Create(d);
    for (size_t p = 0; p < d.params.size(); ++p) {
      r->params()[p] = SyntheticValues(100 + i, 0, p, d.Numel(p));
    }
    for (int64_t t = 1; t <= 200; ++t) {
      std::vector<std::vector<float>> g;
      for (size_t p = 0; p < d.params.size(); ++p) {
        g.push_back(SyntheticValues(200 + i, t, p, d.Numel(p)));
      }
      ASSERT_TRUE(r->Step(*ctx, g).ok());
    }
    TensorMap state = outcomes[i].state;
    for (size_t p = 0; p < d.params.size(); ++p) {
      EXPECT_EQ(state[d.params[p].name], FloatBytes(r->params()[p])) << d.params[p].name;
      for (const std::string& n : r->StateNames(p)) {
        EXPECT_EQ(state[d.params[p].name + "/state." + n], FloatBytes(*r->GetState(p, n)))
            << d.params[p].name << "/state." << n;
      }
    }
  }
  v1::ListSessionsResponse list;
  ASSERT_TRUE(daemon->stub().ListSessions(Ctx().get(), v1::ListSessionsRequest(), &list).ok());
  EXPECT_EQ(list.sessions_size(), 0);
  EXPECT_TRUE(daemon->Serving());
}

}  // namespace
}  // namespace diond::service_testing
