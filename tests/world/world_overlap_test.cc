// The overlapped step of world sessions (docs/DISTRIBUTED.md "Overlapped step") across two real
// daemons on loopback. Each rank's trainer is a thread of the test: it writes its own gradients
// (different per rank under AVERAGE) bucket by bucket in an order of its own, changing every
// step and different on each rank, and rings its doorbells, while its daemon's queued step takes
// the buckets in their declaration order. A synchronous world session with the same gradients,
// stepped beside it, is the reference:
//  - every algorithm under AVERAGE, and Muon and Dion2 under REPLICATED: the weights and the
//    update norms after every step equal the synchronous run's on both ranks, bit for bit;
//  - each bucket's updates are all-gathered before the next bucket rings (the daemons' /metrics);
//  - a NaN in one bucket on one rank (AVERAGE and REPLICATED): both ranks skip (SKIP) or fail
//    with nothing committed (ERROR, then a retry applies);
//  - buckets declared differently, or overlap asked on one rank only: refused on both ranks
//    with FAILED_PRECONDITION, nothing committed, and the world session steps on;
//  - one rank's trainer never rings its last bucket (its wait times out) or abandons the step:
//    both ranks fail with nothing committed, and the retry equals the synchronous run;
//  - max_grad_norm (AVERAGE and REPLICATED): the clipped steps equal the synchronous ones;
//  - DION_COMPRESSED (Dion stepped on every rank, averaging P and R per bucket): the same, and
//    with a NaN and a rank that gives up;
//  - asynchronous steps without overlap (queued, then collected): equal to the synchronous run.
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;
using optim::AlgorithmKind;
constexpr int kW = 2;

void OnRanks(const std::function<void(int)>& f) {
  std::vector<std::thread> t;
  t.reserve(kW);
  for (int r = 0; r < kW; ++r) t.emplace_back(f, r);
  for (auto& th : t) th.join();
}

// One rank's sessions: the synchronous reference and the overlapped one with its page.
struct Rank {
  std::unique_ptr<ShmSession> sync, ov;
  std::unique_ptr<ShmSegment> page;
  Bells bells;
};

class WorldOverlap : public ::testing::Test {
 protected:
  // A bucket's wait of 3 s, well below the peer timeout: a rank whose trainer stopped gives up
  // before its peer's collective times out.
  static void SetUpTestSuite() { StartWorld(""); }
  // Both daemons: the CPU daemon, or `binary` (the TEST-backend device daemon).
  static void StartWorld(const std::string& binary) {
    auto flags = [](int rank, int port) {
      std::vector<std::string> f = {
          absl::StrCat("--world_size=", kW), absl::StrCat("--rank=", rank),
          "--heartbeat_interval=200ms",      "--peer_timeout=10s",
          "--overlap_bucket_timeout=3s",     "--metrics_address=127.0.0.1:0"};
      if (rank > 0) f.push_back(absl::StrCat("--coordinator=127.0.0.1:", port));
      return f;
    };
    auto start = [&](int rank, int port) {
      return (binary.empty() ? Daemon::Start(flags(rank, port), /*tcp=*/true)
                             : Daemon::StartBinary(binary, flags(rank, port), {}, /*tcp=*/true))
          .release();
    };
    daemons_[0] = start(0, 0);
    if (daemons_[0] == nullptr) return;
    daemons_[1] = start(1, daemons_[0]->tcp_port());
  }
  static void TearDownTestSuite() {
    for (Daemon*& d : daemons_) {
      delete d;
      d = nullptr;
    }
  }
  void SetUp() override {
    ASSERT_NE(daemons_[0], nullptr);
    ASSERT_NE(daemons_[1], nullptr);
  }
  static v1::Optimizer::Stub& stub(int r) { return daemons_[r]->stub(); }
  // How many all-gather-v collectives rank r's daemon has run (its /metrics).
  static int Gathers(int r) {
    const std::string body = testing::HttpGet(daemons_[r]->metrics_port(), "/metrics");
    const std::string key = "diond_collective_seconds_count{op=\"all_gather_v\"} ";
    const size_t at = body.find(key);
    return at == std::string::npos ? 0 : std::stoi(body.substr(at + key.size()));
  }

