// The trainer's side of an overlapped step (docs/DATA_PLANE.md "Overlapped step") for the
// service suites: a doorbell page in a POSIX shm segment laid out as server/memory/doorbell.h
// reads it, its registration with buckets, and overlapped Steps; the suites' sessions and their
// fixture (a synchronous session beside an overlapped one).
#ifndef DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_
#define DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {

inline int64_t DoorbellBytes(int buckets) { return 64 + 64 * int64_t{buckets}; }

// The page's header ("DIONDDB1", version 1, `buckets`) at `p`, every word 0.
inline void WriteDoorbellHeader(uint8_t* p, uint32_t buckets) {
  std::memset(p, 0, static_cast<size_t>(DoorbellBytes(static_cast<int>(buckets))));
  std::memcpy(p, "DIONDDB1", 8);
  const uint32_t version = 1;
  std::memcpy(p + 8, &version, 4);
  std::memcpy(p + 12, &buckets, 4);
}

// Doorbell words of a page at `base` (the test's mapping).
struct Bells {
  uint8_t* base = nullptr;
  int64_t* word(int k, int which) const {
    return reinterpret_cast<int64_t*>(base + 64 + 64 * int64_t{k} + 8 * which);
  }
  void RingGradients(int k, int64_t step) const {
    __atomic_store_n(word(k, 0), step, __ATOMIC_RELEASE);
  }
  int64_t weights(int k) const { return __atomic_load_n(word(k, 1), __ATOMIC_ACQUIRE); }
  // Polls until every one of `buckets` weights words says `want` (true), or 60 s pass.
  bool AwaitWeights(int buckets, int64_t want) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      bool all = true;
      for (int k = 0; k < buckets; ++k) all = all && weights(k) == want;
      if (all) return true;
      absl::SleepFor(absl::Microseconds(200));
    }
    return false;
  }
};

// RegisterRegion of a DOORBELLS page in shm segment `name` (bucket k with ready_events[k] and
// done_events[k] where given).
inline grpc::Status RegisterShmDoorbells(v1::Optimizer::Stub& stub, const std::string& session,
                                         const std::string& name, int64_t offset, int64_t size,
                                         const std::vector<std::vector<int32_t>>& buckets,
                                         std::string* id = nullptr,
                                         const std::vector<std::string>& ready_events = {},
                                         const std::vector<std::string>& done_events = {}) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(v1::REGION_ROLE_DOORBELLS);
  req.set_kind(v1::REGION_KIND_SYSTEM_SHM);
  req.mutable_system_shm()->set_name(name);
  req.mutable_system_shm()->set_offset_bytes(offset);
  req.mutable_system_shm()->set_size_bytes(size);
  for (size_t k = 0; k < buckets.size(); ++k) {
    v1::Bucket* pb = req.add_buckets();
    for (int32_t i : buckets[k]) pb->add_params(i);
    if (k < ready_events.size()) pb->set_ready_event(ready_events[k]);
    if (k < done_events.size()) pb->set_done_event(done_events[k]);
  }
  v1::RegisterRegionResponse resp;
  grpc::Status st = stub.RegisterRegion(Ctx().get(), req, &resp);
  if (id != nullptr) *id = resp.region_id();
  return st;
}

// Step(index) with asynchronous and overlap as given.
inline grpc::Status OverlapStep(v1::Optimizer::Stub& stub, const std::string& session,
                                int64_t index, v1::StepResponse* resp, bool asynchronous = true) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_step_index(index);
  req.set_asynchronous(asynchronous);
  req.set_overlap(true);
  return stub.Step(Ctx().get(), req, resp);
}

inline grpc::Status WaitStep(v1::Optimizer::Stub& stub, const std::string& session,
                             v1::StepResponse* resp) {
  v1::StepRequest req;
  req.set_session_id(session);
  req.set_wait(true);
  return stub.Step(Ctx().get(), req, resp);
}

// Matrices of three shapes in group "m" (two of one shape in different buckets, so that a
// bucket splits a batch of the rules) and two vectors in AdamW group "v".
inline SessionDesc Desc(optim::AlgorithmKind a,
                        v1::NonFinitePolicy policy = v1::NON_FINITE_POLICY_UNSPECIFIED) {
  SessionDesc d;
  const bool elementwise = a == optim::AlgorithmKind::kAdamW || a == optim::AlgorithmKind::kLion;
  d.groups.push_back(MakeGroup("m", a, elementwise ? 0.001 : 0.02));
  d.groups.push_back(MakeGroup("v", optim::AlgorithmKind::kAdamW, 0.001));
  d.params.push_back({"w1", {24, 16}, "m"});
  d.params.push_back({"w2", {16, 32}, "m"});
  d.params.push_back({"b1", {16}, "v"});
  d.params.push_back({"w3", {24, 16}, "m"});
  d.params.push_back({"w4", {12, 12}, "m"});
  d.params.push_back({"b2", {32}, "v"});
  d.non_finite = policy;
  return d;
}
inline const std::vector<std::vector<int32_t>> kBuckets = {{0, 5}, {1, 3}, {4, 2}};
// Every algorithm, for the suites' parameterized tests, each named by its AlgorithmName.
inline const std::vector<optim::AlgorithmKind> kEveryAlgorithm = {
    optim::AlgorithmKind::kMuon,  optim::AlgorithmKind::kNorMuon,  optim::AlgorithmKind::kDion,
    optim::AlgorithmKind::kDion2, optim::AlgorithmKind::kNorDion2, optim::AlgorithmKind::kAdamW,
    optim::AlgorithmKind::kLion};
