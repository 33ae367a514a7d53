// Runs examples/cpp/mlp_shm.cc against a real daemon (Muon + AdamW over shm) and checks that the
// training loss fell to under half its initial value.
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "client/cpp/tests/test_daemon.h"
#include "gtest/gtest.h"

namespace {

using ::diond::client::testing::StartTestDaemon;
using ::diond::testing::RunCommand;

void TrainAndCheck(const std::string& extra_flags) {
  auto d = StartTestDaemon(DIOND_BINARY);
  ASSERT_TRUE(d.ok()) << d.status();
  auto [rc, out] = RunCommand(std::string(EXAMPLE_BINARY) + " --target=" + (*d)->target +
                              " --steps=200 --print_every=20 " + extra_flags + " 2>&1");
  ASSERT_EQ(rc, 0) << out << "\ndaemon log:\n" << (*d)->proc->Log();
  size_t pos = out.rfind("initial_loss ");
  ASSERT_NE(pos, std::string::npos) << out;
  float initial = 0, final_loss = 0;
  ASSERT_EQ(std::sscanf(out.c_str() + pos, "initial_loss %f final_loss %f", &initial, &final_loss),
            2)
      << out;
  // The margin: a working optimizer takes this teacher-student regression far below half its
  // start in 200 full-batch steps; a daemon that never updated the shm weights stays at 1.0x.
  EXPECT_LT(final_loss, 0.5f * initial) << out;
  EXPECT_TRUE(absl::StrContains(out, "step 200 loss")) << out;
  EXPECT_EQ((*d)->Stop(), std::optional<int>(0)) << (*d)->proc->Log();
}

TEST(ExampleMlp, LossFallsByHalfTrainingThroughTheDaemonOverShm) { TrainAndCheck(""); }

TEST(ExampleMlp, TwoSegmentsTrainTheSame) { TrainAndCheck("--two_segments"); }

}  // namespace
