// diond-ipc-bench: what the data plane costs on a GPU. The Step of a daemon on the same GPU, driven
// through the C++ client, against the same update run in this process (GpuBench::StepTime: one
// GroupOptimizer on the plugin's ops backend), as ratios measured in the same run:
//   * cuda_ipc: the trainer's weights and gradients in a CudaArena exported as a legacy IPC
//     handle (the daemon reads and writes them in place on the device);
//   * shm: the same session over a ShmArena (host memory, copied to and from the device).
// Workload: the GPT-2-small hidden matrices (--layers, default 12), one Muon group in fp32 (the
// daemon's default precision), synchronous Steps: the wall time of each Step call (the client's
// view: gRPC, the region checks, the copies and the update) and the daemon's own compute time
// (StepResult::compute_micros). Starts the daemon itself (--diond, --cuda_plugin).
//
//   diond-ipc-bench --diond PATH --cuda_plugin PATH [--out FILE.json] [--reps N] [--layers L]
// Without a GPU: one line on stderr, exit 77.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu_bench_util.h"
#include "client/cpp/tests/test_daemon.h"
#include "diond/client.h"
#include "diond/cuda_arena.h"
#include "diond/shm_arena.h"

ABSL_FLAG(std::string, out, "", "write the JSON here (default: stdout)");
ABSL_FLAG(std::string, cuda_plugin, "", "path of libdiond_cuda.so");
ABSL_FLAG(std::string, diond, "", "the daemon binary (started on cuda:0)");
ABSL_FLAG(int, reps, 20, "timed Steps per data plane (after two warm-up Steps)");
ABSL_FLAG(int, layers, 12, "GPT-2-small layers of matrices");

namespace {

namespace dc = diond::client;
using diond::bench::Err;
using nlohmann::json;

struct Timing {
  double step_s = 0;     // wall seconds per Step call
  double compute_s = 0;  // the daemon's compute_micros per Step
};

absl::StatusOr<Timing> DaemonStepTime(const dc::Client& c, const std::string& session, int reps) {
  Timing t;
  std::chrono::steady_clock::time_point t0;
  for (int i = 1; i <= reps + 2; ++i) {
    if (i == 3) t0 = std::chrono::steady_clock::now();
    auto r = c.Step(session, i);
    if (!r.ok()) return r.status();
    if (i >= 3) t.compute_s += static_cast<double>(r->compute_micros) * 1e-6 / reps;
  }
  t.step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  return t;
}

// One session of `params` through a CudaArena (ipc) or a ShmArena, every weight and gradient
// 0.0115 (0x3c bytes), stepped reps + 2 times.
absl::StatusOr<Timing> Measure(const dc::Client& c, const std::vector<dc::ParamSpec>& params,
                               bool ipc, int reps) {
  const std::vector<dc::GroupSpec> groups = {{"matrices", dc::Algorithm::kMuon, {}}};
  auto layout = c.CreateSession(params, groups);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<Timing> t;
  if (ipc) {
    auto arena = dc::CudaArena::Create(&c, *layout, 0, dc::CudaArena::Export::kLegacyIpc);
    if (!arena.ok()) return arena.status();
    const cudaError_t e = cudaMemset(arena->base(), 0x3c, static_cast<size_t>(arena->plan().bytes));
    if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
    if (cudaDeviceSynchronize() != cudaSuccess) return absl::InternalError("cudaDeviceSynchronize");
    t = DaemonStepTime(c, layout->session_id, reps);
  } else {
    auto arena = dc::ShmArena::Create(&c, *layout);
    if (!arena.ok()) return arena.status();
    for (const dc::TensorLayout& tl : layout->tensors) {
      for (auto span : {*arena->Param(tl.name), *arena->Grad(tl.name)}) {
        std::fill(span.begin(), span.end(), 0.0115f);
      }
    }
    t = DaemonStepTime(c, layout->session_id, reps);
  }
  (void)c.CloseSession(layout->session_id);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  diond::bench::GpuBench b;
  if (int rc =
          b.Open("diond-ipc-bench", absl::GetFlag(FLAGS_cuda_plugin), absl::GetFlag(FLAGS_reps));
      rc != 0) {
    return rc;
  }
  const std::vector<diond::optim::ParamShape> shapes =
      diond::bench::Gpt2SmallMatrices(absl::GetFlag(FLAGS_layers));
  json out{{"reps", b.reps},
           {"layers", absl::GetFlag(FLAGS_layers)},
           {"tensors", shapes.size()},
           {"algorithm", "muon"},
           {"precision", "fp32"}};
  auto in_process =
      b.StepTime(diond::optim::AlgorithmKind::kMuon, shapes, 1.0, diond::optim::Precision::kFp32);
  if (!in_process.ok()) {
    out["in_process"] = Err(in_process.status());
    diond::bench::WriteJson(out, absl::GetFlag(FLAGS_out));
    return 1;
  }
  out["in_process_step_s"] = *in_process;
  b.ctx.reset();  // the daemon gets the GPU's memory to itself

  if (absl::GetFlag(FLAGS_diond).empty()) {
    std::fprintf(stderr, "diond-ipc-bench: --diond (the daemon binary) is required\n");
    return 2;
  }
  auto daemon = dc::testing::StartTestDaemon(
      absl::GetFlag(FLAGS_diond),
      {"--device=cuda:0", absl::StrCat("--cuda_plugin=", absl::GetFlag(FLAGS_cuda_plugin))});
  if (!daemon.ok()) {
    std::fprintf(stderr, "diond-ipc-bench: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  auto client = dc::Client::Connect((*daemon)->target);
  if (!client.ok()) {
    std::fprintf(stderr, "diond-ipc-bench: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  std::vector<dc::ParamSpec> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    params.push_back({absl::StrCat("m", i), shapes[i], dc::DType::kF32, "matrices"});
  }
  int rc = 0;
  for (const bool ipc : {true, false}) {
    const char* key = ipc ? "cuda_ipc" : "shm";
    auto t = Measure(**client, params, ipc, b.reps);
    if (!t.ok()) {
      out[key] = Err(t.status());
      rc = 1;
      continue;
    }
    out[key] = json{{"step_s", t->step_s},
                    {"daemon_compute_s", t->compute_s},
                    {"ratio_over_in_process", t->step_s / *in_process}};
  }
  client->reset();
  (*daemon)->Stop();
  diond::bench::WriteJson(out, absl::GetFlag(FLAGS_out));
  return rc;
}
