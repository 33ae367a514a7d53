// The overlapped step's failures against the real daemon (docs/DATA_PLANE.md "Overlapped step"):
// every way the wait for a bucket ends without the trainer ringing it, each with nothing
// committed and every weights doorbell at -N:
//  - --overlap_bucket_timeout: a stalled trainer meets it (DEADLINE_EXCEEDED), the daemon keeps
//    serving and a retry of the step applies; a value <= 0 refuses to start the daemon;
//  - a new trainer's AttachSession cancels the wait;
//  - SIGTERM while a step waits: the daemon exits at once, no checkpoint of that step;
//  - a trainer killed mid-step (a real child process): the orphan reaper checkpoints and
//    closes its session without waiting for the bucket.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/overlap_harness.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using grpc::StatusCode;
using optim::AlgorithmKind;

// Its own daemon, whose wait for a bucket gives up after 500 ms.
class OverlapShortWait : public Overlap {
 protected:
  static void SetUpTestSuite() {
    daemon_ = Daemon::Start({"--overlap_bucket_timeout=500ms"}).release();
  }
};

TEST_F(OverlapShortWait, AStalledTrainerMeetsTheDeadlineAndARetryApplies) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  NewPair(d);
  v1::StepResponse want, got;
  ASSERT_TRUE(StepBoth(1, Grads(d, 1), &want, &got).ok());
  const std::string arena = Arena(*ov_);
  const TensorMap state = State(ov_->id);
  const std::vector<std::vector<float>> g = Grads(d, 2);
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov_->id, 2, &queued).ok());
  Backward(2, g, {2, 0});  // bucket 1 never comes
  grpc::Status s = WaitStep(stub(), ov_->id, &got);
  EXPECT_EQ(s.error_code(), StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "no gradients rung for bucket(s) 1 in time"))
      << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "nothing was committed")) << s.error_message();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), -2) << "bucket " << k;
  EXPECT_TRUE(Arena(*ov_) == arena) << "a step past its deadline wrote weights";
  EXPECT_TRUE(State(ov_->id) == state) << "a step past its deadline changed the state";
  EXPECT_TRUE(daemon_->Serving());
  for (size_t i = 0; i < g.size(); ++i) ov_->WriteGrad(i, g[i]);
  s = StepBoth(2, g, &want, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSameResult(got, want);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), 2) << "bucket " << k;
  ExpectSameSessions();
  CloseBoth();
}

TEST(OverlapFlags, ABucketTimeoutOfZeroOrLessRefusesToStart) {
  const std::string dir = testing::MakeTempDir("diond_overlap_flag");
  for (const char* value : {"0", "-1s"}) {
    testing::Subprocess p({DIOND_BINARY, "--listen=unix:" + dir + "/d.sock",
                           "--metrics_address=", absl::StrCat("--overlap_bucket_timeout=", value)},
                          dir + "/log.txt");
    std::optional<int> code = p.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << value;
    EXPECT_EQ(*code, 2) << value << ": " << p.Log();
    EXPECT_TRUE(absl::StrContains(p.Log(), "diond: --overlap_bucket_timeout must be > 0, got "))
        << p.Log();
  }
}

// A new trainer attaches to the session by its name while step 1 waits for bucket 1: the wait
// is cancelled, nothing is committed, and the new trainer steps 1 again.
TEST_F(Overlap, ANewTrainerCancelsTheWaitForABucket) {
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  v1::CreateSessionRequest req = d.Request();
  req.set_session_name(absl::StrCat("overlap-attach-", getpid()));
  ov_ = CreateShmSession(stub(), req);
  ASSERT_NE(ov_, nullptr);
  for (size_t i = 0; i < d.params.size(); ++i) {
    ov_->params_seg->Write(ov_->tensor(i).param_offset_bytes(),
                           FloatBytes(SyntheticValues(1, 0, i, d.Numel(i))));
  }
  page_ = ShmSegment::Create(4096);
  ASSERT_NE(page_, nullptr);
  WriteDoorbellHeader(page_->data(), 3);
  bells_.base = page_->data();
  ASSERT_TRUE(RegisterShmDoorbells(stub(), ov_->id, page_->name(), 0, 4096, kBuckets).ok());
  const std::string arena = Arena(*ov_);
  v1::StepResponse queued;
  ASSERT_TRUE(OverlapStep(stub(), ov_->id, 1, &queued).ok());
  Backward(1, Grads(d, 1), {2, 0});
  v1::AttachSessionRequest attach;
  attach.set_session_name(req.session_name());
  v1::AttachSessionResponse attached;
  grpc::Status s = stub().AttachSession(Ctx().get(), attach, &attached);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(attached.step_index(), 0) << "the cancelled step was committed";
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells_.weights(k), -1) << "bucket " << k;
  EXPECT_TRUE(Arena(*ov_) == arena) << "a cancelled step wrote weights";
  // The new trainer binds its regions (a doorbell page no more) and steps 1.
  auto again = BindShmSession(stub(), attached.session());
  ASSERT_NE(again, nullptr);
  ASSERT_TRUE(SetState(stub(), again->id, SyntheticWeights(d, 1)).ok());
  WriteSyntheticGrads(again.get(), d, 7, 1);
  s = DoStep(stub(), again->id, 1);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "was cancelled")) << daemon_->Log();
  EXPECT_TRUE(CloseSession(stub(), again->id).ok());
}

