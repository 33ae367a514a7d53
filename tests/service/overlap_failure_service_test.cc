// The overlapped step's failures against the real daemon (docs/DATA_PLANE.md "Overlapped step"):
// every way the wait for a bucket ends without the trainer ringing it, each with nothing
// committed and every weights doorbell at -N:
//  - --overlap_bucket_timeout: a stalled trainer meets it (DEADLINE_EXCEEDED), the daemon keeps
//    serving and a retry of the step applies; a value <= 0 refuses to start the daemon.
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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
    testing::Subprocess p({DIOND_BINARY, "--listen=unix:" + dir + "/d.sock", "--metrics_address=",
                           absl::StrCat("--overlap_bucket_timeout=", value)},
                          dir + "/log.txt");
    std::optional<int> code = p.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << value;
    EXPECT_EQ(*code, 2) << value << ": " << p.Log();
    EXPECT_TRUE(absl::StrContains(p.Log(), "diond: --overlap_bucket_timeout must be > 0, got "))
        << p.Log();
  }
}

}  // namespace
}  // namespace diond::service_testing