  // Both sessions on both ranks, with the same initial weights; rank r's page declares
  // buckets[r].
  void Create(const SessionDesc& d, v1::GradientSync sync, const std::string& key,
              const std::vector<std::vector<std::vector<int32_t>>>& buckets = {kBuckets,
                                                                               kBuckets}) {
    desc_ = d;
    sync_mode_ = sync;
    for (const char* kind : {"sync", "ov"}) {
      v1::CreateSessionRequest req = d.Request();
      req.set_gradient_sync(sync);
      req.set_world_key(absl::StrCat(key, "-", kind));
      OnRanks([&](int r) {
        (std::string(kind) == "sync" ? ranks_[r].sync : ranks_[r].ov) =
            CreateShmSession(stub(r), req);
      });
    }
    for (int r = 0; r < kW; ++r) {
      Rank& k = ranks_[r];
      ASSERT_NE(k.sync, nullptr);
      ASSERT_NE(k.ov, nullptr);
      for (size_t i = 0; i < d.params.size(); ++i) {
        const std::string w = FloatBytes(SyntheticValues(1, 0, i, d.Numel(i)));
        k.sync->params_seg->Write(k.sync->tensor(i).param_offset_bytes(), w);
        k.ov->params_seg->Write(k.ov->tensor(i).param_offset_bytes(), w);
      }
      k.page = ShmSegment::Create(4096);
      ASSERT_NE(k.page, nullptr);
      WriteDoorbellHeader(k.page->data(), static_cast<uint32_t>(buckets[r].size()));
      k.bells.base = k.page->data();
      grpc::Status st =
          RegisterShmDoorbells(stub(r), k.ov->id, k.page->name(), 0, 4096, buckets[r]);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
  }
  // Rank r's gradients of step t (the same on every rank under REPLICATED).
  std::vector<std::vector<float>> Grads(int r, int64_t t) const {
    const uint64_t seed = sync_mode_ == v1::GRADIENT_SYNC_REPLICATED ? 7 : 7 + r;
    std::vector<std::vector<float>> g;
    for (size_t i = 0; i < desc_.params.size(); ++i) {
      g.push_back(SyntheticValues(seed, t, i, desc_.Numel(i)));
    }
    return g;
  }
  // Step t of session `id` on rank r: synchronous, or overlapped (queued); with max_grad_norm_.
  grpc::Status Send(int r, const std::string& id, int64_t t, bool overlap, v1::StepResponse* resp) {
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_step_index(t);
    req.set_asynchronous(overlap);
    req.set_overlap(overlap);
    req.set_max_grad_norm(max_grad_norm_);
    return stub(r).Step(Ctx().get(), req, resp);
  }
  // The synchronous reference's step t on both ranks.
  void SyncStep(int64_t t, const std::vector<std::vector<std::vector<float>>>& g,
                v1::StepResponse* resp) {
    OnRanks([&](int r) {
      for (size_t i = 0; i < g[r].size(); ++i) ranks_[r].sync->WriteGrad(i, g[r][i]);
      grpc::Status st = Send(r, ranks_[r].sync->id, t, /*overlap=*/false, &resp[r]);
      EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
    });
  }
  // The overlapped step t on both ranks: queued, then each trainer's backward rings the buckets
  // in `order(r)` (a bucket it leaves out is never rung; `abandon` on rank r: -t on bucket 0
  // first), then the collected answers.
  void OverlapStep(int64_t t, const std::vector<std::vector<std::vector<float>>>& g,
                   v1::StepResponse* resp, grpc::Status* st,
                   const std::function<std::vector<int>(int)>& order = nullptr, int abandon = -1) {
    OnRanks([&](int r) {
      Rank& k = ranks_[r];
      if (retry_) {
        // The doorbells of a failed try still say t (or -t): every gradient is written, and
        // every bucket rung, before the Step.
        for (size_t i = 0; i < g[r].size(); ++i) k.ov->WriteGrad(i, g[r][i]);
        for (int b = 0; b < 3; ++b) k.bells.RingGradients(b, t);
      }
      v1::StepResponse queued;
      grpc::Status q = Send(r, k.ov->id, t, /*overlap=*/true, &queued);
      ASSERT_TRUE(q.ok()) << q.error_message();
      ASSERT_TRUE(queued.queued());
      if (abandon == r) k.bells.RingGradients(0, -t);
      const std::vector<int> ring = order ? order(r) : RingOrder(t + r);
      for (int b : ring) {
        for (int32_t i : kBuckets[static_cast<size_t>(b)]) {
          k.ov->WriteGrad(static_cast<size_t>(i), g[r][static_cast<size_t>(i)]);
        }
        absl::SleepFor(absl::Milliseconds(2));
        k.bells.RingGradients(b, t);
      }
      st[r] = WaitStep(stub(r), k.ov->id, &resp[r]);
    });
  }
  std::string Arena(const ShmSession& s) const {
    return s.params_seg->Bytes(0, s.layout.param_arena_bytes());
  }
  // Both ranks' overlapped weights equal the reference's (which agree across the ranks).
  void ExpectSameWeights() {
    for (int r = 0; r < kW; ++r) {
      EXPECT_TRUE(Arena(*ranks_[r].ov) == Arena(*ranks_[r].sync)) << "rank " << r;
      EXPECT_TRUE(Arena(*ranks_[r].ov) == Arena(*ranks_[0].ov)) << "rank " << r;
    }
  }
  // Steps 1..n both ways, every answer and weight alike.
  void StepsAlike(int64_t from, int64_t to) {
    for (int64_t t = from; t <= to; ++t) {
      SCOPED_TRACE(absl::StrCat("step ", t));
      std::vector<std::vector<std::vector<float>>> g = {Grads(0, t), Grads(1, t)};
      v1::StepResponse want[kW], got[kW];
      grpc::Status st[kW];
      SyncStep(t, g, want);
      OverlapStep(t, g, got, st);
      for (int r = 0; r < kW; ++r) {
        ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
        ExpectSameResult(got[r], want[r]);
        EXPECT_EQ(got[r].grad_norm(), want[r].grad_norm());
        EXPECT_FALSE(got[r].skipped());
        EXPECT_GT(got[r].world_bytes_sent(), 0);
        for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), t);
      }
      ExpectSameWeights();
      retry_ = false;
    }
  }
  // Steps 1-3 alike (StepsAlike) for each (algorithm, sync), in world sessions named after them.
  void EachAlike(const std::vector<std::pair<AlgorithmKind, v1::GradientSync>>& cases,
                 const std::string& prefix) {
    for (const auto& [a, sync] : cases) {
      SCOPED_TRACE(optim::AlgorithmName(a));
      Create(Desc(a), sync, absl::StrCat(prefix, optim::AlgorithmName(a), "-", sync));
      StepsAlike(1, 3);
      CloseAll();
    }
  }
  // ARankThatGivesUpFailsBothAndTheRetryApplies under `sync`.
  void GiveUpThenRetry(v1::GradientSync sync);
  // EachBucketsUpdatesAreExchangedBeforeTheNextBucketRings.
  void BucketsExchangedBeforeTheLastRings();
  void CloseAll() {
    for (int r = 0; r < kW; ++r) {
      EXPECT_TRUE(CloseSession(stub(r), ranks_[r].sync->id).ok());
      EXPECT_TRUE(CloseSession(stub(r), ranks_[r].ov->id).ok());
    }
  }

  static inline Daemon* daemons_[kW] = {nullptr, nullptr};
  SessionDesc desc_;
  v1::GradientSync sync_mode_ = v1::GRADIENT_SYNC_AVERAGE;
  Rank ranks_[kW];
  bool retry_ = false;  // the next step retries one that failed
  double max_grad_norm_ = 0;
};

