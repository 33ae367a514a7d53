// The C++ client against the real diond binary: every Optimizer RPC through diond::client, both
// data planes (shm arenas and remote Push/Pull), checkpoints, and error pass-through. One daemon
// serves the whole suite; each test makes its own sessions.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/tests/test_daemon.h"
#include "diond/client.h"
#include "diond/memfd_arena.h"
#include "diond/shm_arena.h"
#include "gtest/gtest.h"

namespace diond::client {
namespace {

constexpr int64_t kRows = 8, kCols = 16;

std::vector<ParamSpec> Params() {
  return {{"w", {kRows, kCols}, DType::kF32, "matrices"}, {"b", {kRows}, DType::kF32, "vectors"}};
}

std::vector<GroupSpec> Groups() {
  GroupSpec m{"matrices", Algorithm::kMuon, {}};
  m.hyperparams.lr = 0.02;
  m.hyperparams.weight_decay = 0.0;
  GroupSpec a{"vectors", Algorithm::kAdamW, {}};
  a.hyperparams.lr = 0.01;
  a.hyperparams.weight_decay = 0.0;
  return {m, a};
}

// Deterministic, non-trivial values.
std::vector<float> Values(size_t n, float scale, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + phase);
  return v;
}

// CPU seconds (user + system) the process `pid` has used so far, from /proc/<pid>/stat; -1 if
// it cannot be read.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos || close + 2 >= stat.size()) return -1;
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  long utime = -1, stime = -1;
  for (int i = 3; i <= 15 && fields >> f; ++i) {  // field 3 is the state
    if (i == 14) utime = std::stol(f);
    if (i == 15) stime = std::stol(f);
  }
  if (utime < 0 || stime < 0) return -1;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

class ClientDaemonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto d = testing::StartTestDaemon(DIOND_BINARY);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    if (daemon_ == nullptr) return;
    EXPECT_EQ(daemon_->Stop(), std::optional<int>(0)) << daemon_->proc->Log();
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    ClientOptions o;
    o.chunk_bytes = 100;  // many chunks per tensor in both directions
    auto c = Client::Connect(daemon_->target, o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // A session with the test parameters, or a test failure.
  Layout NewSession(const std::string& name) {
    auto layout = client_->CreateSession(Params(), Groups(), {name});
    EXPECT_TRUE(layout.ok()) << layout.status() << "\nlog:\n" << daemon_->proc->Log();
    return layout.ok() ? *layout : Layout{};
  }

  static testing::TestDaemon* daemon_;
  std::unique_ptr<Client> client_;
};

testing::TestDaemon* ClientDaemonTest::daemon_ = nullptr;

TEST_F(ClientDaemonTest, HealthAndListSessions) {
  auto h = client_->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, ServingStatus::kServing);
  auto h2 = client_->Health("diond.v1.Optimizer");
  ASSERT_TRUE(h2.ok()) << h2.status();
  EXPECT_EQ(*h2, ServingStatus::kServing);
  EXPECT_TRUE(client_->ListSessions().ok());
}

TEST_F(ClientDaemonTest, CreateSessionReturnsAValidLayoutAndListSessionsShowsIt) {
  Layout layout = NewSession("create-test");
  ASSERT_FALSE(layout.session_id.empty());
  EXPECT_EQ(layout.alignment_bytes, 256);
  const TensorLayout* w = layout.Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->size_bytes, kRows * kCols * 4);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{kRows, kCols}));
  auto sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  bool found = false;
  for (const SessionInfo& s : *sessions) {
    if (s.session_id == layout.session_id) {
      found = true;
      EXPECT_EQ(s.client_name, "create-test");
      EXPECT_EQ(s.parameters, 2);
    }
  }
  EXPECT_TRUE(found);
  ASSERT_TRUE(client_->CloseSession(layout.session_id).ok());
  sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok());
  for (const SessionInfo& s : *sessions) EXPECT_NE(s.session_id, layout.session_id);
}

TEST_F(ClientDaemonTest, DaemonErrorsComeBackWithTheirCodeAndMessage) {
  auto step = client_->Step("no-such-session", 1);
  ASSERT_FALSE(step.ok());
  EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound) << step.status();
  EXPECT_TRUE(absl::StrContains(step.status().message(), "no-such-session")) << step.status();

  std::vector<ParamSpec> bad = Params();
  bad[0].group = "missing-group";
  auto layout = client_->CreateSession(bad, Groups());
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument) << layout.status();
  EXPECT_TRUE(absl::StrContains(layout.status().message(), "missing-group")) << layout.status();
}

// Shm data plane: gradients written into the arena, Step updates the parameters in place.
// Replays and out-of-order steps follow the v1 semantics.
class ShmStepTest : public ClientDaemonTest, public ::testing::WithParamInterface<bool> {};

