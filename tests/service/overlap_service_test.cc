// The overlapped step (StepRequest.overlap; docs/DATA_PLANE.md "Overlapped step") against the
// real daemon over POSIX shared memory. The test is the trainer: it writes each bucket's
// gradients and rings its doorbell from a thread, in an order of its own, while the daemon's
// queued step stages the rung buckets.
//  - for every algorithm, N overlapped steps give a synchronous session's weights, state and
//    update norms bit for bit, and every weights doorbell says N after step N;
//  - the write-back bucket by bucket, watched from another thread: the weights words ring in
//    the reverse of the ringing order, each bucket's bytes final when its word says N;
//  - the same over sealed memfd regions (arenas and doorbell page), sent on the fd channel;
//  - a NaN in one bucket: under SKIP the step is skipped (weights and state unchanged, every
//    weights doorbell = N); under ERROR it fails (every weights doorbell = -N, the wait reports
//    the error) and a retry of N applies;
//  - a trainer that abandons a step (-N on a bucket's gradients word): the step fails with
//    nothing committed and a synchronous retry of N applies;
//  - a trainer that never rings its last bucket and closes the session: the wait is cancelled,
//    nothing is written, the daemon keeps serving;
//  - a hostile client's bad doorbell pages, buckets and overlapped Steps: INVALID_ARGUMENT or
//    FAILED_PRECONDITION naming what is wrong, nothing queued.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;
using optim::AlgorithmKind;

// ---- the trainer's side of the fd channel (as memfd_service_test's) ---------------------------

