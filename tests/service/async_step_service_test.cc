// Asynchronous Step (StepRequest.asynchronous / .wait; docs/DATA_PLANE.md "Asynchronous Step")
// against the real daemon over its Unix socket and POSIX shared memory:
//  - asynchronous steps give the synchronous steps' answers, weights and state bit for bit (and
//    the in-process replay's), collected by a wait or by the next Step (StepResponse.previous);
//  - a queued step's failure surfaces on the next call (the next Step or a wait), with its step
//    index, and is quoted by later out-of-order errors; the index is not consumed;
//  - a hostile client (SetState, PushGradients, GetState, PullParameters, SetHyperparameters,
//    UnregisterRegion while a step is queued; a second asynchronous Step out of order; a
//    repeated queued index) gets FAILED_PRECONDITION naming the queued step, and nothing is
//    corrupted;
//  - CloseSession and SaveCheckpoint with a queued step wait for it; SIGTERM drains a queued
//    step (its weights and its automatic checkpoint are written) and the daemon exits 0.
#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;

// Muon (matrix state) + AdamW (vector state and step counter): both update paths.
SessionDesc Desc(v1::NonFinitePolicy policy = v1::NON_FINITE_POLICY_UNSPECIFIED) {
  SessionDesc d;
  d.groups.push_back(MakeGroup("m", optim::AlgorithmKind::kMuon, 0.02));
  d.groups.push_back(MakeGroup("a", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w", {24, 16}, "m"});
  d.params.push_back({"b", {16}, "a"});
  d.non_finite = policy;
  return d;
}

std::vector<std::vector<float>> Grads(const SessionDesc& d, int64_t step) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < d.params.size(); ++i) {
    g.push_back(SyntheticValues(7, step, i, d.Numel(i)));
  }
  return g;
}

grpc::Status StepAsync(v1::Optimizer::Stub& stub, const std::string& session, int64_t index,
                       v1::StepResponse* resp) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  req.set_asynchronous(true);
  return stub.Step(Ctx().get(), req, resp);
}

grpc::Status Wait(v1::Optimizer::Stub& stub, const std::string& session, v1::StepResponse* resp,
                  int64_t index = 0) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  req.set_wait(true);
  return stub.Step(Ctx().get(), req, resp);
}

// The fields a synchronous and an asynchronous step must agree on (not the timings).
void ExpectSameResult(const v1::StepResponse& got, const v1::StepResponse& want) {
  EXPECT_EQ(got.step_index(), want.step_index());
  EXPECT_EQ(got.skipped(), want.skipped());
  ASSERT_EQ(got.update_norms_size(), want.update_norms_size());
  for (const auto& [g, n] : want.update_norms()) {
    ASSERT_TRUE(got.update_norms().contains(g)) << g;
    // Bit for bit: the same computation on the same bytes.
    EXPECT_EQ(got.update_norms().at(g), n) << g;
  }
}

class AsyncStep : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    state_dir_ = new std::string(testing::MakeTempDir("diond_async"));
    daemon_ = Daemon::Start({"--state_dir=" + *state_dir_}).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete state_dir_;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    ctx_ = kernels::Context::CpuDefault();
  }
  v1::Optimizer::Stub& stub() { return daemon_->stub(); }

  // A session over shm with the initial weights (SyntheticValues step 0) written into its arena,
  // and the replay holding the same.
  std::unique_ptr<ShmSession> NewSession(const SessionDesc& d, Replay* replay) {
    auto s = CreateShmSession(stub(), d.Request());
    if (s == nullptr) return nullptr;
    for (size_t i = 0; i < d.params.size(); ++i) {
      std::vector<float> w = SyntheticValues(1, 0, i, d.Numel(i));
      s->params_seg->Write(s->tensor(i).param_offset_bytes(), FloatBytes(w));
      if (replay != nullptr) replay->params()[i] = w;
    }
    return s;
  }
  TensorMap State(const std::string& id) {
    TensorMap m;
    grpc::Status st = GetState(stub(), id, true, &m);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return m;
  }
  void ExpectMatchesReplay(const ShmSession& s, const SessionDesc& d, const Replay& r) {
    TensorMap m = State(s.id);
    for (size_t i = 0; i < d.params.size(); ++i) {
      EXPECT_TRUE(s.ParamBytes(i) == FloatBytes(const_cast<Replay&>(r).params()[i]))
          << d.params[i].name;
      for (const std::string& st : r.StateNames(i)) {
        EXPECT_TRUE(m[d.params[i].name + "/state." + st] == FloatBytes(*r.GetState(i, st)))
            << d.params[i].name << "/state." << st;
      }
    }
  }

  static Daemon* daemon_;
  static std::string* state_dir_;
  std::unique_ptr<kernels::Context> ctx_;
};
Daemon* AsyncStep::daemon_ = nullptr;
std::string* AsyncStep::state_dir_ = nullptr;