TEST_P(ShmStepTest, StepUpdatesParametersInPlaceAndIsIdempotent) {
  Layout layout = NewSession("shm-test");
  ASSERT_FALSE(layout.session_id.empty());
  std::vector<std::string> names;
  {
    auto arena = ShmArena::Create(client_.get(), layout, {GetParam()});
    ASSERT_TRUE(arena.ok()) << arena.status();
    EXPECT_FALSE(arena->param_region_id().empty());
    EXPECT_FALSE(arena->grad_region_id().empty());
    for (const auto& s : arena->segments()) names.push_back(s.name);
    auto w = *arena->Param("w");
    auto b = *arena->Param("b");
    auto w0 = Values(w.size(), 0.5f, 0.0f), b0 = Values(b.size(), 0.1f, 1.0f);
    std::copy(w0.begin(), w0.end(), w.begin());
    std::copy(b0.begin(), b0.end(), b.begin());
    auto gw = Values(w.size(), 1.0f, 2.0f), gb = Values(b.size(), 1.0f, 3.0f);
    std::copy(gw.begin(), gw.end(), arena->Grad("w")->begin());
    std::copy(gb.begin(), gb.end(), arena->Grad("b")->begin());

    // The daemon has no weights yet for this session except through the region: upload them
    // explicitly so the test does not depend on whether Step reads initial weights from shm.
    ASSERT_TRUE(client_
                    ->SetState(layout.session_id,
                               {ConstTensorRef::F32("w", w0), ConstTensorRef::F32("b", b0)})
                    .ok());
    auto r1 = client_->Step(layout.session_id, 1);
    ASSERT_TRUE(r1.ok()) << r1.status() << "\n" << daemon_->proc->Log();
    EXPECT_EQ(r1->step_index, 1);
    EXPECT_FALSE(r1->replayed);
    EXPECT_FALSE(r1->skipped);
    EXPECT_GT(r1->update_norms["matrices"], 0.0);
    EXPECT_GT(r1->update_norms["vectors"], 0.0);
    // Parameters moved against the gradient.
    double dot_w = 0;
    for (size_t i = 0; i < w.size(); ++i) dot_w += (w[i] - w0[i]) * gw[i];
    EXPECT_LT(dot_w, 0.0);
    for (size_t i = 0; i < b.size(); ++i) {
      // AdamW's first step moves each element by about lr against the sign of its gradient.
      EXPECT_NEAR(b[i] - b0[i], gb[i] > 0 ? -0.01 : 0.01, 1e-3) << i;
    }
    std::vector<float> w1(w.begin(), w.end());

    auto replay = client_->Step(layout.session_id, 1);
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->replayed);
    EXPECT_EQ(std::vector<float>(w.begin(), w.end()), w1) << "a replay must not apply again";

    auto skip = client_->Step(layout.session_id, 3);
    EXPECT_EQ(skip.status().code(), absl::StatusCode::kFailedPrecondition) << skip.status();
    EXPECT_TRUE(absl::StrContains(skip.status().message(), "2")) << skip.status();

    // The remote path reads the same weights the arena holds.
    std::vector<float> pulled(w.size());
    ASSERT_TRUE(client_
                    ->PullParameters(layout.session_id,
                                     {MutableTensorRef::F32("w", absl::MakeSpan(pulled))})
                    .ok());
    EXPECT_EQ(pulled, w1);
  }
  // The arena unregistered and unlinked its segments on destruction.
  for (const auto& n : names) {
    struct stat st;
    EXPECT_NE(stat(("/dev/shm/" + n).c_str(), &st), 0) << n;
  }
  // A role binds once; the roles are free again, so the unregistration reached the daemon.
  {
    auto again = ShmArena::Create(client_.get(), layout, {GetParam()});
    ASSERT_TRUE(again.ok()) << again.status();
    auto twice = ShmArena::Create(client_.get(), layout);
    EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition) << twice.status();
    EXPECT_EQ(client_->UnregisterRegion(layout.session_id, "no-such-region").code(),
              absl::StatusCode::kNotFound);
  }
  EXPECT_TRUE(client_->CloseSession(layout.session_id).ok());
}

INSTANTIATE_TEST_SUITE_P(SingleAndTwoSegments, ShmStepTest, ::testing::Bool());