// A sealed memfd of `bytes`, mapped; its token from the daemon's fd channel at `path`.
struct SealedMemfd {
  int fd = -1;
  uint8_t* base = nullptr;
  int64_t size = 0;
  ~SealedMemfd() {
    if (base != nullptr) munmap(base, static_cast<size_t>(size));
    if (fd >= 0) close(fd);
  }
};
std::unique_ptr<SealedMemfd> MakeSealedMemfd(int64_t bytes) {
  auto m = std::make_unique<SealedMemfd>();
  m->fd = memfd_create("overlap-service-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(m->fd, 0);
  EXPECT_EQ(ftruncate(m->fd, bytes), 0);
  EXPECT_EQ(fcntl(m->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  m->size = bytes;
  m->base = static_cast<uint8_t*>(
      mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0));
  return m;
}
std::string FdToken(const std::string& path, int fd) {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  EXPECT_EQ(connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << path;
  std::string h = "DIONDFD1";
  for (uint32_t v : {1u, 1u}) {
    for (int i = 0; i < 4; ++i) h += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  iovec iov{h.data(), h.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  char control[CMSG_SPACE(sizeof(int))] = {};
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  EXPECT_EQ(sendmsg(s, &m, MSG_NOSIGNAL), static_cast<ssize_t>(h.size()));
  // The reply: "DIONDFD1", u32 code (0: the text is the token), u32 length, the text.
  std::string reply;
  char buf[512];
  auto length = [&] {
    uint32_t n = 0;
    std::memcpy(&n, reply.data() + 12, 4);
    return size_t{16} + n;
  };
  for (ssize_t r; (r = recv(s, buf, sizeof(buf), 0)) > 0;) {
    reply.append(buf, static_cast<size_t>(r));
    if (reply.size() >= 16 && reply.size() >= length()) break;
  }
  close(s);
  if (reply.size() < 16 || reply[8] != 0) {
    ADD_FAILURE() << "fd channel: " << reply;
    return std::string();
  }
  return reply.substr(16, length() - 16);
}
grpc::Status RegisterMemfd(v1::Optimizer::Stub& stub, const std::string& session,
                           v1::RegionRole role, const std::string& token, int64_t offset,
                           int64_t size, const std::vector<std::vector<int32_t>>& buckets = {}) {
  v1::RegisterRegionRequest req;
  req.set_session_id(session);
  req.set_role(role);
  req.set_kind(v1::REGION_KIND_MEMFD);
  req.mutable_memfd()->set_fd_token(token);
  req.mutable_memfd()->set_offset_bytes(offset);
  req.mutable_memfd()->set_size_bytes(size);
  for (const auto& b : buckets) {
    v1::Bucket* pb = req.add_buckets();
    for (int32_t i : b) pb->add_params(i);
  }
  v1::RegisterRegionResponse resp;
  return stub.RegisterRegion(Ctx().get(), req, &resp);
}

class OverlapEveryAlgorithm : public Overlap,
                              public ::testing::WithParamInterface<AlgorithmKind> {};

TEST_P(OverlapEveryAlgorithm, StepsEqualSynchronousStepsBitForBit) {
  const SessionDesc d = Desc(GetParam());
  NewPair(d);
  constexpr int64_t kSteps = 4;
  for (int64_t t = 1; t <= kSteps; ++t) {
    v1::StepResponse want, got;
    grpc::Status s = StepBoth(t, Grads(d, t), &want, &got);
    ASSERT_TRUE(s.ok()) << t << ": " << s.error_message();
    ExpectSameResult(got, want);
    EXPECT_FALSE(got.skipped());
    for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), t) << "bucket " << k;
  }
  ExpectSameSessions();
  CloseBoth();
}

INSTANTIATE_TEST_SUITE_P(All, OverlapEveryAlgorithm, ::testing::ValuesIn(kEveryAlgorithm),
                         AlgorithmParamName);

// The write-back bucket by bucket, watched from another thread as the trainer's next forward
// would: no bucket's weights word says N before those of the buckets rung after it (the reverse
// of the ringing order), each bucket's first and last bytes are final once its word says N, and
// a bucket not yet rung is then, at least once, still unwritten (the words are not all rung
// after the whole write). Each bucket holds 16 MiB of AdamW vectors, so that its write lasts
// long enough for the watcher (which spins, on the core the daemon's one compute thread leaves)
// to see a bucket rung before the next is written; the trainer rings them 100 ms apart, so
// that the daemon takes them in the order rung.
TEST_F(Overlap, TheWeightsAreWrittenAndRungBucketByBucket) {
  SessionDesc d;
  d.groups.push_back(MakeGroup("m", AlgorithmKind::kMuon, 0.02));
  d.groups.push_back(MakeGroup("v", AlgorithmKind::kAdamW, 0.001));
  constexpr int64_t kBig = int64_t{1} << 19;  // 2 MiB: GetState sends it in one message
  constexpr int kVectors = 8;                 // 16 MiB a bucket
  std::vector<std::vector<int32_t>> buckets(3);
  for (int k = 0; k < 3; ++k) {
    buckets[static_cast<size_t>(k)].push_back(static_cast<int32_t>(d.params.size()));
    d.params.push_back({absl::StrCat("w", k), {16, 16}, "m"});
    for (int v = 0; v < kVectors; ++v) {
      buckets[static_cast<size_t>(k)].push_back(static_cast<int32_t>(d.params.size()));
      d.params.push_back({absl::StrCat("v", k, "_", v), {kBig}, "v"});
    }
  }
  NewPair(d, buckets);
  // The first and the last 64 bytes of bucket k's write-back.
  auto ends = [&](const ShmSession& s, int k) {
    const std::vector<int32_t>& b = buckets[static_cast<size_t>(k)];
    const v1::TensorLayout& last = s.tensor(static_cast<size_t>(b.back()));
    return s.params_seg->Bytes(s.tensor(static_cast<size_t>(b[0])).param_offset_bytes(), 64) +
           s.params_seg->Bytes(last.param_offset_bytes() + last.size_bytes() - 64, 64);
  };
  int unwritten_at_a_ring = 0;
  for (int64_t t = 1; t <= 4; ++t) {
    const std::vector<std::vector<float>> g = Grads(d, t);
    for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, g[i]);
    v1::StepResponse want, queued, got;
    ASSERT_TRUE(DoStep(stub(), sync_->id, t, &want).ok());
    std::vector<std::string> final_ends;
    for (int k = 0; k < 3; ++k) final_ends.push_back(ends(*sync_, k));
    ASSERT_TRUE(OverlapStep(stub(), ov_->id, t, &queued).ok());
    // Per bucket: the watcher's pass that first saw its word at t, and its ends then.
    std::vector<int> seen_pass(3, 0);
    std::vector<std::string> at_ring(3);
    std::thread watcher([&] {
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      int seen = 0;
      for (int pass = 1; seen < 3 && absl::Now() < deadline; ++pass) {
        // In the order rung: a bucket seen written back is never seen before one that the
        // daemon wrote back before it (its word, read later, cannot be older).
        for (int k : RingOrder(t)) {
          if (seen_pass[static_cast<size_t>(k)] != 0 || bells_.weights(k) != t) continue;
          seen_pass[static_cast<size_t>(k)] = pass;
          ++seen;
          at_ring[static_cast<size_t>(k)] = ends(*ov_, k);
          for (int j = 0; j < 3; ++j) {
            if (seen_pass[static_cast<size_t>(j)] == 0 && bells_.weights(j) != t &&
                ends(*ov_, j) != final_ends[static_cast<size_t>(j)]) {
              ++unwritten_at_a_ring;
            }
          }
        }
      }
    });
    for (int k : RingOrder(t)) {
      absl::SleepFor(absl::Milliseconds(100));
      for (int32_t i : buckets[static_cast<size_t>(k)]) {
        ov_->WriteGrad(static_cast<size_t>(i), g[static_cast<size_t>(i)]);
      }
      bells_.RingGradients(k, t);
    }
    watcher.join();
    grpc::Status s = WaitStep(stub(), ov_->id, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectSameResult(got, want);
    const std::vector<int> rung = RingOrder(t);
    for (size_t i = 0; i + 1 < rung.size(); ++i) {
      EXPECT_GE(seen_pass[static_cast<size_t>(rung[i])],
                seen_pass[static_cast<size_t>(rung[i + 1])])
          << "step " << t << ": bucket " << rung[i] << " was written back before bucket "
          << rung[i + 1] << ", rung after it";
    }
    for (int k = 0; k < 3; ++k) {
      EXPECT_NE(seen_pass[static_cast<size_t>(k)], 0) << "step " << t << ": bucket " << k;
      EXPECT_TRUE(at_ring[static_cast<size_t>(k)] == final_ends[static_cast<size_t>(k)])
          << "step " << t << ": bucket " << k << " was rung before its weights were written";
    }
  }
  EXPECT_GT(unwritten_at_a_ring, 0) << "every bucket was written before the first was rung";
  ExpectSameSessions();
  CloseBoth();
}

TEST_F(Overlap, ANaNInOneBucketSkipsTheWholeStepUnderSkip) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon, v1::NON_FINITE_POLICY_SKIP);
  NewPair(d);
  v1::StepResponse want, got;
  ASSERT_TRUE(StepBoth(1, Grads(d, 1), &want, &got).ok());
  const std::string arena = Arena(*ov_);
  const TensorMap state = State(ov_->id);
  std::vector<std::vector<float>> g = Grads(d, 2);
  g[1][5] = std::numeric_limits<float>::quiet_NaN();  // w2, bucket 1, rung in the middle
  ASSERT_TRUE(StepBoth(2, g, &want, &got).ok());
  EXPECT_TRUE(want.skipped());
  EXPECT_TRUE(got.skipped());
  EXPECT_TRUE(Arena(*ov_) == arena) << "a skipped step wrote weights";
  EXPECT_TRUE(State(ov_->id) == state) << "a skipped step changed the state";
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), 2) << "bucket " << k;
  ASSERT_TRUE(StepBoth(3, Grads(d, 3), &want, &got).ok());
  ExpectSameResult(got, want);
  ExpectSameSessions();
  CloseBoth();
}

