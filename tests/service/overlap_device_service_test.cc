// The overlapped step on device sessions (docs/DATA_PLANE.md "Overlapped step"), on the strict
// host-memory TEST backend: no GPU runs any of this. The daemon runs in this test's process (the
// TEST backend's IPC handles and events are emulated within one process); the test is the
// trainer: its gradients and weights in TEST "GPU memory" (CUDA regions) or in shm, a doorbell
// page in shm, an IPC event pair per bucket, and a thread that writes each bucket's gradients
// and rings it, in a changing order.
//
// Checked: for every algorithm (and bf16 weights with fp32 master weights) overlapped steps over
// CUDA regions equal a synchronous device session's weights, state and update norms bit for
// bit, each bucket's ready event waited on and its done event recorded once a step; over shm
// regions too (no events); a NaN in one bucket under SKIP (every done event recorded, every word
// N, nothing written) and ERROR (no record, every word -N, nothing written); the refusals of
// the buckets' events (a host session, half the buckets, a short or unknown handle: nothing
// left open); the events destroyed with the page, a new trainer and the session; an abandoned
// step (-N) and a last bucket never rung with the session closed: nothing committed; a clip
// (max_grad_norm) over CUDA regions, synchronous and overlapped.
#include <unistd.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/service/cuda_harness.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;
using optim::AlgorithmKind;

constexpr int kBucketCount = 3;

// The trainer's memory of one session, over CUDA regions or shm.
struct Trainer {
  std::unique_ptr<CudaSession> cuda;
  std::unique_ptr<ShmSession> shm;
  bool bf16 = false;  // every weight and gradient
  const std::string& id() const { return cuda ? cuda->id : shm->id; }
  std::string Bytes(const std::vector<float>& v) const {
    return bf16 ? Bf16Bytes(v) : FloatBytes(v);
  }
  void WriteGrad(size_t i, const std::vector<float>& g) {
    if (cuda) {
      cuda->mem->Write(cuda->grad_base + cuda->tensor(i).grad_offset_bytes(), Bytes(g));
    } else {
      shm->WriteGradBytes(i, Bytes(g));
    }
  }
  std::string Params() const {
    return cuda ? cuda->Params() : shm->params_seg->Bytes(0, shm->layout.param_arena_bytes());
  }
};

class OverlapDevice : public CudaRegions {
 protected:
  // A session of `req` over CUDA regions (or shm), holding the initial weights.
  Trainer NewTrainer(const SessionDesc& d, const v1::CreateSessionRequest& req, bool cuda) {
    Trainer t;
    t.bf16 = req.parameters(0).dtype() == v1::DTYPE_BF16;
    if (cuda) {
      t.cuda = CreateCudaSession(req, /*vmm=*/false);
    } else {
      t.shm = CreateShmSession(stub(), req);
    }
    EXPECT_TRUE(t.cuda != nullptr || t.shm != nullptr);
    if (t.cuda == nullptr && t.shm == nullptr) return t;
    std::vector<Chunk> weights;
    for (size_t i = 0; i < d.params.size(); ++i) {
      weights.push_back({d.params[i].name, 0, t.Bytes(SyntheticValues(1, 0, i, d.Numel(i)))});
    }
    grpc::Status s = SetState(stub(), t.id(), weights);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return t;
  }

  // A doorbell page for `id`, with an event pair per bucket when `events`.
  grpc::Status NewPage(const std::string& id, bool events) {
    page_ = ShmSegment::Create(4096);
    if (page_ == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "no shm");
    WriteDoorbellHeader(page_->data(), kBucketCount);
    bells_.base = page_->data();
    ready_.clear();
    done_.clear();
    for (int k = 0; events && k < kBucketCount; ++k) {
      ready_.push_back(NewEvent());
      done_.push_back(NewEvent());
    }
    return RegisterShmDoorbells(stub(), id, page_->name(), 0, 4096, kBuckets, &page_id_, ready_,
                                done_);
  }