class WorldOverlapEveryAlgorithm : public WorldOverlap,
                                   public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(WorldOverlapEveryAlgorithm, AverageEqualsSynchronousBitForBit) {
  Create(Desc(GetParam()), v1::GRADIENT_SYNC_AVERAGE,
         absl::StrCat("avg-", optim::AlgorithmName(GetParam())));
  StepsAlike(1, 3);
  CloseAll();
}

INSTANTIATE_TEST_SUITE_P(All, WorldOverlapEveryAlgorithm, ::testing::ValuesIn(kEveryAlgorithm),
                         AlgorithmParamName);

TEST_F(WorldOverlap, ReplicatedEqualsSynchronousBitForBit) {
  EachAlike({{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_REPLICATED},
             {AlgorithmKind::kDion2, v1::GRADIENT_SYNC_REPLICATED}},
            "rep-");
}

// max_grad_norm: the buckets are only read (and reduced), then the clip (of the averaged
// gradients under AVERAGE, with its all-gather) and the staging, as the synchronous step does.
TEST_F(WorldOverlap, AClipEqualsSynchronousBitForBit) {
  max_grad_norm_ = 0.5;  // below the gradients' norm: every step clips
  EachAlike({{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kDion2, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED}},
            "clip-");
  max_grad_norm_ = 0;
}