TEST_F(Overlap, ANaNInOneBucketFailsTheStepUnderErrorAndARetryApplies) {
  const SessionDesc d = Desc(AlgorithmKind::kDion2, v1::NON_FINITE_POLICY_ERROR);
  NewPair(d);
  v1::StepResponse want, got;
  ASSERT_TRUE(StepBoth(1, Grads(d, 1), &want, &got).ok());
  const std::string arena = Arena(*ov_);
  const TensorMap state = State(ov_->id);
  std::vector<std::vector<float>> g = Grads(d, 2);
  g[5][0] = std::numeric_limits<float>::infinity();  // b2, bucket 0
  grpc::Status s = StepBoth(2, g, &want, &got);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "asynchronous step 2 failed"))
      << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "NaN or Inf")) << s.error_message();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), -2) << "bucket " << k;
  EXPECT_TRUE(Arena(*ov_) == arena) << "a failed step wrote weights";
  EXPECT_TRUE(State(ov_->id) == state) << "a failed step changed the state";
  // The retry: the doorbells still say 2, so the trainer writes every gradient before its Step.
  g = Grads(d, 2);
  for (size_t i = 0; i < g.size(); ++i) ov_->WriteGrad(i, g[i]);
  ASSERT_TRUE(StepBoth(2, g, &want, &got).ok());
  ExpectSameResult(got, want);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), 2) << "bucket " << k;
  ExpectSameSessions();
  CloseBoth();
}

