// Integration tests of the real `diond` binary: started as a subprocess on a free TCP port and a
// temporary Unix socket, checked with a real gRPC client, a real HTTP scrape validated by
// promtool, and real signals.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/subprocess.h"

namespace diond {
namespace {

using ::diond::testing::HttpGet;
using ::diond::testing::MakeTempDir;
using ::diond::testing::ReadFile;
using ::diond::testing::RunCommand;
using ::diond::testing::Subprocess;

// A running daemon with its ready file parsed.
struct RunningDaemon {
  std::unique_ptr<Subprocess> proc;
  std::string dir, socket_path;
  int tcp_port = 0, metrics_port = 0;
  nlohmann::json ready;
};

std::unique_ptr<RunningDaemon> StartDaemon(std::vector<std::string> extra = {}) {
  auto d = std::make_unique<RunningDaemon>();
  d->dir = MakeTempDir("diond_it");
  d->socket_path = d->dir + "/diond.sock";
  std::string ready = d->dir + "/ready.json";
  std::vector<std::string> argv = {DIOND_BINARY, "--listen=unix:" + d->socket_path + ",127.0.0.1:0",
                                   "--metrics_address=127.0.0.1:0", "--ready_file=" + ready};
  argv.insert(argv.end(), extra.begin(), extra.end());
  d->proc = std::make_unique<Subprocess>(argv, d->dir + "/log.txt");
  // The daemon writes the ready file atomically once it serves. The first start may map the
  // CUDA plugin's ~1 GB of libraries from a cold page cache (TOOLCHAIN.md P6), hence 60 s.
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::string text = ReadFile(ready);
    if (!text.empty()) {
      d->ready = nlohmann::json::parse(text);
      for (const auto& e : d->ready["listen"]) {
        if (e.contains("port")) d->tcp_port = e["port"].get<int>();
      }
      d->metrics_port = d->ready["metrics_port"].get<int>();
      return d;
    }
    if (d->proc->Wait(absl::ZeroDuration()).has_value()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << "daemon did not become ready; log:\n" << d->proc->Log();
  return nullptr;
}

grpc::health::v1::HealthCheckResponse::ServingStatus CheckHealth(const std::string& target,
                                                                 const std::string& service) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << target << ": " << s.error_message();
  return resp.status();
}

TEST(DaemonProcess, HealthyOverUnixAndTcpServesValidMetricsAndStopsCleanlyOnSigterm) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  ASSERT_GT(d->tcp_port, 0);
  ASSERT_GT(d->metrics_port, 0);

  // The Unix socket is owner-only.
  struct stat st;
  ASSERT_EQ(stat(d->socket_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  using Status = grpc::health::v1::HealthCheckResponse;
  EXPECT_EQ(CheckHealth("unix:" + d->socket_path, ""), Status::SERVING);
  EXPECT_EQ(CheckHealth(absl::StrCat("127.0.0.1:", d->tcp_port), ""), Status::SERVING);
  EXPECT_EQ(CheckHealth("unix:" + d->socket_path, "diond.v1.Optimizer"), Status::SERVING);

  // diondctl (the Docker HEALTHCHECK) agrees, and fails on a dead address.
  {
    auto [rc, out] = RunCommand(std::string(DIONDCTL_BINARY) + " --target=unix:" + d->socket_path +
                                " health 2>&1");
    EXPECT_EQ(rc, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "SERVING")) << out;
    auto [rc2, out2] =
        RunCommand(std::string(DIONDCTL_BINARY) + " --timeout=1s --target=unix:" + d->dir +
                   "/nobody.sock health 2>&1");
    EXPECT_EQ(rc2, 1) << out2;
    EXPECT_TRUE(absl::StrContains(out2, "health check failed")) << out2;
  }

  // Four health checks so far: three above and diondctl's. An Optimizer RPC goes through the
  // interceptor, so it must appear in the metrics.
  {
    auto channel =
        grpc::CreateChannel("unix:" + d->socket_path, grpc::InsecureChannelCredentials());
    auto stub = diond::v1::Optimizer::NewStub(channel);
    grpc::ClientContext ctx;
    diond::v1::ListSessionsRequest req;
    diond::v1::ListSessionsResponse resp;
    EXPECT_TRUE(stub->ListSessions(&ctx, req, &resp).ok());
  }

  std::string metrics = HttpGet(d->metrics_port, "/metrics");
  ASSERT_FALSE(metrics.empty());
  EXPECT_TRUE(absl::StrContains(metrics, "diond_build_info{")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, R"(compute_device="cpu")")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "process_resident_memory_bytes"));
  EXPECT_TRUE(absl::StrContains(
      metrics, R"(diond_rpcs_total{code="OK",method="/grpc.health.v1.Health/Check"} 4)"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics, R"(diond_rpcs_total{code="OK",method="/diond.v1.Optimizer/ListSessions"} 1)"));
  EXPECT_TRUE(absl::StrContains(metrics, "diond_rpc_duration_seconds_bucket{"));
  std::string file = d->dir + "/metrics.txt";
  std::ofstream(file) << metrics;
  auto [rc, out] = RunCommand("promtool check metrics < " + file + " 2>&1");
  EXPECT_EQ(rc, 0) << "promtool: " << out;

#ifdef DIOND_CUDA_PLUGIN_BUILT
  // In auto mode the daemon dlopen()s the CUDA plugin (cuBLAS, cuSOLVER, NCCL) even without a
  // GPU; metrics must still serve afterwards (TOOLCHAIN.md P1).
  EXPECT_TRUE(absl::StrContains(metrics, R"(cuda_plugin="true")")) << metrics;
#endif