inline std::string AlgorithmParamName(const ::testing::TestParamInfo<optim::AlgorithmKind>& i) {
  return std::string(optim::AlgorithmName(i.param));
}
// The order the trainer rings the buckets at step t (backward's order changes nothing).
inline std::vector<int> RingOrder(int64_t t) {
  static const std::vector<int> orders[] = {{2, 0, 1}, {1, 2, 0}, {0, 2, 1}};
  return orders[t % 3];
}

inline std::vector<std::vector<float>> Grads(const SessionDesc& d, int64_t t) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < d.params.size(); ++i) g.push_back(SyntheticValues(7, t, i, d.Numel(i)));
  return g;
}

inline void ExpectSameResult(const v1::StepResponse& got, const v1::StepResponse& want) {
  EXPECT_EQ(got.step_index(), want.step_index());
  EXPECT_EQ(got.skipped(), want.skipped());
  ASSERT_EQ(got.update_norms_size(), want.update_norms_size());
  for (const auto& [g, n] : want.update_norms()) {
    ASSERT_TRUE(got.update_norms().contains(g)) << g;
    EXPECT_EQ(got.update_norms().at(g), n) << g;  // bit for bit
  }
}

// The suites' fixture: one daemon for the suite, a synchronous session and an overlapped one.
class Overlap : public ::testing::Test {
 protected:
  // One compute thread leaves a core to a test's watcher; a bucket's wait of 60 s, not 10 min,
  // fails a test whose step would wait for a bucket never rung.
  static void SetUpTestSuite() {
    daemon_ = Daemon::Start({"--compute_threads=1", "--overlap_bucket_timeout=60s"}).release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr); }
  static v1::Optimizer::Stub& stub() { return daemon_->stub(); }

  // A synchronous session and an overlapped one (with its doorbell page and `buckets`), both
  // holding the initial weights.
  void NewPair(const SessionDesc& d, const std::vector<std::vector<int32_t>>& buckets = kBuckets) {
    sync_ = CreateShmSession(stub(), d.Request());
    ov_ = CreateShmSession(stub(), d.Request());
    ASSERT_NE(sync_, nullptr);
    ASSERT_NE(ov_, nullptr);
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::string w = FloatBytes(SyntheticValues(1, 0, i, d.Numel(i)));
      sync_->params_seg->Write(sync_->tensor(i).param_offset_bytes(), w);
      ov_->params_seg->Write(ov_->tensor(i).param_offset_bytes(), w);
    }
    page_ = ShmSegment::Create(4096);
    ASSERT_NE(page_, nullptr);
    WriteDoorbellHeader(page_->data(), static_cast<uint32_t>(buckets.size()));
    bells_.base = page_->data();
    grpc::Status st = RegisterShmDoorbells(stub(), ov_->id, page_->name(), 0, 4096, buckets);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  // The trainer's backward of step t: bucket by bucket in `order`, its gradients written, then
  // its doorbell rung.
  void Backward(int64_t t, const std::vector<std::vector<float>>& g, const std::vector<int>& order,
                ShmSession* into = nullptr, const Bells* bells = nullptr,
                std::function<void(size_t, const std::vector<float>&)> write = nullptr) {
    if (into == nullptr) into = ov_.get();
    if (bells == nullptr) bells = &bells_;
    if (!write) write = [into](size_t i, const std::vector<float>& v) { into->WriteGrad(i, v); };
    std::thread trainer([&] {
      for (int k : order) {
        for (int32_t i : kBuckets[static_cast<size_t>(k)]) {
          write(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
        }
        absl::SleepFor(absl::Milliseconds(3));  // the daemon stages meanwhile
        bells->RingGradients(k, t);
      }
    });
    trainer.join();
  }

  // Step t on both sessions with gradients g; the overlapped one's collected answer.
  grpc::Status StepBoth(int64_t t, const std::vector<std::vector<float>>& g, v1::StepResponse* want,
                        v1::StepResponse* got) {
    for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, g[i]);
    grpc::Status s = DoStep(stub(), sync_->id, t, want);
    v1::StepResponse queued;
    grpc::Status q = OverlapStep(stub(), ov_->id, t, &queued);
    EXPECT_TRUE(q.ok()) << q.error_message();
    EXPECT_TRUE(queued.queued());
    Backward(t, g, RingOrder(t));
    grpc::Status w = WaitStep(stub(), ov_->id, got);
    EXPECT_EQ(s.error_code(), w.error_code()) << s.error_message() << " / " << w.error_message();
    return w;
  }

  TensorMap State(const std::string& id) {
    TensorMap m;
    grpc::Status st = GetState(stub(), id, true, &m);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return m;
  }
  std::string Arena(const ShmSession& s) {
    return s.params_seg->Bytes(0, s.layout.param_arena_bytes());
  }
  void ExpectSameSessions() {
    EXPECT_TRUE(Arena(*sync_) == Arena(*ov_)) << "the weights differ";
    EXPECT_TRUE(State(sync_->id) == State(ov_->id)) << "the state differs";
  }
  void CloseBoth() {
    EXPECT_TRUE(CloseSession(stub(), sync_->id).ok());
    EXPECT_TRUE(CloseSession(stub(), ov_->id).ok());
  }

  static inline Daemon* daemon_ = nullptr;
  std::unique_ptr<ShmSession> sync_, ov_;
  std::unique_ptr<ShmSegment> page_;
  Bells bells_;
};

}  // namespace diond::service_testing

#endif  // DIOND_TESTS_SERVICE_OVERLAP_HARNESS_H_