// The trainer finds after two buckets that it cannot keep the overlapped step (its clipping
// rewrote gradients already rung): it rings -2 on a bucket already taken, and retries step 2
// synchronously with the clipped gradients. The session ends as one that only stepped
// synchronously, bit for bit, and overlaps again at step 3.
TEST_F(Overlap, AnAbandonedStepFailsAndASynchronousRetryApplies) {
  const SessionDesc d = Desc(AlgorithmKind::kDion, v1::NON_FINITE_POLICY_ERROR);
  NewPair(d);
  v1::StepResponse want, got;
  ASSERT_TRUE(StepBoth(1, Grads(d, 1), &want, &got).ok());
  const std::string arena = Arena(*ov_);
  const TensorMap state = State(ov_->id);
  const std::vector<std::vector<float>> g = Grads(d, 2);
  std::vector<std::vector<float>> clipped = g;
  for (auto& v : clipped) {
    for (float& x : v) x *= 0.25f;
  }
  for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, clipped[i]);
  ASSERT_TRUE(DoStep(stub(), sync_->id, 2, &want).ok());
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov_->id, 2, &queued).ok());
  Backward(2, g, {2, 0});
  bells_.RingGradients(0, -2);
  grpc::Status s = WaitStep(stub(), ov_->id, &got);
  EXPECT_EQ(s.error_code(), StatusCode::ABORTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(),
                                "the trainer abandoned step 2 (bucket 0's doorbell says -2)"))
      << s.error_message();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), -2) << "bucket " << k;
  EXPECT_TRUE(Arena(*ov_) == arena) << "an abandoned step wrote weights";
  EXPECT_TRUE(State(ov_->id) == state) << "an abandoned step changed the state";
  for (size_t i = 0; i < g.size(); ++i) ov_->WriteGrad(i, clipped[i]);
  s = DoStep(stub(), ov_->id, 2, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSameResult(got, want);
  ExpectSameSessions();
  ASSERT_TRUE(StepBoth(3, Grads(d, 3), &want, &got).ok());
  ExpectSameResult(got, want);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), 3) << "bucket " << k;
  ExpectSameSessions();
  CloseBoth();
}

TEST_F(Overlap, AClosedSessionCancelsTheWaitForABucketNeverRung) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  NewPair(d);
  const std::string arena = Arena(*ov_);
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov_->id, 1, &queued).ok());
  const std::vector<std::vector<float>> g = Grads(d, 1);
  Backward(1, g, {2, 0});  // bucket 1 never comes
  absl::SleepFor(absl::Milliseconds(200));
  // The waiting step holds no lock the daemon needs: it lists its sessions and steps others.
  EXPECT_GE(SessionCount(stub()), 2u);
  for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, g[i]);
  EXPECT_TRUE(DoStep(stub(), sync_->id, 1).ok());
  const absl::Time start = absl::Now();
  EXPECT_TRUE(CloseSession(stub(), ov_->id).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the close waited for the bucket";
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), -1) << "bucket " << k;
  EXPECT_TRUE(Arena(*ov_) == arena) << "a cancelled step wrote weights";
  EXPECT_TRUE(daemon_->Serving());
  EXPECT_TRUE(DoStep(stub(), sync_->id, 2).ok());
  EXPECT_TRUE(CloseSession(stub(), sync_->id).ok());
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "was cancelled")) << daemon_->Log();
}