// Remote data plane: SetState with the parameters' own names uploads the weights, PushGradients
// the gradients, then Step and PullParameters. It must agree bit for bit with the shm path.
TEST_F(ClientDaemonTest, RemoteModeMatchesShmModeBitForBit) {
  const size_t nw = kRows * kCols, nb = kRows;
  auto w0 = Values(nw, 0.5f, 0.0f), b0 = Values(nb, 0.1f, 1.0f);
  auto gw = Values(nw, 1.0f, 2.0f), gb = Values(nb, 1.0f, 3.0f);

  Layout remote = NewSession("remote");
  ASSERT_FALSE(remote.session_id.empty());
  auto set = client_->SetState(remote.session_id,
                               {ConstTensorRef::F32("w", w0), ConstTensorRef::F32("b", b0)});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, 2);
  auto pushed = client_->PushGradients(
      remote.session_id, {ConstTensorRef::F32("w", gw), ConstTensorRef::F32("b", gb)});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->bytes_received(), static_cast<int64_t>((nw + nb) * 4));
  // 512 bytes of w in chunks of 100 -> 6, 32 bytes of b -> 1.
  EXPECT_EQ(pushed->chunks(), 7);
  ASSERT_TRUE(client_->Step(remote.session_id, 1).ok());
  auto pulled = client_->PullParameters(remote.session_id);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ASSERT_EQ(pulled->count("w"), 1u);
  EXPECT_EQ((*pulled)["w"].shape, (std::vector<int64_t>{kRows, kCols}));
  EXPECT_EQ((*pulled)["w"].dtype, DType::kF32);

  Layout shm = NewSession("shm-twin");
  auto arena = ShmArena::Create(client_.get(), shm);
  ASSERT_TRUE(arena.ok()) << arena.status();
  std::copy(w0.begin(), w0.end(), arena->Param("w")->begin());
  std::copy(b0.begin(), b0.end(), arena->Param("b")->begin());
  std::copy(gw.begin(), gw.end(), arena->Grad("w")->begin());
  std::copy(gb.begin(), gb.end(), arena->Grad("b")->begin());
  ASSERT_TRUE(
      client_
          ->SetState(shm.session_id, {ConstTensorRef::F32("w", w0), ConstTensorRef::F32("b", b0)})
          .ok());
  ASSERT_TRUE(client_->Step(shm.session_id, 1).ok());
  auto w_shm = *arena->Param("w");
  EXPECT_EQ((*pulled)["w"].AsF32(), std::vector<float>(w_shm.begin(), w_shm.end()));
  auto b_shm = *arena->Param("b");
  EXPECT_EQ((*pulled)["b"].AsF32(), std::vector<float>(b_shm.begin(), b_shm.end()));

  // An incomplete push changes nothing and is rejected.
  auto half = absl::MakeConstSpan(gw).subspan(0, nw / 2);
  auto bad = client_->PushGradients(remote.session_id, {ConstTensorRef::F32("w", half)});
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(client_->CloseSession(remote.session_id).ok());
  arena->Reset();
  EXPECT_TRUE(client_->CloseSession(shm.session_id).ok());
}

// MemfdArena (a sealed memfd over the daemon's fd channel) against ShmArena: five steps of the
// same run give the same bytes; the memfd cannot be resized by the trainer once registered.
TEST_F(ClientDaemonTest, MemfdArenaMatchesShmArenaBitForBit) {
  const size_t nw = kRows * kCols, nb = kRows;
  Layout shm = NewSession("shm-ref");
  Layout mem = NewSession("memfd");
  ASSERT_TRUE(mem.memfd_regions) << "the test daemon offers no MEMFD regions";
  EXPECT_FALSE(mem.fd_channel_socket.empty());
  auto a = ShmArena::Create(client_.get(), shm);
  ASSERT_TRUE(a.ok()) << a.status();
  auto m = MemfdArena::Create(client_.get(), mem);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->param_region_id().empty());
  EXPECT_FALSE(m->grad_region_id().empty());
  EXPECT_NE(ftruncate(m->fd(), 0), 0) << "a registered memfd must be sealed against shrinking";
  auto w0 = Values(nw, 0.5f, 0.0f), b0 = Values(nb, 0.1f, 1.0f);
  std::copy(w0.begin(), w0.end(), a->Param("w")->begin());
  std::copy(w0.begin(), w0.end(), m->Param("w")->begin());
  std::copy(b0.begin(), b0.end(), a->Param("b")->begin());
  std::copy(b0.begin(), b0.end(), m->Param("b")->begin());
  for (int64_t t = 1; t <= 5; ++t) {
    auto gw = Values(nw, 1.0f, 2.0f + static_cast<float>(t));
    auto gb = Values(nb, 1.0f, 3.0f * static_cast<float>(t));
    std::copy(gw.begin(), gw.end(), a->Grad("w")->begin());
    std::copy(gw.begin(), gw.end(), m->Grad("w")->begin());
    std::copy(gb.begin(), gb.end(), a->Grad("b")->begin());
    std::copy(gb.begin(), gb.end(), m->Grad("b")->begin());
    ASSERT_TRUE(client_->Step(shm.session_id, t).ok());
    auto st = client_->Step(mem.session_id, t);
    ASSERT_TRUE(st.ok()) << st.status();
    for (const char* name : {"w", "b"}) {
      auto x = *a->ParamBytes(name), y = *m->ParamBytes(name);
      ASSERT_EQ(std::string(x.begin(), x.end()), std::string(y.begin(), y.end()))
          << name << " step " << t;
    }
  }
  EXPECT_NE(std::vector<float>(m->Param("w")->begin(), m->Param("w")->end()), w0);
  // RAII: moving keeps the regions; Reset unregisters them.
  MemfdArena moved = *std::move(m);
  EXPECT_FALSE(moved.param_region_id().empty());
  moved.Reset();
  EXPECT_FALSE(moved.Param("w").ok());
  auto again = MemfdArena::Create(client_.get(), mem);  // the roles are free again
  EXPECT_TRUE(again.ok()) << again.status();
  again->Reset();
  a->Reset();
  EXPECT_TRUE(client_->CloseSession(shm.session_id).ok());
  EXPECT_TRUE(client_->CloseSession(mem.session_id).ok());
}