// A NaN in bucket 1 on rank 1 only: under SKIP both ranks skip the step, as the synchronous
// run does; under ERROR both fail with every weights word -2, and a retry of 2 applies.
TEST_F(WorldOverlap, ANanInOneBucketOnOneRankDecidesBothRanksAlike) {
  for (const auto& [policy, sync] :
       {std::pair{v1::NON_FINITE_POLICY_SKIP, v1::GRADIENT_SYNC_AVERAGE},
        std::pair{v1::NON_FINITE_POLICY_ERROR, v1::GRADIENT_SYNC_AVERAGE},
        std::pair{v1::NON_FINITE_POLICY_SKIP, v1::GRADIENT_SYNC_REPLICATED},
        std::pair{v1::NON_FINITE_POLICY_ERROR, v1::GRADIENT_SYNC_REPLICATED},
        std::pair{v1::NON_FINITE_POLICY_SKIP, v1::GRADIENT_SYNC_DION_COMPRESSED}}) {
    SCOPED_TRACE(absl::StrCat(policy, " ", sync));
    // (The NaN is in w2, a Dion matrix every rank steps on its own gradient under compressed.)
    const AlgorithmKind a =
        sync == v1::GRADIENT_SYNC_DION_COMPRESSED ? AlgorithmKind::kDion : AlgorithmKind::kMuon;
    Create(Desc(a, policy), sync, absl::StrCat("nan-", policy, "-", sync));
    StepsAlike(1, 1);
    std::vector<std::vector<std::vector<float>>> g = {Grads(0, 2), Grads(1, 2)};
    g[1][static_cast<size_t>(kBuckets[1][0])][3] = std::nanf("");
    const std::string before = Arena(*ranks_[0].ov);
    v1::StepResponse got[kW];
    grpc::Status st[kW];
    OverlapStep(2, g, got, st);
    for (int r = 0; r < kW; ++r) {
      EXPECT_EQ(Arena(*ranks_[r].ov), before) << "rank " << r;
      if (policy == v1::NON_FINITE_POLICY_SKIP) {
        ASSERT_TRUE(st[r].ok()) << st[r].error_message();
        EXPECT_TRUE(got[r].skipped()) << "rank " << r;
        for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), 2);
      } else {
        EXPECT_EQ(st[r].error_code(), StatusCode::INVALID_ARGUMENT) << st[r].error_message();
        EXPECT_TRUE(absl::StrContains(st[r].error_message(), "NaN or Inf"));
        for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), -2);
      }
    }
    v1::StepResponse want[kW];
    if (policy == v1::NON_FINITE_POLICY_SKIP) {
      SyncStep(2, g, want);  // the reference skips it too
      for (int r = 0; r < kW; ++r) EXPECT_TRUE(want[r].skipped());
      ExpectSameWeights();
      StepsAlike(3, 3);
    } else {
      retry_ = true;
      StepsAlike(2, 3);  // the retry of 2, with finite gradients
    }
    CloseAll();
  }
}