  d->proc->Signal(SIGTERM);
  auto code = d->proc->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << "daemon did not stop after SIGTERM";
  EXPECT_EQ(*code, 0) << d->proc->Log();
  EXPECT_NE(stat(d->socket_path.c_str(), &st), 0) << "socket file left behind";
  std::string log = d->proc->Log();
  EXPECT_TRUE(absl::StrContains(log, "serving on unix:" + d->socket_path)) << log;
  EXPECT_TRUE(absl::StrContains(log, "stopped cleanly")) << log;
}

TEST(DaemonProcess, StartupLineSaysWhenNoGpuIsUsed) {
  auto d = StartDaemon({"--device=auto"});
  ASSERT_NE(d, nullptr);
  auto [rc, out] = RunCommand("nvidia-smi -L 2>/dev/null | grep -c GPU");
  bool have_gpu = rc == 0 && out != "0\n";
  std::string log = d->proc->Log();
  if (!have_gpu) {
    EXPECT_TRUE(absl::StrContains(log, "device cpu")) << log;
    EXPECT_TRUE(absl::StrContains(log, "no GPU in use")) << log;
  }
  d->proc->Signal(SIGINT);
  EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// The start-up line names the threads the steps use (--compute_threads), not the cores.
TEST(DaemonProcess, StartupLineNamesTheComputeThreadsInEffect) {
  for (int threads : {1, 3}) {
    auto d = StartDaemon({"--device=cpu", absl::StrCat("--compute_threads=", threads)});
    ASSERT_NE(d, nullptr);
    const std::string want = threads == 1 ? "cpu (1 thread)" : "cpu (3 threads)";
    std::string log = d->proc->Log();
    EXPECT_TRUE(absl::StrContains(log, "; device " + want + ";")) << log;
    EXPECT_EQ(d->ready["device"].get<std::string>(), want);
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
}

// The daemon's environment as the kernel holds it (the block execve was given).
std::vector<std::string> ProcessEnvironment(pid_t pid) {
  std::string raw = ReadFile(absl::StrCat("/proc/", pid, "/environ"));
  std::vector<std::string> vars;
  size_t start = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\0') {
      vars.push_back(raw.substr(start, i - start));
      start = i + 1;
    }
  }
  return vars;
}

bool HasVar(const std::vector<std::string>& env, const std::string& var) {
  return std::find(env.begin(), env.end(), var) != env.end();
}