  // Step t overlapped on `ov`: queued, then the trainer's backward from a thread (each bucket's
  // gradients written, then rung, in RingOrder(t) or `order`), then collected.
  grpc::Status Overlapped(Trainer& ov, int64_t t, const std::vector<std::vector<float>>& g,
                          v1::StepResponse* got, std::vector<int> order = {},
                          double max_grad_norm = 0) {
    if (order.empty()) order = RingOrder(t);
    v1::StepResponse queued;
    v1::StepRequest req;
    req.set_session_id(ov.id());
    req.set_step_index(t);
    req.set_asynchronous(true);
    req.set_overlap(true);
    req.set_max_grad_norm(max_grad_norm);
    grpc::Status q = stub().Step(Ctx().get(), req, &queued);
    EXPECT_TRUE(q.ok()) << q.error_message();
    EXPECT_TRUE(queued.queued());
    std::thread trainer([&] {
      for (int k : order) {
        for (int32_t i : kBuckets[static_cast<size_t>(k)]) {
          ov.WriteGrad(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
        }
        absl::SleepFor(absl::Milliseconds(3));  // the daemon stages meanwhile
        bells_.RingGradients(k, t);
      }
    });
    trainer.join();
    return WaitStep(stub(), ov.id(), got);
  }

  // Step t synchronously on `sync` with gradients g.
  grpc::Status Synchronous(Trainer& sync, int64_t t, const std::vector<std::vector<float>>& g,
                           v1::StepResponse* want) {
    for (size_t i = 0; i < g.size(); ++i) sync.WriteGrad(i, g[i]);
    return Step(sync.id(), t, 1.0, want);
  }

  // Steps 1..steps on both, overlapped equal to synchronous bit for bit after each; with
  // events, each step waits once on every ready event and records every done event once.
  void ExpectOverlapEqualsSync(const SessionDesc& d, const v1::CreateSessionRequest& req, bool cuda,
                               int steps) {
    Trainer sync = NewTrainer(d, req, cuda);
    Trainer ov = NewTrainer(d, req, cuda);
    ASSERT_TRUE(sync.cuda || sync.shm);
    ASSERT_TRUE(ov.cuda || ov.shm);
    grpc::Status s = NewPage(ov.id(), /*events=*/cuda);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (int64_t t = 1; t <= steps; ++t) {
      SCOPED_TRACE(absl::StrCat("step ", t));
      const std::vector<std::vector<float>> g = Grads(d, t);
      v1::StepResponse want, got;
      ASSERT_TRUE(Synchronous(sync, t, g, &want).ok());
      const auto h0 = kt::GetHostTestHandoffCounters();
      s = Overlapped(ov, t, g, &got);
      ASSERT_TRUE(s.ok()) << s.error_message();
      const auto h1 = kt::GetHostTestHandoffCounters();
      ExpectSameResult(got, want);
      EXPECT_FALSE(got.skipped());
      EXPECT_TRUE(ov.Params() == sync.Params()) << "the weights differ";
      EXPECT_TRUE(State(ov.id()) == State(sync.id())) << "the state differs";
      const int64_t events = cuda ? kBucketCount : 0;
      EXPECT_EQ(h1.stream_waits - h0.stream_waits, events);
      EXPECT_EQ(h1.event_records - h0.event_records, events);
      for (int k = 0; k < kBucketCount; ++k) {
        EXPECT_EQ(bells_.weights(k), t) << "bucket " << k;
        if (!cuda) continue;
        EXPECT_EQ(Records(done_[static_cast<size_t>(k)]), t) << "bucket " << k;
        EXPECT_EQ(Waits(ready_[static_cast<size_t>(k)]), t) << "bucket " << k;
        EXPECT_EQ(Records(ready_[static_cast<size_t>(k)]), 0) << "bucket " << k;
        EXPECT_EQ(Waits(done_[static_cast<size_t>(k)]), 0) << "bucket " << k;
      }
    }
    EXPECT_TRUE(CloseSession(stub(), ov.id()).ok());
    EXPECT_TRUE(CloseSession(stub(), sync.id()).ok());
  }

  std::unique_ptr<ShmSegment> page_;
  Bells bells_;
  std::vector<std::string> ready_, done_;
  std::string page_id_;
};

class OverlapDeviceAlgorithms : public OverlapDevice,
                                public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(OverlapDeviceAlgorithms, OverCudaRegionsEqualsASynchronousDeviceSession) {
  const SessionDesc d = Desc(GetParam());
  ExpectOverlapEqualsSync(d, d.Request(), /*cuda=*/true, 4);
}

INSTANTIATE_TEST_SUITE_P(OverlapDevice, OverlapDeviceAlgorithms,
                         ::testing::ValuesIn(kEveryAlgorithm), AlgorithmParamName);

TEST_F(OverlapDevice, Bf16WeightsWithFp32MasterWeightsEqualASynchronousSession) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  v1::CreateSessionRequest req = d.Request();
  req.set_fp32_master_weights(true);
  for (int i = 0; i < req.parameters_size(); ++i) {
    req.mutable_parameters(i)->set_dtype(v1::DTYPE_BF16);
  }
  ExpectOverlapEqualsSync(d, req, /*cuda=*/true, 3);
}