// Asynchronous Step (StepOptions::asynchronous, WaitStep; docs/DATA_PLANE.md): the same run as
// synchronous steps gives the same bytes and norms; the next Step collects the queued step's
// result (StepResult::previous); a call that touches the arenas while a step is queued is
// refused with FAILED_PRECONDITION naming it.
TEST_F(ClientDaemonTest, AsynchronousStepsMatchSynchronousStepsBitForBit) {
  const size_t nw = kRows * kCols, nb = kRows;
  Layout ref = NewSession("sync-ref");
  Layout as = NewSession("async");
  auto a = ShmArena::Create(client_.get(), ref);
  ASSERT_TRUE(a.ok()) << a.status();
  auto m = ShmArena::Create(client_.get(), as);
  ASSERT_TRUE(m.ok()) << m.status();
  auto w0 = Values(nw, 0.5f, 0.0f), b0 = Values(nb, 0.1f, 1.0f);
  for (ShmArena* x : {&*a, &*m}) {
    std::copy(w0.begin(), w0.end(), x->Param("w")->begin());
    std::copy(b0.begin(), b0.end(), x->Param("b")->begin());
  }
  StepOptions async;
  async.asynchronous = true;
  for (int64_t t = 1; t <= 4; ++t) {
    auto gw = Values(nw, 1.0f, 2.0f + static_cast<float>(t));
    auto gb = Values(nb, 1.0f, 3.0f * static_cast<float>(t));
    for (ShmArena* x : {&*a, &*m}) {
      std::copy(gw.begin(), gw.end(), x->Grad("w")->begin());
      std::copy(gb.begin(), gb.end(), x->Grad("b")->begin());
    }
    auto want = client_->Step(ref.session_id, t);
    ASSERT_TRUE(want.ok()) << want.status();
    auto queued = client_->Step(as.session_id, t, async);
    ASSERT_TRUE(queued.ok()) << queued.status();
    EXPECT_TRUE(queued->queued);
    EXPECT_EQ(queued->step_index, t);
    EXPECT_TRUE(queued->previous.empty());
    absl::StatusOr<StepResult> done;
    if (t % 2 == 1) {
      done = client_->WaitStep(as.session_id);
    } else {
      // While the step is queued, a call touching the arenas is refused.
      EXPECT_EQ(client_->UnregisterRegion(as.session_id, m->param_region_id()).code(),
                absl::StatusCode::kFailedPrecondition);
      done = client_->WaitStep(as.session_id, t);
    }
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(done->queued);
    EXPECT_EQ(done->step_index, t);
    EXPECT_EQ(done->update_norms, want->update_norms) << "step " << t;
    for (const char* name : {"w", "b"}) {
      auto x = *a->ParamBytes(name), y = *m->ParamBytes(name);
      ASSERT_EQ(std::string(x.begin(), x.end()), std::string(y.begin(), y.end()))
          << name << " step " << t;
    }
  }
  // Pipelined: steps 5 and 6 on unchanged gradients, step 6 collecting step 5.
  auto want5 = client_->Step(ref.session_id, 5);
  auto want6 = client_->Step(ref.session_id, 6);
  ASSERT_TRUE(want5.ok() && want6.ok());
  ASSERT_TRUE(client_->Step(as.session_id, 5, async).ok());
  auto six = client_->Step(as.session_id, 6, async);
  ASSERT_TRUE(six.ok()) << six.status();
  ASSERT_EQ(six->previous.size(), 1u);
  EXPECT_EQ(six->previous[0].step_index, 5);
  EXPECT_EQ(six->previous[0].update_norms, want5->update_norms);
  auto done6 = client_->WaitStep(as.session_id);
  ASSERT_TRUE(done6.ok()) << done6.status();
  EXPECT_EQ(done6->update_norms, want6->update_norms);
  auto x = *a->ParamBytes("w"), y = *m->ParamBytes("w");
  EXPECT_EQ(std::string(x.begin(), x.end()), std::string(y.begin(), y.end()));
  a->Reset();
  m->Reset();
  EXPECT_TRUE(client_->CloseSession(ref.session_id).ok());
  EXPECT_TRUE(client_->CloseSession(as.session_id).ok());
}