// libgomp and OpenBLAS read their wait settings before main(); the daemon re-executes itself
// (same pid) with GOMP_SPINCOUNT=10000 when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set,
// and with OPENBLAS_THREAD_TIMEOUT=18 when neither it nor GOTO_THREAD_TIMEOUT is set
// (TOOLCHAIN.md P20, P21), and keeps any value the operator set. (That idle threads then use no CPU
// is checked after real training in examples/cpp/mlp_shm_test.cc.)
TEST(DaemonProcess, IdleOpenMpThreadsSleepUnlessTheOperatorSaysOtherwise) {
  const char* saved = std::getenv("OMP_WAIT_POLICY");
  const std::string saved_value = saved != nullptr ? saved : "";
  const char* saved_spin = std::getenv("GOMP_SPINCOUNT");
  const std::string saved_spin_value = saved_spin != nullptr ? saved_spin : "";
  const char* saved_blas = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  const std::string saved_blas_value = saved_blas != nullptr ? saved_blas : "";
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("GOMP_SPINCOUNT");
  unsetenv("OPENBLAS_THREAD_TIMEOUT");
  unsetenv("GOTO_THREAD_TIMEOUT");
  {
    auto d = StartDaemon({"--device=cpu"});
    ASSERT_NE(d, nullptr);
    std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_TRUE(HasVar(env, "GOMP_SPINCOUNT=10000")) << d->proc->Log();
    EXPECT_FALSE(std::any_of(env.begin(), env.end(), [](const std::string& v) {
      return absl::StartsWith(v, "OMP_WAIT_POLICY=");
    }));
    EXPECT_TRUE(HasVar(env, "OPENBLAS_THREAD_TIMEOUT=18")) << d->proc->Log();
    EXPECT_TRUE(absl::StrContains(d->proc->Log(),
                                  "GOMP_SPINCOUNT=10000 OPENBLAS_THREAD_TIMEOUT=18 "
                                  "GOTO_THREAD_TIMEOUT=(unset) (set by diond: GOMP_SPINCOUNT "
                                  "OPENBLAS_THREAD_TIMEOUT;"))
        << d->proc->Log();
    // The re-executed daemon keeps its name (ps, top, pgrep), not "exe" of /proc/self/exe.
    std::ifstream comm("/proc/" + std::to_string(d->proc->pid()) + "/comm");
    std::string name;
    std::getline(comm, name);
    EXPECT_EQ(name, "diond");
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  setenv("GOMP_SPINCOUNT", "500", 1);
  setenv("GOTO_THREAD_TIMEOUT", "12", 1);
  {
    auto d = StartDaemon({"--device=cpu"});
    ASSERT_NE(d, nullptr);
    std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_TRUE(HasVar(env, "GOMP_SPINCOUNT=500")) << d->proc->Log();
    EXPECT_FALSE(std::any_of(env.begin(), env.end(), [](const std::string& v) {
      return absl::StartsWith(v, "OPENBLAS_THREAD_TIMEOUT=");
    }));
    EXPECT_FALSE(absl::StrContains(d->proc->Log(), "set by diond")) << d->proc->Log();
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  unsetenv("GOMP_SPINCOUNT");
  unsetenv("GOTO_THREAD_TIMEOUT");
  setenv("OMP_WAIT_POLICY", "active", 1);
  setenv("OPENBLAS_THREAD_TIMEOUT", "20", 1);
  {
    auto d = StartDaemon({"--device=cpu"});
    ASSERT_NE(d, nullptr);
    std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_TRUE(HasVar(env, "OMP_WAIT_POLICY=active")) << d->proc->Log();
    EXPECT_FALSE(HasVar(env, "GOMP_SPINCOUNT=10000"));
    EXPECT_TRUE(HasVar(env, "OPENBLAS_THREAD_TIMEOUT=20")) << d->proc->Log();
    EXPECT_TRUE(absl::StrContains(d->proc->Log(), "OMP_WAIT_POLICY=active")) << d->proc->Log();
    EXPECT_FALSE(absl::StrContains(d->proc->Log(), "set by diond")) << d->proc->Log();
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  if (saved != nullptr) {
    setenv("OMP_WAIT_POLICY", saved_value.c_str(), 1);
  } else {
    unsetenv("OMP_WAIT_POLICY");
  }
  if (saved_spin != nullptr) {
    setenv("GOMP_SPINCOUNT", saved_spin_value.c_str(), 1);
  } else {
    unsetenv("GOMP_SPINCOUNT");
  }
  if (saved_blas != nullptr) {
    setenv("OPENBLAS_THREAD_TIMEOUT", saved_blas_value.c_str(), 1);
  } else {
    unsetenv("OPENBLAS_THREAD_TIMEOUT");
  }
}

// The core the CPU's features call for (kernels/host_blas.h), read independently from
// /proc/cpuinfo's flags: "" when the CPU has neither AVX2 + FMA nor AVX-512.
std::string ExpectedOpenBlasCore() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, flags, vendor;
  while (std::getline(in, line)) {
    if (vendor.empty() && absl::StartsWith(line, "vendor_id")) vendor = line;
    if (absl::StartsWith(line, "flags")) {
      flags = line + " ";
      break;
    }
  }
  auto has = [&](const char* f) { return absl::StrContains(flags, absl::StrCat(" ", f, " ")); };
  if (has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq") && has("avx512cd")) {
    return has("avx512_bf16") ? "Cooperlake" : "SkylakeX";
  }
  if (has("avx2") && has("fma")) {
    return absl::StrContains(vendor, "AuthenticAMD") || absl::StrContains(vendor, "Hygon")
               ? "Zen"
               : "Haswell";
  }
  return "";
}

std::string EnvValue(const std::vector<std::string>& env, const std::string& name) {
  for (const std::string& v : env) {
    if (absl::StartsWith(v, name + "=")) return v.substr(name.size() + 1);
  }
  return "(unset)";
}

// OpenBLAS falls back to its generic Prescott kernels on a CPU model it does not know. The
// daemon then re-executes itself with OPENBLAS_CORETYPE set to the core of the CPU's features,
// unless the operator set it; the start-up line, a log line and diond_build_info say which
// core runs and who chose it. DIOND_TEST_OPENBLAS_CORENAME makes this CPU look unknown.
TEST(DaemonProcess, PicksTheOpenBlasCoreWhenOpenBlasFellBack) {
  const std::string want = ExpectedOpenBlasCore();
  if (want.empty()) GTEST_SKIP() << "this CPU has no AVX2: the generic kernels are right";
  const char* saved = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved_value = saved != nullptr ? saved : "";
  unsetenv("OPENBLAS_CORETYPE");
  setenv("DIOND_TEST_OPENBLAS_CORENAME", "Prescott", 1);
  {
    auto d = StartDaemon({"--device=cpu"});
    ASSERT_NE(d, nullptr);
    const std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_EQ(EnvValue(env, "OPENBLAS_CORETYPE"), want) << d->proc->Log();
    const std::string log = d->proc->Log();
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("OpenBLAS core ", want,
                                                    " (set by diond: OpenBLAS autodetected "
                                                    "Prescott, a generic core")))
        << log;
    EXPECT_FALSE(absl::StrContains(log, "did not load")) << log;  // the core diond set loaded
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("OpenBLAS core ", want, " (diond)"))) << log;
    const std::string metrics = HttpGet(d->metrics_port, "/metrics");
    EXPECT_TRUE(absl::StrContains(metrics, absl::StrCat("openblas_core=\"", want, "\"")))
        << metrics;
    EXPECT_TRUE(absl::StrContains(metrics, "openblas_core_source=\"diond\"")) << metrics;
    std::ifstream comm("/proc/" + std::to_string(d->proc->pid()) + "/comm");
    std::string name;
    std::getline(comm, name);
    EXPECT_EQ(name, "diond");
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  // The operator's value is kept, even one that selects the generic kernels; the log warns.
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  {
    auto d = StartDaemon({"--device=cpu"});
    ASSERT_NE(d, nullptr);
    const std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_EQ(EnvValue(env, "OPENBLAS_CORETYPE"), "Prescott");
    const std::string log = d->proc->Log();
    EXPECT_TRUE(absl::StrContains(log,
                                  "OpenBLAS core Prescott (OPENBLAS_CORETYPE=Prescott, the "
                                  "operator's"))
        << log;
    EXPECT_TRUE(absl::StrContains(log, "WARNING: generic kernels")) << log;
    const std::string metrics = HttpGet(d->metrics_port, "/metrics");
    EXPECT_TRUE(absl::StrContains(metrics, "openblas_core=\"Prescott\"")) << metrics;
    EXPECT_TRUE(absl::StrContains(metrics, "openblas_core_source=\"operator\"")) << metrics;
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  unsetenv("DIOND_TEST_OPENBLAS_CORENAME");
  unsetenv("OPENBLAS_CORETYPE");
  // No fallback: nothing set, the autodetected core reported.
  {
    auto d = StartDaemon({"--device=cpu", "--calibrate_engines=false"});
    ASSERT_NE(d, nullptr);
    const std::vector<std::string> env = ProcessEnvironment(d->proc->pid());
    EXPECT_EQ(EnvValue(env, "OPENBLAS_CORETYPE"), "(unset)");
    const std::string log = d->proc->Log();
    EXPECT_TRUE(absl::StrContains(log, "(autodetected; CPU ")) << log;
    const std::string metrics = HttpGet(d->metrics_port, "/metrics");
    EXPECT_TRUE(absl::StrContains(metrics, "openblas_core_source=\"autodetected\"")) << metrics;
    // Without a calibration the defaults: oneDNN for fp32.
    EXPECT_TRUE(absl::StrContains(metrics, "engines_calibrated=\"false\"")) << metrics;
    EXPECT_TRUE(absl::StrContains(metrics, "fp32_gemm_auto=\"onednn\"")) << metrics;
    EXPECT_FALSE(absl::StrContains(log, "calibration took")) << log;
    d->proc->Signal(SIGTERM);
    EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
  }
  if (saved != nullptr) setenv("OPENBLAS_CORETYPE", saved_value.c_str(), 1);
}