TEST_F(OverlapDevice, OverShmRegionsEqualsASynchronousDeviceSession) {
  for (AlgorithmKind a : {AlgorithmKind::kMuon, AlgorithmKind::kAdamW}) {
    SCOPED_TRACE(std::string(optim::AlgorithmName(a)));
    const SessionDesc d = Desc(a);
    ExpectOverlapEqualsSync(d, d.Request(), /*cuda=*/false, 3);
  }
}

// max_grad_norm on a device session over CUDA regions, whose f32 gradients are read in place:
// the clip scales them into the staging, and the trainer's gradients are as it wrote them. The
// norm is the device's (each gradient's f32 norm): near the one in double here; the weights,
// state and update norms equal those of a session given the gradients already multiplied by
// (float)coef of the daemon's grad_norm, bit for bit; and the overlapped step with the clip
// equals the synchronous one, grad_norm included.
TEST_F(OverlapDevice, AClipOverCudaRegionsScalesTheStagingNotTheTrainersGradients) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  Trainer clip = NewTrainer(d, d.Request(), /*cuda=*/true);
  Trainer ref = NewTrainer(d, d.Request(), /*cuda=*/true);
  Trainer ov = NewTrainer(d, d.Request(), /*cuda=*/true);
  ASSERT_TRUE(clip.cuda && ref.cuda && ov.cuda);
  ASSERT_TRUE(NewPage(ov.id(), /*events=*/true).ok());
  const double factor[] = {0.3, 5.0, 0.7};
  for (int64_t t = 1; t <= 3; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    const std::vector<std::vector<float>> g = Grads(d, t);
    double sq = 0;
    for (const auto& v : g) {
      for (float x : v) sq += static_cast<double>(x) * static_cast<double>(x);
    }
    const double norm = std::sqrt(sq);
    const double max = factor[t - 1] * norm;
    for (size_t i = 0; i < g.size(); ++i) clip.WriteGrad(i, g[i]);
    v1::StepRequest req;
    req.set_session_id(clip.id());
    req.set_step_index(t);
    req.set_max_grad_norm(max);
    v1::StepResponse got, want, over;
    grpc::Status s = stub().Step(Ctx().get(), req, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_NEAR(got.grad_norm(), norm, 1e-6 * norm);
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_EQ(
          clip.cuda->mem->Read(clip.cuda->grad_base + clip.cuda->tensor(i).grad_offset_bytes(),
                               static_cast<int64_t>(4 * g[i].size())),
          FloatBytes(g[i]))
          << "the trainer's gradient " << i;
    }
    const double coef = max / (got.grad_norm() + 1e-6);
    std::vector<std::vector<float>> clipped = g;
    if (coef < 1.0) {
      for (auto& v : clipped) {
        for (float& x : v) x *= static_cast<float>(coef);
      }
    } else {
      EXPECT_EQ(t, 2);  // not engaged
    }
    ASSERT_TRUE(Synchronous(ref, t, clipped, &want).ok());
    ExpectSameResult(got, want);
    EXPECT_TRUE(clip.Params() == ref.Params()) << "the weights differ";
    EXPECT_TRUE(State(clip.id()) == State(ref.id())) << "the state differs";
    s = Overlapped(ov, t, g, &over, {}, max);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectSameResult(over, got);
    EXPECT_EQ(over.grad_norm(), got.grad_norm());
    EXPECT_TRUE(ov.Params() == clip.Params()) << "the overlapped weights differ";
  }
  for (const Trainer* t : {&clip, &ref, &ov}) EXPECT_TRUE(CloseSession(stub(), t->id()).ok());
}