// A page, its registration and an overlapped Step(1) waiting for bucket 1 (2 and 0 rung), on a
// session of `daemon` (weights of seed 1, gradients of step 1).
struct Waiting {
  std::unique_ptr<ShmSession> s;
  std::unique_ptr<ShmSegment> page;
  std::string arena;
};
std::unique_ptr<Waiting> StartWaitingStep(v1::Optimizer::Stub& stub, const SessionDesc& d) {
  auto w = std::make_unique<Waiting>();
  w->s = CreateShmSession(stub, d.Request());
  w->page = ShmSegment::Create(4096);
  if (w->s == nullptr || w->page == nullptr) return nullptr;
  for (size_t i = 0; i < d.params.size(); ++i) {
    w->s->params_seg->Write(w->s->tensor(i).param_offset_bytes(),
                            FloatBytes(SyntheticValues(1, 0, i, d.Numel(i))));
    w->s->WriteGrad(i, Grads(d, 1)[i]);
  }
  w->arena = w->s->params_seg->Bytes(0, w->s->layout.param_arena_bytes());
  WriteDoorbellHeader(w->page->data(), 3);
  grpc::Status st = RegisterShmDoorbells(stub, w->s->id, w->page->name(), 0, 4096, kBuckets);
  v1::StepResponse queued;
  if (!st.ok() || !OverlapStep(stub, w->s->id, 1, &queued).ok()) return nullptr;
  const Bells bells{w->page->data()};
  bells.RingGradients(2, 1);
  bells.RingGradients(0, 1);
  return w;
}

// SIGTERM while step 1 waits for bucket 1: the daemon cancels the wait and exits 0 at once (not
// after the bucket's 10 minutes); no checkpoint of step 1 is taken.
TEST(OverlapShutdown, SigtermCancelsAWaitingStep) {
  const std::string state_dir = testing::MakeTempDir("diond_overlap_stop");
  auto daemon = Daemon::Start({"--state_dir=" + state_dir, "--checkpoint_every=1"});
  ASSERT_NE(daemon, nullptr);
  const SessionDesc d = Desc(AlgorithmKind::kMuon);
  std::unique_ptr<Waiting> w = StartWaitingStep(daemon->stub(), d);
  ASSERT_NE(w, nullptr);
  absl::SleepFor(absl::Milliseconds(100));  // (the daemon stages the rung buckets meanwhile)
  std::optional<int> code = daemon->Terminate(absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << "the daemon waited for the bucket: " << daemon->Log();
  EXPECT_EQ(*code, 0) << daemon->Log();
  const Bells bells{w->page->data()};
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells.weights(k), -1) << "bucket " << k;
  EXPECT_TRUE(w->s->params_seg->Bytes(0, w->s->layout.param_arena_bytes()) == w->arena)
      << "a cancelled step wrote weights";
  struct stat st;
  EXPECT_NE(stat(absl::StrCat(state_dir, "/", w->s->id, "/step-1").c_str(), &st), 0)
      << daemon->Log();
  EXPECT_TRUE(absl::StrContains(daemon->Log(), "the asynchronous step 1 failed")) << daemon->Log();
  EXPECT_TRUE(absl::StrContains(daemon->Log(), "was cancelled")) << daemon->Log();
}

// ---- a trainer killed mid-step -----------------------------------------------------------------
// The trainer is this test binary run again as a child process (kChildEnv names the daemon's
// directory and where to write what it made), so that the daemon's orphan reaper watches a
// process that really dies. The parent never calls on the session: it would become one of the
// session's processes.
constexpr char kChildEnv[] = "DIOND_OVERLAP_TRAINER_CHILD";