// The start-up calibration: its report is logged, and the start-up line and diond_build_info
// carry the same choices.
TEST(DaemonProcess, CalibratesTheAutoEnginesAndReportsThem) {
  auto d = StartDaemon({"--device=cpu", "--calibrate_engines"});
  ASSERT_NE(d, nullptr);
  const std::string log = d->proc->Log();
  ASSERT_TRUE(absl::StrContains(log, "auto engines (512³, calibrated): fp32 GEMM ")) << log;
  EXPECT_TRUE(absl::StrContains(log, "calibration took")) << log;
  const std::string metrics = HttpGet(d->metrics_port, "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "engines_calibrated=\"true\"")) << metrics;
  for (const char* label : {"fp32_gemm_auto", "fp32_symmetric_auto", "bf16_matmul_auto"}) {
    // The engine the calibration report names is the one exported.
    const size_t at = metrics.find(absl::StrCat(label, "=\""));
    ASSERT_NE(at, std::string::npos) << label << metrics;
    const size_t start = at + std::strlen(label) + 2;
    const std::string value = metrics.substr(start, metrics.find('"', start) - start);
    const std::string what = std::string(label) == "fp32_gemm_auto"        ? "fp32 GEMM "
                             : std::string(label) == "fp32_symmetric_auto" ? "fp32 symmetric "
                                                                           : "bf16_reference ";
    const std::string in_report = absl::StrCat(what, value, " (");
    EXPECT_TRUE(absl::StrContains(log, in_report)) << label << "=" << value << "\n" << log;
  }
  EXPECT_TRUE(absl::StrContains(log, "; auto engines (calibrated): fp32 GEMM ")) << log;
  d->proc->Signal(SIGTERM);
  EXPECT_EQ(d->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
}