TEST_F(ClientDaemonTest, MemfdArenaErrorsKeepTheirCodes) {
  auto none = SendFdToChannel("/nonexistent/diond.sock.fd", 0);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  // A layout without an fd channel (an older daemon, or --fd_channel_socket=none).
  Layout mem = NewSession("memfd-off");
  Layout no_channel = mem;
  no_channel.fd_channel_socket.clear();
  no_channel.memfd_regions = false;
  auto refused = MemfdArena::Create(client_.get(), no_channel);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  // The channel refuses what is no memfd: the daemon's code and message come through.
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  auto token = SendFdToChannel(mem.fd_channel_socket, p[0]);
  ASSERT_TRUE(token.ok()) << token.status();
  auto reg = client_->RegisterMemfdRegion(mem.session_id, v1::REGION_ROLE_PARAMETERS, *token, 0,
                                          mem.param_arena_bytes);
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument) << reg.status();
  EXPECT_TRUE(absl::StrContains(reg.status().message(), "is a pipe")) << reg.status();
  close(p[0]);
  close(p[1]);
  EXPECT_TRUE(client_->CloseSession(mem.session_id).ok());
}

TEST_F(ClientDaemonTest, GetStateSetStateRoundTripAndSetHyperparameters) {
  const size_t nw = kRows * kCols, nb = kRows;
  auto w0 = Values(nw, 0.5f, 0.0f), b0 = Values(nb, 0.1f, 1.0f);
  auto gw = Values(nw, 1.0f, 2.0f), gb = Values(nb, 1.0f, 3.0f);
  auto grads =
      std::vector<ConstTensorRef>{ConstTensorRef::F32("w", gw), ConstTensorRef::F32("b", gb)};
  Layout a = NewSession("state-a");
  ASSERT_TRUE(
      client_->SetState(a.session_id, {ConstTensorRef::F32("w", w0), ConstTensorRef::F32("b", b0)})
          .ok());
  ASSERT_TRUE(client_->PushGradients(a.session_id, grads).ok());
  ASSERT_TRUE(client_->Step(a.session_id, 1).ok());

  auto state = client_->GetState(a.session_id, /*include_parameters=*/true);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->count("w"), 1u);
  EXPECT_EQ(state->count("b"), 1u);
  EXPECT_EQ(state->count("w/state.momentum"), 1u);
  for (const auto& [name, t] : *state) {
    if (name.find("/state.") == std::string::npos) continue;
    EXPECT_FALSE(t.bytes.empty()) << name;
  }

  // A twin session restored from that state takes the same second step.
  Layout b = NewSession("state-b");
  auto set = client_->SetStateFromMap(b.session_id, *state);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, static_cast<int64_t>(state->size()));
  for (const Layout* l : {&a, &b}) {
    ASSERT_TRUE(client_->PushGradients(l->session_id, grads).ok());
  }
  ASSERT_TRUE(client_->Step(a.session_id, 2).ok());
  // b's step counter is not part of the state tensors; its first own step is 1.
  auto step_b = client_->Step(b.session_id, 1);
  ASSERT_TRUE(step_b.ok()) << step_b.status();
  auto pa = client_->PullParameters(a.session_id, {"w"});
  auto pb = client_->PullParameters(b.session_id, {"w"});
  ASSERT_TRUE(pa.ok() && pb.ok());
  EXPECT_EQ((*pa)["w"].bytes, (*pb)["w"].bytes);

  // lr = 0 on both groups: the next step changes nothing (weight decay is 0 too).
  Hyperparams zero;
  zero.lr = 0.0;
  ASSERT_TRUE(client_->SetHyperparameters(a.session_id, "matrices", zero).ok());
  ASSERT_TRUE(client_->SetHyperparameters(a.session_id, "vectors", zero).ok());
  auto bad = client_->SetHyperparameters(a.session_id, "no-such-group", zero);
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.message(), "no-such-group")) << bad;
  auto before = client_->PullParameters(a.session_id);
  ASSERT_TRUE(client_->PushGradients(a.session_id, grads).ok());
  ASSERT_TRUE(client_->Step(a.session_id, 3).ok());
  auto after = client_->PullParameters(a.session_id);
  ASSERT_TRUE(before.ok() && after.ok());
  EXPECT_EQ((*before)["w"].bytes, (*after)["w"].bytes);
  EXPECT_EQ((*before)["b"].bytes, (*after)["b"].bytes);
  EXPECT_TRUE(client_->CloseSession(a.session_id).ok());
  EXPECT_TRUE(client_->CloseSession(b.session_id).ok());
}