TEST_F(AsyncStep, AsynchronousStepsEqualSynchronousOnesBitForBit) {
  const SessionDesc d = Desc();
  auto replay = *Replay::Create(d);
  auto sync = NewSession(d, nullptr);
  auto async = NewSession(d, replay.get());
  ASSERT_NE(sync, nullptr);
  ASSERT_NE(async, nullptr);
  // Odd steps: fresh gradients, queued, not collected. Even steps: the same gradients again
  // (the trainer may not write the arena while step t-1 is queued), an asynchronous Step that
  // collects step t-1 (StepResponse.previous), then a wait that collects step t. The
  // synchronous session sees the same gradients at every step.
  constexpr int64_t kSteps = 6;
  v1::StepResponse pending;  // the synchronous answer of the step still queued
  std::vector<std::vector<float>> g;
  for (int64_t t = 1; t <= kSteps; ++t) {
    if (t % 2 == 1) {
      g = Grads(d, t);
      for (size_t i = 0; i < g.size(); ++i) {
        sync->WriteGrad(i, g[i]);
        async->WriteGrad(i, g[i]);
      }
    }
    v1::StepResponse want;
    ASSERT_TRUE(DoStep(stub(), sync->id, t, &want).ok());
    ASSERT_TRUE(replay->Step(*ctx_, g).ok());
    EXPECT_FALSE(want.queued());
    EXPECT_FALSE(want.has_previous());

    v1::StepResponse queued;
    ASSERT_TRUE(StepAsync(stub(), async->id, t, &queued).ok()) << t;
    EXPECT_TRUE(queued.queued());
    EXPECT_EQ(queued.step_index(), t);
    EXPECT_TRUE(queued.update_norms().empty());
    if (t % 2 == 0) {
      ASSERT_TRUE(queued.has_previous()) << t;
      ExpectSameResult(queued.previous(), pending);
      EXPECT_FALSE(queued.previous().queued());
      v1::StepResponse done;
      ASSERT_TRUE(Wait(stub(), async->id, &done).ok());
      EXPECT_FALSE(done.replayed());
      EXPECT_FALSE(done.queued());
      ExpectSameResult(done, want);
    } else {
      EXPECT_FALSE(queued.has_previous());
      pending = want;
    }
  }
  EXPECT_TRUE(sync->params_seg->Bytes(0, sync->layout.param_arena_bytes()) ==
              async->params_seg->Bytes(0, async->layout.param_arena_bytes()));
  EXPECT_TRUE(State(sync->id) == State(async->id));
  ExpectMatchesReplay(*async, d, *replay);
  // A wait with nothing queued replays the last answer (a retried wait whose answer was lost).
  v1::StepResponse again;
  ASSERT_TRUE(Wait(stub(), async->id, &again).ok());
  EXPECT_TRUE(again.replayed());
  EXPECT_EQ(again.step_index(), kSteps);
  EXPECT_TRUE(CloseSession(stub(), sync->id).ok());
  EXPECT_TRUE(CloseSession(stub(), async->id).ok());
}

TEST_F(AsyncStep, AQueuedStepsFailureSurfacesOnTheNextCallWithItsIndex) {
  const SessionDesc d = Desc(v1::NON_FINITE_POLICY_ERROR);
  auto replay = *Replay::Create(d);
  auto s = NewSession(d, replay.get());
  ASSERT_NE(s, nullptr);
  const std::string arena = s->params_seg->Bytes(0, s->layout.param_arena_bytes());
  const TensorMap before = State(s->id);
  auto bad = Grads(d, 1);
  bad[0][5] = std::numeric_limits<float>::quiet_NaN();
  for (size_t i = 0; i < bad.size(); ++i) s->WriteGrad(i, bad[i]);

  // The request is valid, so it is queued; the NaN is found when it runs.
  v1::StepResponse resp;
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  EXPECT_TRUE(resp.queued());
  // The next Step answers with the queued step's error, and does not run.
  grpc::Status st = StepAsync(stub(), s->id, 2, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "asynchronous step 1 failed"))
      << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "NaN")) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "step 2 was not run")) << st.error_message();
  // Collected: the error is not answered twice, but later out-of-order errors still quote it.
  st = DoStep(stub(), s->id, 2);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "expected 1")) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "last asynchronous step failed (step 1"))
      << st.error_message();
  // Nothing changed.
  EXPECT_EQ(s->params_seg->Bytes(0, s->layout.param_arena_bytes()), arena);
  EXPECT_EQ(State(s->id), before);

  // The same failure collected by a wait instead.
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  st = Wait(stub(), s->id, &resp, 1);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "asynchronous step 1 failed"))
      << st.error_message();
  EXPECT_EQ(State(s->id), before);

  // Step 1 retried with finite gradients applies normally.
  const auto good = Grads(d, 1);
  for (size_t i = 0; i < good.size(); ++i) s->WriteGrad(i, good[i]);
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  ASSERT_TRUE(Wait(stub(), s->id, &resp).ok());
  EXPECT_EQ(resp.step_index(), 1);
  ASSERT_TRUE(replay->Step(*ctx_, good).ok());
  ExpectMatchesReplay(*s, d, *replay);
  // Once a step applied, the old failure is no longer quoted.
  st = DoStep(stub(), s->id, 7);
  EXPECT_FALSE(absl::StrContains(st.error_message(), "asynchronous")) << st.error_message();
  EXPECT_TRUE(CloseSession(stub(), s->id).ok());
}