// Rank 1 declares its buckets differently (the same parameters, in another order within
// bucket 1): both ranks refuse the step before anything changes; then rank 1 steps
// synchronously while rank 0 overlaps: refused alike; synchronous steps go on.
TEST_F(WorldOverlap, MismatchedStepsAreRefusedOnBothRanks) {
  std::vector<std::vector<int32_t>> other = kBuckets;
  std::swap(other[1][0], other[1][1]);
  Create(Desc(AlgorithmKind::kAdamW), v1::GRADIENT_SYNC_AVERAGE, "mismatch", {kBuckets, other});
  const std::string before = Arena(*ranks_[0].ov);
  std::vector<std::vector<std::vector<float>>> g = {Grads(0, 1), Grads(1, 1)};
  v1::StepResponse got[kW];
  grpc::Status st[kW];
  OverlapStep(1, g, got, st);
  for (int r = 0; r < kW; ++r) {
    EXPECT_EQ(st[r].error_code(), StatusCode::FAILED_PRECONDITION) << st[r].error_message();
    EXPECT_TRUE(absl::StrContains(st[r].error_message(), "doorbell buckets differ"))
        << st[r].error_message();
    EXPECT_EQ(Arena(*ranks_[r].ov), before);
    for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), -1);
  }
  // Overlap on rank 0 only.
  OnRanks([&](int r) {
    Rank& k = ranks_[r];
    for (size_t i = 0; i < g[r].size(); ++i) k.ov->WriteGrad(i, g[r][i]);
    v1::StepResponse resp;
    if (r == 0) {
      ASSERT_TRUE(service_testing::OverlapStep(stub(r), k.ov->id, 1, &resp).ok());
      for (int b = 0; b < 3; ++b) k.bells.RingGradients(b, 1);
      st[r] = WaitStep(stub(r), k.ov->id, &resp);
    } else {
      st[r] = DoStep(stub(r), k.ov->id, 1, &resp);
    }
  });
  for (int r = 0; r < kW; ++r) {
    EXPECT_EQ(st[r].error_code(), StatusCode::FAILED_PRECONDITION) << st[r].error_message();
    EXPECT_TRUE(absl::StrContains(st[r].error_message(), "asked on 1 of 2 ranks"))
        << st[r].error_message();
    EXPECT_EQ(Arena(*ranks_[r].ov), before);
  }
  // The world session is intact: a synchronous step 1 applies on both, as the reference's.
  v1::StepResponse want[kW];
  SyncStep(1, g, want);
  OnRanks([&](int r) {
    v1::StepResponse resp;
    grpc::Status s = DoStep(stub(r), ranks_[r].ov->id, 1, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  });
  ExpectSameWeights();
  CloseAll();
}

// Rank 1's trainer never rings bucket 2: its wait times out (3 s), it still joins bucket 2's
// reduce-scatter (AVERAGE, DION_COMPRESSED) or its exchange (REPLICATED) with its give-up flag, and
// both ranks fail with nothing committed; then rank 1's trainer abandons step 1 (-1 on a bucket):
// the same. The retries equal the reference.
TEST_F(WorldOverlap, ARankThatGivesUpFailsBothAndTheRetryApplies) {
  for (v1::GradientSync sync : {v1::GRADIENT_SYNC_AVERAGE, v1::GRADIENT_SYNC_REPLICATED,
                                v1::GRADIENT_SYNC_DION_COMPRESSED}) {
    SCOPED_TRACE(sync);
    GiveUpThenRetry(sync);
  }
}

// Buckets 0 and 1 rung, bucket 2 not yet: both daemons have already all-gathered the updates of
// buckets 0 and 1 (one all-gather-v each) and written nothing; then bucket 2 rings, and the
// step (one more per bucket, then the norms') equals the synchronous one. New values (Muon,
// AdamW, Dion at full rank) and compact updates (Dion2), under AVERAGE and REPLICATED.
TEST_F(WorldOverlap, EachBucketsUpdatesAreExchangedBeforeTheNextBucketRings) {
  BucketsExchangedBeforeTheLastRings();
}