TEST_F(OverlapDevice, ANonFiniteBucketSkipsOrFailsWithNothingWritten) {
  for (v1::NonFinitePolicy policy : {v1::NON_FINITE_POLICY_SKIP, v1::NON_FINITE_POLICY_ERROR}) {
    const bool error = policy == v1::NON_FINITE_POLICY_ERROR;
    SCOPED_TRACE(error ? "ERROR" : "SKIP");
    const SessionDesc d = Desc(AlgorithmKind::kDion, policy);
    Trainer ov = NewTrainer(d, d.Request(), /*cuda=*/true);
    ASSERT_TRUE(ov.cuda);
    ASSERT_TRUE(NewPage(ov.id(), /*events=*/true).ok());
    v1::StepResponse got;
    ASSERT_TRUE(Overlapped(ov, 1, Grads(d, 1), &got).ok());
    const std::string weights = ov.Params();
    const TensorMap state = State(ov.id());
    std::vector<std::vector<float>> g = Grads(d, 2);
    g[3][5] = std::numeric_limits<float>::quiet_NaN();  // parameter 3: bucket 1, taken second
    const auto h0 = kt::GetHostTestHandoffCounters();
    grpc::Status s = Overlapped(ov, 2, g, &got, {2, 1, 0});
    const auto h1 = kt::GetHostTestHandoffCounters();
    EXPECT_EQ(h1.stream_waits - h0.stream_waits, kBucketCount);
    if (error) {
      EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_EQ(h1.event_records, h0.event_records) << "a failed step recorded a done event";
    } else {
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_TRUE(got.skipped());
      EXPECT_EQ(h1.event_records - h0.event_records, kBucketCount);
    }
    for (int k = 0; k < kBucketCount; ++k) {
      EXPECT_EQ(bells_.weights(k), error ? -2 : 2) << "bucket " << k;
      EXPECT_EQ(Records(done_[static_cast<size_t>(k)]), error ? 1 : 2) << "bucket " << k;
      EXPECT_EQ(Waits(ready_[static_cast<size_t>(k)]), 2) << "bucket " << k;
    }
    EXPECT_TRUE(ov.Params() == weights) << "weights were written";
    EXPECT_TRUE(State(ov.id()) == state) << "the state changed";
    // The next step applies as step 2 (ERROR: the words still say 2, so every gradient is
    // written before the retry) or 3 (SKIP).
    const int64_t next = error ? 2 : 3;
    g = Grads(d, next);
    for (size_t i = 0; i < g.size(); ++i) ov.WriteGrad(i, g[i]);
    s = Overlapped(ov, next, g, &got);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_FALSE(got.skipped());
    EXPECT_FALSE(ov.Params() == weights);
    EXPECT_TRUE(CloseSession(stub(), ov.id()).ok());
  }
}