TEST_F(Overlap, OverSealedMemfdRegionsStepsEqualSynchronousStepsBitForBit) {
  for (AlgorithmKind a : {AlgorithmKind::kMuon, AlgorithmKind::kAdamW}) {
    SCOPED_TRACE(optim::AlgorithmName(a));
    const SessionDesc d = Desc(a);
    NewPair(d);  // the synchronous shm session is the reference; ov_ goes unused
    v1::CreateSessionResponse layout;
    ASSERT_TRUE(stub().CreateSession(Ctx().get(), d.Request(), &layout).ok());
    const std::string id = layout.session_id(), path = layout.fd_channel_socket();
    const int64_t grad_base = (layout.param_arena_bytes() + 4095) / 4096 * 4096;
    auto arena = MakeSealedMemfd(grad_base + layout.grad_arena_bytes());
    auto page = MakeSealedMemfd(4096);
    WriteDoorbellHeader(page->base, 3);
    const Bells bells{page->base};
    for (size_t i = 0; i < d.params.size(); ++i) {
      const std::vector<float> w = SyntheticValues(1, 0, i, d.Numel(i));
      std::memcpy(arena->base + layout.layout(static_cast<int>(i)).param_offset_bytes(), w.data(),
                  w.size() * sizeof(float));
    }
    ASSERT_TRUE(RegisterMemfd(stub(), id, v1::REGION_ROLE_PARAMETERS, FdToken(path, arena->fd), 0,
                              layout.param_arena_bytes())
                    .ok());
    ASSERT_TRUE(RegisterMemfd(stub(), id, v1::REGION_ROLE_GRADIENTS, FdToken(path, arena->fd),
                              grad_base, layout.grad_arena_bytes())
                    .ok());
    grpc::Status st = RegisterMemfd(stub(), id, v1::REGION_ROLE_DOORBELLS, FdToken(path, page->fd),
                                    0, 4096, kBuckets);
    ASSERT_TRUE(st.ok()) << st.error_message();
    auto write = [&](size_t i, const std::vector<float>& v) {
      std::memcpy(arena->base + grad_base + layout.layout(static_cast<int>(i)).grad_offset_bytes(),
                  v.data(), v.size() * sizeof(float));
    };
    for (int64_t t = 1; t <= 3; ++t) {
      const std::vector<std::vector<float>> g = Grads(d, t);
      for (size_t i = 0; i < g.size(); ++i) sync_->WriteGrad(i, g[i]);
      v1::StepResponse want, queued, got;
      ASSERT_TRUE(DoStep(stub(), sync_->id, t, &want).ok());
      ASSERT_TRUE(OverlapStep(stub(), id, t, &queued).ok());
      Backward(t, g, RingOrder(t), nullptr, &bells, write);
      st = WaitStep(stub(), id, &got);
      ASSERT_TRUE(st.ok()) << st.error_message();
      ExpectSameResult(got, want);
      for (int k = 0; k < 3; ++k) EXPECT_EQ(bells.weights(k), t);
    }
    EXPECT_TRUE(Arena(*sync_) == std::string(reinterpret_cast<const char*>(arena->base),
                                             layout.param_arena_bytes()));
    EXPECT_TRUE(State(sync_->id) == State(id));
    EXPECT_TRUE(CloseSession(stub(), id).ok());
    CloseBoth();
  }
}