void WorldOverlap::BucketsExchangedBeforeTheLastRings() {
  for (const auto& [a, sync] : {std::pair{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
                                std::pair{AlgorithmKind::kDion, v1::GRADIENT_SYNC_AVERAGE},
                                std::pair{AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED},
                                std::pair{AlgorithmKind::kDion2, v1::GRADIENT_SYNC_REPLICATED}}) {
    SCOPED_TRACE(optim::AlgorithmName(a));
    Create(Desc(a), sync, absl::StrCat("per-bucket-", optim::AlgorithmName(a), "-", sync));
    for (int64_t t = 1; t <= 2; ++t) {
      std::vector<std::vector<std::vector<float>>> g = {Grads(0, t), Grads(1, t)};
      v1::StepResponse want[kW], got[kW];
      grpc::Status st[kW];
      SyncStep(t, g, want);
      OnRanks([&](int r) {
        Rank& k = ranks_[r];
        const int before = Gathers(r);
        v1::StepResponse queued;
        ASSERT_TRUE(Send(r, k.ov->id, t, /*overlap=*/true, &queued).ok());
        auto ring = [&](int b) {
          for (int32_t i : kBuckets[static_cast<size_t>(b)]) {
            k.ov->WriteGrad(static_cast<size_t>(i), g[r][static_cast<size_t>(i)]);
          }
          k.bells.RingGradients(b, t);
        };
        ring(1);
        ring(0);
        const absl::Time deadline = absl::Now() + absl::Seconds(20);
        while (Gathers(r) < before + 2 && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(10));
        }
        EXPECT_EQ(Gathers(r) - before, 2) << "rank " << r << ": before bucket 2 rang";
        for (int b = 0; b < 3; ++b) EXPECT_NE(k.bells.weights(b), t) << "bucket " << b;
        ring(2);
        st[r] = WaitStep(stub(r), k.ov->id, &got[r]);
        EXPECT_EQ(Gathers(r) - before, 4) << "rank " << r;
      });
      for (int r = 0; r < kW; ++r) {
        ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].error_message();
        ExpectSameResult(got[r], want[r]);
        for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), t);
      }
      ExpectSameWeights();
    }
    CloseAll();
  }
}

void WorldOverlap::GiveUpThenRetry(v1::GradientSync sync) {
  Create(Desc(AlgorithmKind::kDion), sync, absl::StrCat("give-up-", sync));
  const std::string before = Arena(*ranks_[0].ov);
  std::vector<std::vector<std::vector<float>>> g = {Grads(0, 1), Grads(1, 1)};
  v1::StepResponse got[kW];
  grpc::Status st[kW];
  auto check = [&](StatusCode code, const std::string& text) {
    EXPECT_EQ(st[1].error_code(), code) << st[1].error_message();
    EXPECT_TRUE(absl::StrContains(st[1].error_message(), text)) << st[1].error_message();
    EXPECT_EQ(st[0].error_code(), StatusCode::ABORTED) << st[0].error_message();
    EXPECT_TRUE(absl::StrContains(st[0].error_message(), "given up on rank(s) 1"))
        << st[0].error_message();
    for (int r = 0; r < kW; ++r) {
      EXPECT_EQ(Arena(*ranks_[r].ov), before) << "rank " << r;
      for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), -1);
    }
  };
  OverlapStep(1, g, got, st, [](int r) { return r == 1 ? std::vector<int>{1, 0} : RingOrder(1); });
  check(StatusCode::DEADLINE_EXCEEDED, "");
  OverlapStep(
      1, g, got, st, [](int r) { return r == 1 ? std::vector<int>{} : RingOrder(1); },
      /*abandon=*/1);
  check(StatusCode::ABORTED, "abandon");
  retry_ = true;
  StepsAlike(1, 2);
  CloseAll();
}

// Asynchronous steps that do not overlap: each rank's queued step runs the synchronous world
// step on its session's thread, and the trainer collects it with a wait before it writes the next
// gradients. Every answer and the weights equal the synchronous run's bit for bit.
TEST_F(WorldOverlap, AsynchronousStepsEqualSynchronousBitForBit) {
  Create(Desc(AlgorithmKind::kDion2), v1::GRADIENT_SYNC_AVERAGE, "async");
  for (int64_t t = 1; t <= 3; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    std::vector<std::vector<std::vector<float>>> g = {Grads(0, t), Grads(1, t)};
    v1::StepResponse want[kW], got[kW];
    SyncStep(t, g, want);
    OnRanks([&](int r) {
      Rank& k = ranks_[r];
      for (size_t i = 0; i < g[r].size(); ++i) k.ov->WriteGrad(i, g[r][i]);
      v1::StepRequest req;
      req.set_session_id(k.ov->id);
      req.set_step_index(t);
      req.set_asynchronous(true);
      v1::StepResponse q;
      grpc::Status st = stub(r).Step(Ctx().get(), req, &q);
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
      EXPECT_TRUE(q.queued());
      st = WaitStep(stub(r), k.ov->id, &got[r]);
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
    });
    for (int r = 0; r < kW; ++r) {
      EXPECT_EQ(got[r].step_index(), t);
      ExpectSameResult(got[r], want[r]);
    }
    ExpectSameWeights();
  }
  CloseAll();
}