// The child: a session with a doorbell page, an overlapped Step(1) with buckets 2 and 0 rung,
// then "<session> <params segment> <arena bytes> <page segment>" written to <out>/made, and a
// wait to be killed.
void RunTrainerChild() {
  const std::vector<std::string> dirs = absl::StrSplit(getenv(kChildEnv), '|');
  ASSERT_EQ(dirs.size(), 2u);
  auto channel =
      grpc::CreateChannel("unix:" + dirs[0] + "/d.sock", grpc::InsecureChannelCredentials());
  auto stub = v1::Optimizer::NewStub(channel);
  std::unique_ptr<Waiting> w = StartWaitingStep(*stub, Desc(AlgorithmKind::kMuon));
  ASSERT_NE(w, nullptr);
  {
    std::ofstream out(dirs[1] + "/made.tmp");
    out << w->s->id << " " << w->s->params_seg->name() << " " << w->s->layout.param_arena_bytes()
        << " " << w->page->name() << "\n";
  }
  ASSERT_EQ(rename((dirs[1] + "/made.tmp").c_str(), (dirs[1] + "/made").c_str()), 0);
  absl::SleepFor(absl::Seconds(120));
}

class TrainerChild : public ::testing::Test {
  void TestBody() override { RunTrainerChild(); }
};

// Registered only in the child (kChildEnv set), so that no test run lists it.
const bool kChildRegistered = [] {
  if (getenv(kChildEnv) == nullptr) return false;
  ::testing::RegisterTest("OverlapTrainerChild", "StartsAStepAndWaitsToBeKilled", nullptr, nullptr,
                          __FILE__, __LINE__,
                          []() -> ::testing::Test* { return new TrainerChild; });
  return true;
}();

// A segment of another process's, mapped read-only; unlinked when done.
struct Mapped {
  std::string name;
  uint8_t* data = nullptr;
  size_t size = 0;
  Mapped(const std::string& n, size_t bytes) : name(n), size(bytes) {
    const int fd = shm_open(("/" + n).c_str(), O_RDONLY, 0);
    EXPECT_GE(fd, 0) << n;
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    EXPECT_NE(p, MAP_FAILED) << n;
    data = static_cast<uint8_t*>(p);
  }
  ~Mapped() {
    munmap(data, size);
    shm_unlink(("/" + name).c_str());
  }
  std::string Bytes() const { return std::string(reinterpret_cast<const char*>(data), size); }
};

// The trainer dies (SIGKILL) while step 1 waits for its bucket 1: the orphan reaper checkpoints
// and closes the session at once (it cancels the wait first rather than wait for the bucket's
// 10 minutes), with nothing committed: the checkpoint is of step 0, the weights are as they were
// and every weights doorbell says -1.
TEST(OverlapOrphan, ATrainerThatDiesMidStepLeavesNothingCommitted) {
  const std::string state_dir = testing::MakeTempDir("diond_overlap_orphan");
  auto daemon = Daemon::Start({"--orphan_grace=1s", "--state_dir=" + state_dir});
  ASSERT_NE(daemon, nullptr);
  const std::string out = testing::MakeTempDir("diond_overlap_child");
  ASSERT_EQ(setenv(kChildEnv, (daemon->dir() + "|" + out).c_str(), 1), 0);
  testing::Subprocess child({"/proc/self/exe", "--gtest_filter=OverlapTrainerChild.*"},
                            out + "/child.log");
  unsetenv(kChildEnv);
  std::string made;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
       made.empty() && absl::Now() < deadline; absl::SleepFor(absl::Milliseconds(20))) {
    std::ifstream in(out + "/made");
    std::getline(in, made);
  }
  ASSERT_FALSE(made.empty()) << child.Log();
  std::istringstream fields(made);
  std::string id, params_name, page_name;
  size_t arena_bytes = 0;
  fields >> id >> params_name >> arena_bytes >> page_name;
  const Mapped params(params_name, arena_bytes), page(page_name, 4096);
  const std::string arena = params.Bytes();
  const Bells bells{page.data};
  for (int k = 0; k < 3; ++k) EXPECT_EQ(bells.weights(k), 0) << "bucket " << k;
  child.Signal(SIGKILL);
  ASSERT_TRUE(child.Wait(absl::Seconds(30)).has_value());
  EXPECT_TRUE(bells.AwaitWeights(3, -1)) << daemon->Log();
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60);
       SessionCount(daemon->stub()) != 0 && absl::Now() < deadline;
       absl::SleepFor(absl::Milliseconds(50))) {
  }
  EXPECT_EQ(SessionCount(daemon->stub()), 0u) << daemon->Log();
  EXPECT_TRUE(params.Bytes() == arena) << "a dead trainer's step wrote weights";
  struct stat st;
  EXPECT_EQ(stat(absl::StrCat(state_dir, "/", id, "/step-0").c_str(), &st), 0) << daemon->Log();
  EXPECT_NE(stat(absl::StrCat(state_dir, "/", id, "/step-1").c_str(), &st), 0) << daemon->Log();
  EXPECT_TRUE(absl::StrContains(daemon->Log(), "was cancelled")) << daemon->Log();
  EXPECT_TRUE(daemon->Serving());
}

}  // namespace
}  // namespace diond::service_testing