TEST_F(OverlapDevice, TheBucketsEventsAreRefusedClearlyAndNothingIsLeftOpen) {
  const SessionDesc d = Desc(AlgorithmKind::kAdamW);
  v1::CreateSessionRequest named = d.Request();
  named.set_session_name(absl::StrCat("overlap-device-", getpid()));
  Trainer ov = NewTrainer(d, named, /*cuda=*/true);
  ASSERT_TRUE(ov.cuda);
  auto page = ShmSegment::Create(4096);
  ASSERT_NE(page, nullptr);
  WriteDoorbellHeader(page->data(), kBucketCount);
  const std::vector<std::string> ready = {NewEvent(), NewEvent(), NewEvent()};
  const std::vector<std::string> done = {NewEvent(), NewEvent(), NewEvent()};
  const auto start = kt::GetHostTestHandoffCounters();
  auto refused = [&](const std::vector<std::string>& r, const std::vector<std::string>& dn,
                     StatusCode code, const std::string& words) {
    grpc::Status s =
        RegisterShmDoorbells(stub(), ov.id(), page->name(), 0, 4096, kBuckets, nullptr, r, dn);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), words)) << s.error_message();
    EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now);
  };
  refused({ready[0]}, {done[0]}, StatusCode::INVALID_ARGUMENT, "every bucket has both or none");
  refused(ready, {done[0], done[1]}, StatusCode::INVALID_ARGUMENT, "every bucket has both or none");
  refused(ready, {done[0], done[1].substr(0, 63), done[2]}, StatusCode::INVALID_ARGUMENT,
          "must be the 64 bytes");
  // Unknown (never made) and of another device: the pairs opened before it are closed.
  refused(ready, {done[0], done[1], std::string(64, '\x07')}, StatusCode::FAILED_PRECONDITION,
          "buckets[2].done_event cannot be opened");
  refused(ready, {done[0], NewEvent(/*device=*/1), done[2]}, StatusCode::FAILED_PRECONDITION,
          "buckets[1].done_event cannot be opened");
  // Nothing was bound: the page registers now, opening the six events once.
  std::string id;
  grpc::Status s =
      RegisterShmDoorbells(stub(), ov.id(), page->name(), 0, 4096, kBuckets, &id, ready, done);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now + 6);
  // An overlapped Step orders the stream with the buckets' events, never the request's.
  {
    v1::StepRequest req;
    req.set_session_id(ov.id());
    req.set_step_index(1);
    req.set_asynchronous(true);
    req.set_overlap(true);
    req.set_ready_event(ready[0]);
    v1::StepResponse resp;
    s = stub().Step(Ctx().get(), req, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "takes its events from the doorbell page"))
        << s.error_message();
  }
  // Unregistered: destroyed.
  {
    v1::UnregisterRegionRequest req;
    req.set_session_id(ov.id());
    req.set_region_id(id);
    v1::UnregisterRegionResponse resp;
    ASSERT_TRUE(stub().UnregisterRegion(Ctx().get(), req, &resp).ok());
  }
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now);
  // A new trainer's AttachSession: destroyed with the previous trainer's page.
  ASSERT_TRUE(
      RegisterShmDoorbells(stub(), ov.id(), page->name(), 0, 4096, kBuckets, &id, ready, done)
          .ok());
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now + 6);
  v1::AttachSessionRequest attach;
  attach.set_session_name(named.session_name());
  v1::AttachSessionResponse attached;
  ASSERT_TRUE(stub().AttachSession(Ctx().get(), attach, &attached).ok());
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now);
  // CloseSession: destroyed.
  auto again = CreateCudaSession(d.Request(), /*vmm=*/false);
  ASSERT_NE(again, nullptr);
  ASSERT_TRUE(
      RegisterShmDoorbells(stub(), again->id, page->name(), 0, 4096, kBuckets, &id, ready, done)
          .ok());
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now + 6);
  EXPECT_TRUE(CloseSession(stub(), again->id).ok());
  EXPECT_TRUE(CloseSession(stub(), ov.id()).ok());
  EXPECT_EQ(kt::GetHostTestHandoffCounters().events_open_now, start.events_open_now);
  // A host session (a CPU daemon): the events need a device session's stream.
  auto cpu = Daemon::Start();
  ASSERT_NE(cpu, nullptr);
  auto host = CreateShmSession(cpu->stub(), d.Request());
  ASSERT_NE(host, nullptr);
  s = RegisterShmDoorbells(cpu->stub(), host->id, page->name(), 0, 4096, kBuckets, nullptr, ready,
                           done);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "steps on the host")) << s.error_message();
}