TEST_F(Overlap, BadPagesBucketsAndStepsAreRefused) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  auto s = CreateShmSession(stub(), d.Request());
  ASSERT_NE(s, nullptr);
  auto page = ShmSegment::Create(4096);
  ASSERT_NE(page, nullptr);
  WriteDoorbellHeader(page->data(), 3);
  auto refused = [&](const std::vector<std::vector<int32_t>>& buckets, StatusCode code,
                     const std::string& text) {
    grpc::Status st = RegisterShmDoorbells(stub(), s->id, page->name(), 0, 4096, buckets);
    EXPECT_EQ(st.error_code(), code) << text << ": " << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), text)) << st.error_message();
  };
  refused({{0, 5}, {1, 3, 2, 4}}, StatusCode::INVALID_ARGUMENT, "the page's header 3");
  refused({{0, 5}, {1, 3}, {4, 2, 0}}, StatusCode::INVALID_ARGUMENT,
          "is in buckets[0] and buckets[2]");
  refused({{0, 5}, {1, 3}, {4}}, StatusCode::INVALID_ARGUMENT,
          "parameter 2 ('b1') is in no bucket");
  refused({{0, 5}, {1, 3}, {4, 2, 6}}, StatusCode::INVALID_ARGUMENT, "names index 6");
  refused({{0, 5}, {-1}, {4, 2, 1, 3}}, StatusCode::INVALID_ARGUMENT, "names index -1");
  refused({{0, 5, 1, 3, 4, 2}, {}, {}}, StatusCode::INVALID_ARGUMENT, "buckets[1] is empty");
  refused({}, StatusCode::INVALID_ARGUMENT, "declares 0 buckets");
  refused(std::vector<std::vector<int32_t>>(65537, std::vector<int32_t>{}),
          StatusCode::INVALID_ARGUMENT, "declares 65537 buckets; 1 to 65536");
  // Buckets with another role; a doorbell page of a CUDA kind; a page without its header.
  {
    v1::RegisterRegionRequest req;
    req.set_session_id(s->id);
    req.set_role(v1::REGION_ROLE_GRADIENTS);
    req.set_kind(v1::REGION_KIND_SYSTEM_SHM);
    req.mutable_system_shm()->set_name(page->name());
    req.mutable_system_shm()->set_size_bytes(4096);
    req.add_buckets()->add_params(0);
    v1::RegisterRegionResponse resp;
    grpc::Status st = stub().RegisterRegion(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "for REGION_ROLE_DOORBELLS only"));
    req.set_role(v1::REGION_ROLE_DOORBELLS);
    req.set_kind(v1::REGION_KIND_CUDA_IPC);
    st = stub().RegisterRegion(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "REGION_KIND_CUDA_IPC"))
        << st.error_message();
  }
  std::memcpy(page->data(), "NOTABELL", 8);
  refused(kBuckets, StatusCode::INVALID_ARGUMENT, "does not start with \"DIONDDB1\"");
  WriteDoorbellHeader(page->data(), 3);
  // Overlapped Steps: not asynchronous; no page. Nothing is queued: step 1 still runs.
  v1::StepResponse resp;
  grpc::Status st = OverlapStep(stub(), s->id, 1, &resp, /*asynchronous=*/false);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "needs asynchronous = true"));
  st = OverlapStep(stub(), s->id, 1, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "needs a doorbell page")) << st.error_message();
  // A page over the GRADIENTS arena; then a good page, a second one, and the page unregistered.
  st = RegisterShmDoorbells(stub(), s->id, s->params_seg->name(), s->grad_base, 4096, kBuckets);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "overlaps the GRADIENTS"))
      << st.error_message();
  std::string id;
  ASSERT_TRUE(RegisterShmDoorbells(stub(), s->id, page->name(), 0, 4096, kBuckets, &id).ok());
  st = RegisterShmDoorbells(stub(), s->id, page->name(), 0, 4096, kBuckets);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "DOORBELLS already has region"))
      << st.error_message();
  v1::UnregisterRegionRequest un;
  un.set_session_id(s->id);
  un.set_region_id(id);
  v1::UnregisterRegionResponse unresp;
  ASSERT_TRUE(stub().UnregisterRegion(Ctx().get(), un, &unresp).ok());
  st = OverlapStep(stub(), s->id, 1, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(DoStep(stub(), s->id, 1).ok());
  EXPECT_TRUE(CloseSession(stub(), s->id).ok());
}

}  // namespace
}  // namespace diond::service_testing