TEST_F(AsyncStep, AHostileClientGetsClearErrorsAndNothingIsCorrupted) {
  const SessionDesc d = Desc();
  auto replay = *Replay::Create(d);
  auto s = NewSession(d, replay.get());
  ASSERT_NE(s, nullptr);
  const auto g = Grads(d, 1);
  for (size_t i = 0; i < g.size(); ++i) s->WriteGrad(i, g[i]);
  v1::StepResponse resp;
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  ASSERT_TRUE(resp.queued());

  auto expect_refused = [&](const grpc::Status& st, const std::string& what) {
    EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << what;
    EXPECT_TRUE(absl::StrContains(st.error_message(), "step 1 was queued by an asynchronous Step"))
        << what << ": " << st.error_message();
  };
  // Every call that would read or change the step's memory or state, whether or not the step
  // has run yet.
  expect_refused(SetState(stub(), s->id, {{"b", 0, FloatBytes(std::vector<float>(16, 9.f))}}),
                 "SetState");
  expect_refused(PushGradients(stub(), s->id, {{"b", 0, FloatBytes(std::vector<float>(16, 9.f))}}),
                 "PushGradients");
  TensorMap out;
  expect_refused(GetState(stub(), s->id, false, &out), "GetState");
  expect_refused(PullParameters(stub(), s->id, &out), "PullParameters");
  {
    v1::SetHyperparametersRequest req;
    req.set_session_id(s->id);
    req.set_group("m");
    req.mutable_hyperparameters()->set_lr(0.5);
    v1::SetHyperparametersResponse r;
    expect_refused(stub().SetHyperparameters(Ctx().get(), req, &r), "SetHyperparameters");
  }
  {
    v1::UnregisterRegionRequest req;
    req.set_session_id(s->id);
    req.set_region_id(s->param_region);
    v1::UnregisterRegionResponse r;
    expect_refused(stub().UnregisterRegion(Ctx().get(), req, &r), "UnregisterRegion");
  }
  // Out-of-order Steps (asynchronous or not) name the queued step and the index expected.
  for (int64_t bad : {int64_t{3}, int64_t{0}, int64_t{-1}}) {
    grpc::Status st = StepAsync(stub(), s->id, bad, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << bad;
    EXPECT_TRUE(absl::StrContains(st.error_message(), "step 1 is queued")) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "the next Step is 2")) << st.error_message();
  }
  // A wait naming another index.
  grpc::Status st = Wait(stub(), s->id, &resp, 2);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "step 1 is queued")) << st.error_message();
  // An invalid next Step leaves the queued step's result to collect.
  {
    v1::StepRequest req;
    req.set_session_id(s->id);
    req.set_step_index(2);
    req.set_asynchronous(true);
    (*req.mutable_lr_override())["nope"] = 0.1;
    st = stub().Step(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "still to collect")) << st.error_message();
  }
  // The queued index again (a retry after a lost answer): the queued step's answer, once.
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  EXPECT_FALSE(resp.queued());
  EXPECT_TRUE(resp.replayed());
  EXPECT_EQ(resp.step_index(), 1);
  EXPECT_EQ(resp.update_norms_size(), 2);
  ASSERT_TRUE(replay->Step(*ctx_, g).ok());
  // Collected: the calls refused above work again, and nothing was applied twice or half.
  ExpectMatchesReplay(*s, d, *replay);
  // Two asynchronous steps in a row on unchanged gradients: the second waits for the first.
  v1::StepResponse second;
  ASSERT_TRUE(StepAsync(stub(), s->id, 2, &resp).ok());
  ASSERT_TRUE(StepAsync(stub(), s->id, 3, &second).ok());
  ASSERT_TRUE(second.has_previous());
  EXPECT_EQ(second.previous().step_index(), 2);
  ASSERT_TRUE(Wait(stub(), s->id, &resp).ok());
  EXPECT_EQ(resp.step_index(), 3);
  ASSERT_TRUE(replay->Step(*ctx_, g).ok());
  ASSERT_TRUE(replay->Step(*ctx_, g).ok());
  ExpectMatchesReplay(*s, d, *replay);
  EXPECT_TRUE(CloseSession(stub(), s->id).ok());
}

