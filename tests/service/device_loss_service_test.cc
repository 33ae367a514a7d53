// A lost device context (a sticky CUDA error: an illegal address in a kernel; docs/GPU.md
// "Errors") on the test-only diond_testdevice daemon, whose TEST backend loses its context at
// the next op entry once DIOND_TEST_DEVICE_LOSE_CONTEXT_FILE exists. Before the loss the daemon
// is healthy and steps; the step that runs into the loss fails naming it; from then on gRPC
// health answers NOT_SERVING (the server and diond.v1.Optimizer), diond_device_lost is 1, the
// log says why once, and every later device step is refused up front, naming the loss, without
// reaching the device. The daemon keeps answering the other RPCs.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/subprocess.h"
#include "tests/service/service_harness.h"

namespace diond::service_testing {
namespace {

using optim::AlgorithmKind;

// The ready file's "metrics_port".
int MetricsPort(const Daemon& d) {
  std::ifstream in(d.dir() + "/ready.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::string j = text.str();
  const std::string key = "\"metrics_port\":";
  const size_t at = j.find(key);
  if (at == std::string::npos) return 0;
  int port = 0;
  const size_t end = j.find_first_of(",}", at);
  return absl::SimpleAtoi(j.substr(at + key.size(), end - at - key.size()), &port) ? port : 0;
}

// The value of an unlabelled sample `name` in the /metrics text; -1 if absent.
double Sample(const std::string& metrics, const std::string& name) {
  std::istringstream lines(metrics);
  for (std::string line; std::getline(lines, line);) {
    if (absl::StartsWith(line, name + " ")) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(name.size() + 1), &v)) return v;
    }
  }
  return -1;
}

// grpc.health.v1 Check of `service` on the daemon's Unix socket.
grpc::health::v1::HealthCheckResponse::ServingStatus Health(const Daemon& d,
                                                            const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel("unix:" + d.dir() + "/d.sock", grpc::InsecureChannelCredentials()));
  auto ctx = Ctx();
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status s = stub->Check(ctx.get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.status();
}

TEST(DeviceLoss, ALostContextIsNoticedReportedAndRefusesDeviceSteps) {
  const std::string trigger = absl::StrCat(::testing::TempDir(), "/diond-lose-context-", getpid());
  std::remove(trigger.c_str());
  auto d = Daemon::StartBinary(DIOND_TESTDEVICE_BINARY, {"--metrics_address=127.0.0.1:0"},
                               {"DIOND_TEST_DEVICE_LOSE_CONTEXT_FILE=" + trigger});
  ASSERT_NE(d, nullptr);
  const int metrics_port = MetricsPort(*d);
  ASSERT_GT(metrics_port, 0);
  const SessionDesc desc = TwoMatricesAndABias(AlgorithmKind::kMuon);
  auto s = CreateShmSession(d->stub(), desc.Request());
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(SetState(d->stub(), s->id, SyntheticWeights(desc, 1)).ok());

  // Healthy: a step runs, health is SERVING, the gauge is 0.
  WriteSyntheticGrads(s.get(), desc, 7, 1);
  grpc::Status st = DoStep(d->stub(), s->id, 1);
  ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << d->Log();
  EXPECT_TRUE(d->Serving());
  EXPECT_EQ(Sample(testing::HttpGet(metrics_port, "/metrics"), "diond_device_lost"), 0.0);
  const std::string weights = s->ParamBytes(0);

  // The context is lost at the next op entry: in the middle of step 2.
  { std::ofstream(trigger) << "lose"; }
  WriteSyntheticGrads(s.get(), desc, 7, 2);
  st = DoStep(d->stub(), s->id, 2);
  std::remove(trigger.c_str());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "the device context is lost"))
      << st.error_message();
  EXPECT_EQ(s->ParamBytes(0), weights) << "a failed step changed the trainer's weights";

  // Noticed by that step: health, metrics, one log line.
  EXPECT_FALSE(d->Serving());
  EXPECT_EQ(Health(*d, ""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(*d, "diond.v1.Optimizer"), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Sample(testing::HttpGet(metrics_port, "/metrics"), "diond_device_lost"), 1.0);
  const std::string log = d->Log();
  const std::string line = "the compute device test-device:0 is lost: ";
  EXPECT_TRUE(absl::StrContains(log, line)) << log;
  EXPECT_TRUE(absl::StrContains(log, "host-test device 0: the device context is lost")) << log;

  // Every later step is refused before it reaches the device, with the reason.
  const std::map<std::string, int64_t> before = LastCounters(*d);
  st = DoStep(d->stub(), s->id, 2);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "step refused: ")) << st.error_message();
  EXPECT_TRUE(
      absl::StrContains(st.error_message(), "host-test device 0: the device context is lost"))
      << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "NOT_SERVING")) << st.error_message();
  const std::map<std::string, int64_t> after = LastCounters(*d);
  ASSERT_TRUE(before.count("ops") && after.count("ops"));
  EXPECT_EQ(after.at("ops"), before.at("ops")) << "a refused step reached the device";
  // Said once, however many steps are refused.
  const std::string later = d->Log();
  size_t n = 0;
  for (size_t at = later.find(line); at != std::string::npos; at = later.find(line, at + 1)) ++n;
  EXPECT_EQ(n, 1u) << later;
  // The daemon still answers what needs no device.
  EXPECT_EQ(SessionCount(d->stub()), 1u);
}

}  // namespace
}  // namespace diond::service_testing