// DION_COMPRESSED: each rank steps every Dion matrix on its own gradients, bucket by bucket,
// its rule averaging P and R with the other rank's same part (w1 and w3, one shape, are in
// different buckets: two sub-batches where the synchronous step has one); the AdamW group is
// reduced and exchanged as under AVERAGE.
TEST_F(WorldOverlap, DionCompressedEqualsSynchronousBitForBit) {
  EachAlike({{AlgorithmKind::kDion, v1::GRADIENT_SYNC_DION_COMPRESSED}}, "cmp-");
}

// The same on two device daemons (diond_testdevice, the strict TEST backend; sessions over
// shm): the buckets read into the device staging, reduce-scattered and exchanged in device
// buffers over the step's device collectives (staged through Gloo here), equal to a synchronous
// world device session bit for bit (compressed Dion and a clip too); the exchange per bucket, a
// NaN, a rank that gives up.
class WorldOverlapDevice : public WorldOverlap {
 protected:
  static void SetUpTestSuite() { StartWorld(DIOND_TESTDEVICE_BINARY); }
};

TEST_F(WorldOverlapDevice, EqualsASynchronousWorldDeviceSessionBitForBit) {
  EachAlike({{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kDion2, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kDion, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED},
             {AlgorithmKind::kLion, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kDion, v1::GRADIENT_SYNC_DION_COMPRESSED}},
            "dev-");
}

// max_grad_norm on device daemons: the norms by the device, then as AClipEqualsSynchronous.
TEST_F(WorldOverlapDevice, AClipEqualsSynchronousBitForBit) {
  max_grad_norm_ = 0.5;
  EachAlike({{AlgorithmKind::kMuon, v1::GRADIENT_SYNC_AVERAGE},
             {AlgorithmKind::kAdamW, v1::GRADIENT_SYNC_REPLICATED}},
            "dev-clip-");
  max_grad_norm_ = 0;
}

TEST_F(WorldOverlapDevice, EachBucketsUpdatesAreExchangedBeforeTheNextBucketRings) {
  BucketsExchangedBeforeTheLastRings();
}

TEST_F(WorldOverlapDevice, ANanInOneBucketOnOneRankSkipsOnBoth) {
  Create(Desc(AlgorithmKind::kMuon, v1::NON_FINITE_POLICY_SKIP), v1::GRADIENT_SYNC_AVERAGE,
         "dev-nan");
  StepsAlike(1, 1);
  std::vector<std::vector<std::vector<float>>> g = {Grads(0, 2), Grads(1, 2)};
  g[1][static_cast<size_t>(kBuckets[1][0])][3] = std::nanf("");
  const std::string before = Arena(*ranks_[0].ov);
  v1::StepResponse got[kW], want[kW];
  grpc::Status st[kW];
  OverlapStep(2, g, got, st);
  SyncStep(2, g, want);
  for (int r = 0; r < kW; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].error_message();
    EXPECT_TRUE(got[r].skipped() && want[r].skipped()) << "rank " << r;
    EXPECT_EQ(Arena(*ranks_[r].ov), before) << "rank " << r;
    for (int b = 0; b < 3; ++b) EXPECT_EQ(ranks_[r].bells.weights(b), 2);
  }
  StepsAlike(3, 3);
  CloseAll();
}

TEST_F(WorldOverlapDevice, ARankThatGivesUpFailsBothAndTheRetryApplies) {
  GiveUpThenRetry(v1::GRADIENT_SYNC_AVERAGE);
}

}  // namespace
}  // namespace diond::service_testing