TEST_F(ClientDaemonTest, SaveAndLoadCheckpointRestoreWeightsIntoANewArena) {
  const size_t nw = kRows * kCols, nb = kRows;
  auto w0 = Values(nw, 0.5f, 0.0f), b0 = Values(nb, 0.1f, 1.0f);
  Layout a = NewSession("ckpt");
  ASSERT_TRUE(
      client_->SetState(a.session_id, {ConstTensorRef::F32("w", w0), ConstTensorRef::F32("b", b0)})
          .ok());
  ASSERT_TRUE(client_
                  ->PushGradients(a.session_id, {ConstTensorRef::F32("w", Values(nw, 1, 2)),
                                                 ConstTensorRef::F32("b", Values(nb, 1, 3))})
                  .ok());
  ASSERT_TRUE(client_->Step(a.session_id, 1).ok());
  auto weights = client_->PullParameters(a.session_id);
  ASSERT_TRUE(weights.ok());

  auto saved = client_->SaveCheckpoint(a.session_id);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step_index, 1);
  EXPECT_GT(saved->bytes, 0);
  ASSERT_TRUE(client_->CloseSession(a.session_id).ok());

  auto loaded = client_->LoadCheckpoint(saved->path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step_index, 1);
  EXPECT_NE(loaded->layout.session_id, "");
  // "After LoadCheckpoint, the first PARAMETERS region registered receives the restored weights."
  auto arena = ShmArena::Create(client_.get(), loaded->layout);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto w = *arena->Param("w");
  EXPECT_EQ((*weights)["w"].AsF32(), std::vector<float>(w.begin(), w.end()));
  // The next step continues the numbering.
  auto next = client_->Step(loaded->layout.session_id, 3);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kFailedPrecondition) << next.status();
  arena->Reset();
  EXPECT_TRUE(client_->CloseSession(loaded->layout.session_id).ok());

  auto missing = client_->LoadCheckpoint(daemon_->dir + "/no-such-checkpoint");
  EXPECT_FALSE(missing.ok());
}

// Default options: chunks of exactly 4 MiB of data (plus the message's other fields) must pass
// the daemon's message size limit, in both directions.
TEST_F(ClientDaemonTest, TensorsLargerThanOneChunkRoundTripWithDefaultChunkSize) {
  auto c = Client::Connect(daemon_->target);
  ASSERT_TRUE(c.ok()) << c.status();
  Client& client = **c;
  constexpr int64_t kBigRows = 2048, kBigCols = 1024;  // 8 MiB of f32: 2 full chunks + 0
  GroupSpec a{"vectors", Algorithm::kAdamW, {}};
  auto layout = client.CreateSession({{"big", {kBigRows, kBigCols + 3}, DType::kF32, "vectors"}},
                                     {a}, {"big"});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const size_t n = kBigRows * (kBigCols + 3);  // a bit over 8 MiB: a third, partial chunk
  auto w = Values(n, 1.0f, 0.5f);
  auto set = client.SetState(layout->session_id, {ConstTensorRef::F32("big", w)});
  ASSERT_TRUE(set.ok()) << set.status();
  auto pushed = client.PushGradients(layout->session_id, {ConstTensorRef::F32("big", w)});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->chunks(), 3);
  std::vector<float> back(n);
  absl::Status pulled = client.PullParameters(layout->session_id,
                                              {MutableTensorRef::F32("big", absl::MakeSpan(back))});
  ASSERT_TRUE(pulled.ok()) << pulled;
  EXPECT_TRUE(back == w);
  // A destination of the wrong size is refused, not overrun.
  std::vector<float> small(n - 1);
  EXPECT_EQ(
      client
          .PullParameters(layout->session_id, {MutableTensorRef::F32("big", absl::MakeSpan(small))})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client.CloseSession(layout->session_id).ok());
}