// The daemon exports its thread-stack floor (server/exe/thread_stack_floor.c), so civetweb's
// /metrics threads, which ask for 100 KiB, resolve to it (thread_stack_floor_test checks what
// the floor does).
TEST(DaemonProcess, ExportsTheThreadStackFloorForItsLibraries) {
  auto [rc, out] = RunCommand(std::string("nm -D --defined-only ") + DIOND_BINARY + " 2>&1");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, " T pthread_attr_setstacksize")) << out;
}

TEST(DaemonProcess, SecondDaemonOnSameAddressesFailsWithOneLine) {
  auto first = StartDaemon({"--device=cpu"});
  ASSERT_NE(first, nullptr);
  struct Case {
    std::string name;
    std::vector<std::string> argv;
  };
  std::vector<Case> cases = {
      {"unix",
       {DIOND_BINARY, "--device=cpu", "--metrics_address=", "--listen=unix:" + first->socket_path}},
      {"tcp",
       {DIOND_BINARY, "--device=cpu",
        "--metrics_address=", absl::StrCat("--listen=127.0.0.1:", first->tcp_port)}},
      {"metrics",
       {DIOND_BINARY, "--device=cpu", "--listen=127.0.0.1:0",
        absl::StrCat("--metrics_address=127.0.0.1:", first->metrics_port)}},
  };
  for (const auto& c : cases) {
    Subprocess second(c.argv, first->dir + "/second_" + c.name + ".txt");
    auto code = second.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << c.name << ": second daemon did not exit";
    EXPECT_EQ(*code, 1) << c.name << " (a crash would be negative):\n" << second.Log();
    std::string log = second.Log();
    EXPECT_TRUE(absl::StrContains(log, "diond: ")) << c.name << ": " << log;
    EXPECT_FALSE(absl::StrContains(log, "Aborted")) << log;
  }
  // A daemon whose Unix socket bound but whose TCP port is taken removes its own socket file,
  // and only its own.
  {
    const std::string own = first->dir + "/own.sock";
    Subprocess second({DIOND_BINARY, "--device=cpu", "--metrics_address=",
                       absl::StrCat("--listen=unix:", own, ",127.0.0.1:", first->tcp_port)},
                      first->dir + "/second_unix_tcp.txt");
    auto code = second.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << "second daemon did not exit";
    EXPECT_EQ(*code, 1) << second.Log();
    struct stat st;
    EXPECT_NE(stat(own.c_str(), &st), 0) << "the failed daemon left its socket file";
    EXPECT_EQ(stat(first->socket_path.c_str(), &st), 0) << "the first daemon's socket is gone";
  }
  // The first daemon is unharmed.
  EXPECT_EQ(CheckHealth("unix:" + first->socket_path, ""),
            grpc::health::v1::HealthCheckResponse::SERVING);
  first->proc->Signal(SIGTERM);
  EXPECT_EQ(first->proc->Wait(absl::Seconds(30)), std::optional<int>(0));
}