// The trainer abandons step 2 after two buckets (-2 on one already taken): nothing written, no
// done event recorded, every word -2; a synchronous retry of step 2 equals a synchronous
// session's.
TEST_F(OverlapDevice, AnAbandonedStepCommitsNothingAndASynchronousRetryApplies) {
  const SessionDesc d = Desc(AlgorithmKind::kDion2, v1::NON_FINITE_POLICY_ERROR);
  Trainer sync = NewTrainer(d, d.Request(), /*cuda=*/true);
  Trainer ov = NewTrainer(d, d.Request(), /*cuda=*/true);
  ASSERT_TRUE(sync.cuda && ov.cuda);
  ASSERT_TRUE(NewPage(ov.id(), /*events=*/true).ok());
  v1::StepResponse want, got;
  ASSERT_TRUE(Synchronous(sync, 1, Grads(d, 1), &want).ok());
  ASSERT_TRUE(Overlapped(ov, 1, Grads(d, 1), &got).ok());
  const std::string weights = ov.Params();
  const TensorMap state = State(ov.id());
  const std::vector<std::vector<float>> g = Grads(d, 2);
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov.id(), 2, &queued).ok());
  for (int k : {2, 0}) {
    for (int32_t i : kBuckets[static_cast<size_t>(k)]) {
      ov.WriteGrad(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
    }
    bells_.RingGradients(k, 2);
  }
  bells_.RingGradients(0, -2);
  const auto h0 = kt::GetHostTestHandoffCounters();
  grpc::Status s = WaitStep(stub(), ov.id(), &got);
  EXPECT_EQ(s.error_code(), StatusCode::ABORTED) << s.error_message();
  EXPECT_EQ(kt::GetHostTestHandoffCounters().event_records, h0.event_records);
  for (int k = 0; k < kBucketCount; ++k) EXPECT_EQ(bells_.weights(k), -2) << "bucket " << k;
  EXPECT_TRUE(ov.Params() == weights) << "an abandoned step wrote weights";
  EXPECT_TRUE(State(ov.id()) == state) << "an abandoned step changed the state";
  for (size_t i = 0; i < g.size(); ++i) ov.WriteGrad(i, g[i]);
  ASSERT_TRUE(Synchronous(sync, 2, g, &want).ok());
  s = Step(ov.id(), 2, 1.0, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSameResult(got, want);
  EXPECT_TRUE(ov.Params() == sync.Params()) << "the weights differ";
  EXPECT_TRUE(State(ov.id()) == State(sync.id())) << "the state differs";
  EXPECT_TRUE(CloseSession(stub(), ov.id()).ok());
  EXPECT_TRUE(CloseSession(stub(), sync.id()).ok());
}

TEST_F(OverlapDevice, ALastBucketNeverRungAndTheSessionClosedCommitsNothing) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  Trainer ov = NewTrainer(d, d.Request(), /*cuda=*/true);
  ASSERT_TRUE(ov.cuda);
  ASSERT_TRUE(NewPage(ov.id(), /*events=*/true).ok());
  const std::string weights = ov.Params();
  const std::vector<std::vector<float>> g = Grads(d, 1);
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov.id(), 1, &queued).ok());
  for (int k : {2, 0}) {  // bucket 1 never comes
    for (int32_t i : kBuckets[static_cast<size_t>(k)]) {
      ov.WriteGrad(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
    }
    bells_.RingGradients(k, 1);
  }
  absl::SleepFor(absl::Milliseconds(50));  // the daemon stages both meanwhile
  const auto h0 = kt::GetHostTestHandoffCounters();
  EXPECT_TRUE(CloseSession(stub(), ov.id()).ok());
  const auto h1 = kt::GetHostTestHandoffCounters();
  EXPECT_EQ(h1.event_records, h0.event_records);
  for (int k = 0; k < kBucketCount; ++k) {
    EXPECT_EQ(bells_.weights(k), -1) << "bucket " << k;
    EXPECT_EQ(Records(done_[static_cast<size_t>(k)]), 0) << "bucket " << k;
  }
  EXPECT_TRUE(ov.Params() == weights) << "a cancelled step wrote weights";
}

}  // namespace
}  // namespace diond::service_testing