// bf16 weights in the arena with fp32 master weights in the daemon.
TEST_F(ClientDaemonTest, Bf16ParametersOverShmWithFp32MasterWeights) {
  std::vector<ParamSpec> params = {{"w", {kRows, kCols}, DType::kBF16, "matrices"},
                                   {"b", {kRows}, DType::kBF16, "vectors"}};
  SessionOptions opts{"bf16", /*fp32_master_weights=*/true};
  auto layout = client_->CreateSession(params, Groups(), opts);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->Find("w")->size_bytes, kRows * kCols * 2);
  auto arena = ShmArena::Create(client_.get(), *layout);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(arena->Param("w").status().code(), absl::StatusCode::kInvalidArgument);
  auto w = *arena->ParamBf16("w");
  auto gw = *arena->GradBf16("w");
  auto b = *arena->ParamBf16("b");
  auto gb = *arena->GradBf16("b");
  // bf16 is the high half of an f32.
  auto to_bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  auto w0 = Values(w.size(), 0.5f, 0.0f), g0 = Values(w.size(), 1.0f, 2.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = to_bf16(w0[i]), gw[i] = to_bf16(g0[i]);
  for (size_t i = 0; i < b.size(); ++i) b[i] = to_bf16(0.1f), gb[i] = to_bf16(1.0f);
  std::vector<uint16_t> before(w.begin(), w.end());
  auto r = client_->Step(layout->session_id, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(std::vector<uint16_t>(w.begin(), w.end()), before) << "weights did not change";
  // AdamW moved every bias by about lr = 0.01 against its positive gradient.
  for (size_t i = 0; i < b.size(); ++i) {
    uint32_t u = static_cast<uint32_t>(b[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    // bf16 has 8 significant bits: 0.09 is rounded to within 2^-4 relative.
    EXPECT_NEAR(f, 0.09f, 0.09f / 16) << i;
  }
  arena->Reset();
  EXPECT_TRUE(client_->CloseSession(layout->session_id).ok());
}

// Credentials: a bearer token over loopback TCP, and TLS with the daemon's CA (made here with
// openssl), reach the daemon through ClientOptions; without them TCP calls are refused.
std::string Slurp(const std::string& path) { return diond::testing::ReadFile(path); }

int TcpPort(const testing::TestDaemon& d) {
  const std::string ready = Slurp(d.dir + "/ready.json");
  size_t at = ready.find("\"port\":");
  return at == std::string::npos ? 0 : std::atoi(ready.c_str() + at + 7);
}

TEST(ClientCredentialsTest, TokenAndTlsOptionsAuthenticateOverTcp) {
  const std::string dir = diond::testing::MakeTempDir("diond_client_auth");
  auto [rc, out] = diond::testing::RunCommand(absl::StrCat(
      "set -e; cd ", dir, "; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "-subj /CN=client-test-ca 2>/dev/null; ",
      "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=server "
      "2>/dev/null; ",
      "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; ",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
      "-extfile san.ext -out server.pem 2>/dev/null; ",
      "echo 'client-test-token-0123456789 trainer' > tokens"));
  ASSERT_EQ(rc, 0) << out;
  for (bool tls : {false, true}) {
    SCOPED_TRACE(tls ? "TLS" : "plaintext");
    std::vector<std::string> flags = {
        absl::StrCat("--listen=unix:", dir, tls ? "/t.sock" : "/p.sock", ",127.0.0.1:0"),
        "--auth_token_file=" + dir + "/tokens"};
    if (tls) {
      flags.push_back("--tls_cert=" + dir + "/server.pem");
      flags.push_back("--tls_key=" + dir + "/server.key");
    }
    auto d = testing::StartTestDaemon(DIOND_BINARY, flags);
    ASSERT_TRUE(d.ok()) << d.status();
    const std::string target = absl::StrCat("127.0.0.1:", TcpPort(**d));
    ClientOptions o;
    o.connect_timeout = absl::Seconds(5);
    if (tls) {
      o.tls.enabled = true;
      o.tls.ca_pem = Slurp(dir + "/ca.pem");
    }
    auto anonymous = Client::Connect(target, o);
    ASSERT_TRUE(anonymous.ok()) << anonymous.status();
    EXPECT_EQ((*anonymous)->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
    o.token = "client-test-token-0123456789";
    auto c = Client::Connect(target, o);
    ASSERT_TRUE(c.ok()) << c.status();
    auto layout = (*c)->CreateSession(Params(), Groups(), {"auth"});
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto listed = (*c)->ListSessions();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->size(), 1u);
    EXPECT_EQ((*listed)[0].owner, "trainer");
    EXPECT_TRUE((*c)->CloseSession(layout->session_id).ok());
    if (tls) {
      // Without TLS the TLS listener does not answer.
      ClientOptions plain;
      plain.connect_timeout = absl::Seconds(2);
      plain.token = o.token;
      EXPECT_EQ(Client::Connect(target, plain).status().code(), absl::StatusCode::kUnavailable);
    }
    EXPECT_EQ((*d)->Stop(), std::optional<int>(0));
  }
  diond::testing::RunCommand("rm -rf '" + dir + "'");
}

// A trainer restarts: the new one re-attaches by name, gets the layout, the step index and the
// daemon's weights (the fp32 master weights kept exactly), and continues; the result equals an
// uninterrupted session's bit for bit.
TEST_F(ClientDaemonTest, RestartedTrainerReattachesByNameAndContinuesBitExact) {
  std::vector<ParamSpec> params = {{"w", {kRows, kCols}, DType::kBF16, "matrices"},
                                   {"b", {kRows}, DType::kBF16, "vectors"}};
  SessionOptions named{"trainer", /*fp32_master_weights=*/true, "job-17/rank-0"};
  SessionOptions plain{"reference", /*fp32_master_weights=*/true};
  auto ref_layout = client_->CreateSession(params, Groups(), plain);
  auto layout = client_->CreateSession(params, Groups(), named);
  ASSERT_TRUE(ref_layout.ok() && layout.ok()) << layout.status();
  auto ref = ShmArena::Create(client_.get(), *ref_layout);
  auto first = ShmArena::Create(client_.get(), *layout);
  ASSERT_TRUE(ref.ok() && first.ok());
  auto fill = [](absl::Span<uint16_t> dst, const std::vector<float>& src) {
    for (size_t i = 0; i < dst.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &src[i], 4);
      dst[i] = static_cast<uint16_t>(u >> 16);
    }
  };
  auto init = [&](ShmArena& a) {
    fill(*a.ParamBf16("w"), Values(kRows * kCols, 0.5f, 0.0f));
    fill(*a.ParamBf16("b"), Values(kRows, 0.1f, 1.0f));
  };
  auto grads = [&](ShmArena& a, int64_t t) {
    fill(*a.GradBf16("w"), Values(kRows * kCols, 1.0f, 0.1f * static_cast<float>(t)));
    fill(*a.GradBf16("b"), Values(kRows, 1.0f, 0.3f * static_cast<float>(t)));
  };
  init(*ref);
  init(*first);
  for (int64_t t = 1; t <= 3; ++t) {
    grads(*ref, t);
    grads(*first, t);
    ASSERT_TRUE(client_->Step(ref_layout->session_id, t).ok());
    ASSERT_TRUE(client_->Step(layout->session_id, t).ok());
  }
  // The first trainer is gone (its memory still mapped); a new one attaches by name.
  auto attached = client_->AttachSession("job-17/rank-0");
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->layout.session_id, layout->session_id);
  EXPECT_EQ(attached->step_index, 3);
  auto second = ShmArena::Create(client_.get(), attached->layout);
  ASSERT_TRUE(second.ok()) << second.status();
  auto w_ref = *ref->ParamBf16("w");
  auto w_new = *second->ParamBf16("w");
  EXPECT_EQ(std::vector<uint16_t>(w_new.begin(), w_new.end()),
            std::vector<uint16_t>(w_ref.begin(), w_ref.end()));
  first->Reset();  // its regions were dropped by the attach: unregistering them is a no-op
  for (int64_t t = attached->step_index + 1; t <= 6; ++t) {
    grads(*ref, t);
    grads(*second, t);
    ASSERT_TRUE(client_->Step(ref_layout->session_id, t).ok());
    auto r = client_->Step(layout->session_id, t);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(std::vector<uint16_t>(w_new.begin(), w_new.end()),
            std::vector<uint16_t>(w_ref.begin(), w_ref.end()));
  auto ref_state = client_->GetState(ref_layout->session_id, /*include_parameters=*/true);
  auto state = client_->GetState(layout->session_id, /*include_parameters=*/true);
  ASSERT_TRUE(ref_state.ok() && state.ok());
  ASSERT_EQ(state->size(), ref_state->size());
  for (const auto& [name, t] : *ref_state) EXPECT_EQ(state->at(name).bytes, t.bytes) << name;
  auto list = client_->ListSessions();
  ASSERT_TRUE(list.ok());
  bool listed = false;
  for (const SessionInfo& i : *list) listed |= i.session_name == "job-17/rank-0";
  EXPECT_TRUE(listed);
  EXPECT_EQ(client_->AttachSession("job-17/rank-9").status().code(), absl::StatusCode::kNotFound);
  second->Reset();
  ref->Reset();
  EXPECT_TRUE(client_->CloseSession(layout->session_id).ok());
  EXPECT_TRUE(client_->CloseSession(ref_layout->session_id).ok());
}

// An idle sidecar takes no CPU from its trainer: after steps large enough to start the compute
// thread pools (a 1024² Muon step runs multi-threaded GEMMs and loops), the daemon's threads must
// go to sleep. Spinning threads would use up to a CPU-second per second each (with
// OMP_WAIT_POLICY=active this test fails); the daemon bounds libgomp's spinning
// (GOMP_SPINCOUNT, server/exe/main.cc) when the operator has not chosen.
TEST_F(ClientDaemonTest, AnIdleDaemonTakesNoCpuAfterLargeSteps) {
  constexpr int64_t n = 1024;
  GroupSpec g{"matrices", Algorithm::kMuon, {}};
  g.hyperparams.lr = 0.02;
  auto layout = client_->CreateSession({{"big", {n, n}, DType::kF32, "matrices"}}, {g}, {"idle"});
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto arena = ShmArena::Create(client_.get(), *layout);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto w = Values(n * n, 0.02f, 0.5f);
  std::copy(w.begin(), w.end(), arena->Param("big")->begin());
  for (int64_t t = 1; t <= 3; ++t) {
    auto gw = Values(n * n, 1.0f, static_cast<float>(t));
    std::copy(gw.begin(), gw.end(), arena->Grad("big")->begin());
    auto st = client_->Step(layout->session_id, t);
    ASSERT_TRUE(st.ok()) << st.status();
  }
  // OpenBLAS's workers spin (sched_yield) for up to about 0.1 s after their last call.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const pid_t pid = daemon_->proc->pid();
  const double before = CpuSeconds(pid);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double after = CpuSeconds(pid);
  ASSERT_GE(before, 0.0);
  EXPECT_LT(after - before, 0.25) << "an idle daemon used " << after - before
                                  << " CPU seconds in 2 s\nlog:\n"
                                  << daemon_->proc->Log();
  EXPECT_TRUE(client_->CloseSession(layout->session_id).ok());
}

}  // namespace
}  // namespace diond::client