TEST(DaemonProcess, BadFlagsExitWithUsageErrorNotACrash) {
  std::string dir = MakeTempDir("diond_flags");
  for (std::vector<std::string> argv : std::vector<std::vector<std::string>>{
           {DIOND_BINARY, "--device=tpu"},
           {DIOND_BINARY, "--listen=nonsense"},
           {DIOND_BINARY, "--log_level=loud"},
           {DIOND_BINARY, "--listen=0.0.0.0:0", "--metrics_address="},
           // The plain-HTTP metrics endpoint follows the same rule.
           {DIOND_BINARY, "--listen=unix:" + dir + "/m.sock", "--metrics_address=0.0.0.0:0"},
           {DIOND_BINARY, "--listen=unix:" + dir + "/m.sock", "--max_stream_bytes=-1"},
           {DIOND_BINARY, "--listen=unix:" + dir + "/m.sock", "--rpc_handler_threads=0"},
           {DIOND_BINARY, "--listen=unix:" + dir + "/m.sock", "--world_device_collectives=mpi"}}) {
    Subprocess p(argv, dir + "/log.txt");
    auto code = p.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value());
    EXPECT_GT(*code, 0) << argv[1] << ": " << p.Log();
    EXPECT_TRUE(absl::StrContains(p.Log(), "diond: ")) << p.Log();
  }
}

// The ready file is 0600 whatever the umask (only the daemon's user reads it): a file created
// with the default mode is 0666 under umask 0.
TEST(DaemonProcess, ReadyFileIsPrivateWhateverTheUmask) {
  const mode_t old_umask = umask(0);  // inherited by the daemon
  auto d = StartDaemon();
  umask(old_umask);
  ASSERT_NE(d, nullptr);
  struct stat st;
  ASSERT_EQ(stat((d->dir + "/ready.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << std::oct << (st.st_mode & 0777);
}

TEST(DaemonBinary, HelpDocumentsEveryFlag) {
  auto [rc, out] = RunCommand(std::string(DIOND_BINARY) + " --help 2>&1");
  for (const char* flag :
       {"--listen", "--metrics_address", "--device", "--cuda_plugin", "--log_level",
        "--drain_timeout", "--ready_file", "--allow_insecure_remote", "--max_stream_bytes",
        "--orphan_grace", "--orphan_grace_named"}) {
    EXPECT_TRUE(absl::StrContains(out, flag)) << flag << " missing from --help:\n" << out;
  }
  auto [vrc, version] = RunCommand(std::string(DIOND_BINARY) + " --version 2>&1");
  EXPECT_TRUE(absl::StrContains(version, "diond ")) << version;
}

TEST(DaemonBinary, HasNoCudaLibraryDependencies) {
  auto [rc, out] = RunCommand(std::string("readelf -d ") + DIOND_BINARY);
  ASSERT_EQ(rc, 0) << out;
  ASSERT_TRUE(absl::StrContains(out, "(NEEDED)")) << out;
  for (const char* lib : {"libcuda", "libcudart", "libcublas", "libcusolver", "libnccl",
                          "libcusparse", "libnvJitLink"}) {
    EXPECT_FALSE(absl::StrContains(out, lib)) << lib << " is NEEDED by diond:\n" << out;
  }
}

}  // namespace
}  // namespace diond