TEST_F(AsyncStep, CheckpointAndCloseWaitForTheQueuedStep) {
  const SessionDesc d = Desc();
  auto replay = *Replay::Create(d);
  auto s = NewSession(d, replay.get());
  ASSERT_NE(s, nullptr);
  const auto g = Grads(d, 1);
  for (size_t i = 0; i < g.size(); ++i) s->WriteGrad(i, g[i]);
  ASSERT_TRUE(replay->Step(*ctx_, g).ok());
  v1::StepResponse resp;
  ASSERT_TRUE(StepAsync(stub(), s->id, 1, &resp).ok());
  // The checkpoint holds the queued step, whose result stays to be collected.
  v1::SaveCheckpointRequest save;
  save.set_session_id(s->id);
  v1::SaveCheckpointResponse saved;
  grpc::Status st = stub().SaveCheckpoint(Ctx().get(), save, &saved);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(saved.step_index(), 1);
  ASSERT_TRUE(Wait(stub(), s->id, &resp).ok());
  EXPECT_EQ(resp.step_index(), 1);
  EXPECT_FALSE(resp.replayed());
  ExpectMatchesReplay(*s, d, *replay);
  // The checkpoint restores to the same state.
  v1::LoadCheckpointRequest load;
  load.set_path(saved.path());
  v1::LoadCheckpointResponse loaded;
  st = stub().LoadCheckpoint(Ctx().get(), load, &loaded);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(loaded.step_index(), 1);
  TensorMap restored;
  ASSERT_TRUE(GetState(stub(), loaded.session().session_id(), false, &restored).ok());
  TensorMap now;
  ASSERT_TRUE(GetState(stub(), s->id, false, &now).ok());
  EXPECT_EQ(restored, now);
  EXPECT_TRUE(CloseSession(stub(), loaded.session().session_id()).ok());

  // CloseSession with a queued step: the step runs to its end (the weights in the trainer's
  // arena are written), then the session is gone.
  const auto g2 = Grads(d, 2);
  for (size_t i = 0; i < g2.size(); ++i) s->WriteGrad(i, g2[i]);
  ASSERT_TRUE(replay->Step(*ctx_, g2).ok());
  ASSERT_TRUE(StepAsync(stub(), s->id, 2, &resp).ok());
  ASSERT_TRUE(CloseSession(stub(), s->id).ok());
  for (size_t i = 0; i < d.params.size(); ++i) {
    EXPECT_EQ(s->ParamBytes(i), FloatBytes(replay->params()[i])) << d.params[i].name;
  }
  EXPECT_EQ(Wait(stub(), s->id, &resp).error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(daemon_->Serving());
}

// SIGTERM with a queued step: the daemon finishes it (weights written, the automatic
// checkpoint of that step taken) before it exits 0.
TEST(AsyncStepShutdown, SigtermDrainsAQueuedStep) {
  const std::string state_dir = testing::MakeTempDir("diond_async_stop");
  auto daemon = Daemon::Start({"--state_dir=" + state_dir, "--checkpoint_every=1"});
  ASSERT_NE(daemon, nullptr);
  auto ctx = kernels::Context::CpuDefault();
  const SessionDesc d = Desc();
  auto replay = *Replay::Create(d);
  auto s = CreateShmSession(daemon->stub(), d.Request());
  ASSERT_NE(s, nullptr);
  for (size_t i = 0; i < d.params.size(); ++i) {
    std::vector<float> w = SyntheticValues(1, 0, i, d.Numel(i));
    s->params_seg->Write(s->tensor(i).param_offset_bytes(), FloatBytes(w));
    replay->params()[i] = w;
  }
  const auto g = Grads(d, 1);
  for (size_t i = 0; i < g.size(); ++i) s->WriteGrad(i, g[i]);
  ASSERT_TRUE(replay->Step(*ctx, g).ok());
  v1::StepResponse resp;
  ASSERT_TRUE(StepAsync(daemon->stub(), s->id, 1, &resp).ok());
  ASSERT_TRUE(resp.queued());
  std::optional<int> code = daemon->Terminate(absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << daemon->Log();
  EXPECT_EQ(*code, 0) << daemon->Log();
  for (size_t i = 0; i < d.params.size(); ++i) {
    EXPECT_EQ(s->ParamBytes(i), FloatBytes(replay->params()[i])) << d.params[i].name;
  }
  struct stat st;
  EXPECT_EQ(stat(absl::StrCat(state_dir, "/", s->id, "/step-1").c_str(), &st), 0) << daemon->Log();
  EXPECT_TRUE(absl::StrContains(daemon->Log(), "asynchronous step 1 ended before the daemon"))
      << daemon->Log();
}

}  // namespace
}  // namespace diond::service_testing
