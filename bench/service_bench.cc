// Service benchmarks of issue "Optimizer service v1", measured against baselines in the same run:
//  1. Step overhead: a Step RPC over shared memory on a GPT-2-small parameter set (124M
//     parameters: Muon for the 2-D block matrices, AdamW for embeddings, biases and norms)
//     against the identical update computed in this process by the same kernels
//     (GroupOptimizer), interleaved so both see the same machine state.
//  2. Streaming: PushGradients and PullParameters throughput on loopback (Unix socket) against a
//     memcpy of the same bytes.
// Usage: diond_service_bench --diond=<path to diond> [--layers=12] [--steps=3]
//        [--stream_mb=256]. Prints a markdown table. Not a test: nothing asserts on time.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "diond/v1/optimizer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/context.h"
#include "kernels/optim/group_optimizer.h"
#include "nlohmann/json.hpp"
#include "tests/integration/subprocess.h"

ABSL_FLAG(std::string, diond, "", "Path of the diond binary.");
ABSL_FLAG(int, layers, 12, "Transformer blocks (GPT-2 small has 12).");
ABSL_FLAG(int, steps, 3, "Timed steps per side (after one warm-up each).");
ABSL_FLAG(int, stream_mb, 256, "Bytes pushed and pulled per streaming measurement, in MiB.");

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  bool matrix;
};

std::vector<Param> Gpt2Small(int layers) {
  const int64_t d = 768, v = 50257, ctx = 1024;
  std::vector<Param> p = {{"wte", {v, d}, false}, {"wpe", {ctx, d}, false}};
  for (int l = 0; l < layers; ++l) {
    std::string b = absl::StrCat("h", l, ".");
    p.push_back({b + "ln1.w", {d}, false});
    p.push_back({b + "ln1.b", {d}, false});
    p.push_back({b + "attn.qkv.w", {3 * d, d}, true});
    p.push_back({b + "attn.qkv.b", {3 * d}, false});
    p.push_back({b + "attn.proj.w", {d, d}, true});
    p.push_back({b + "attn.proj.b", {d}, false});
    p.push_back({b + "ln2.w", {d}, false});
    p.push_back({b + "ln2.b", {d}, false});
    p.push_back({b + "mlp.fc.w", {4 * d, d}, true});
    p.push_back({b + "mlp.fc.b", {4 * d}, false});
    p.push_back({b + "mlp.proj.w", {d, 4 * d}, true});
    p.push_back({b + "mlp.proj.b", {d}, false});
  }
  p.push_back({"ln_f.w", {d}, false});
  p.push_back({"ln_f.b", {d}, false});
  return p;
}

int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t x : s) n *= x;
  return n;
}

void Check(const grpc::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, s.error_message().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string diond = absl::GetFlag(FLAGS_diond);
  if (diond.empty()) {
    std::fprintf(stderr, "--diond is required\n");
    return 2;
  }
  const std::vector<Param> params = Gpt2Small(absl::GetFlag(FLAGS_layers));
  const int steps = absl::GetFlag(FLAGS_steps);
  int64_t total = 0;
  for (const Param& p : params) total += Numel(p.shape);

  // ---- daemon ----
  std::string dir = diond::testing::MakeTempDir("diond_bench");
  diond::testing::Subprocess daemon(
      {diond, "--device=cpu", "--listen=unix:" + dir + "/d.sock",
       "--metrics_address=", "--ready_file=" + dir + "/ready.json", "--log_level=warning"},
      dir + "/diond.log");
  for (int i = 0; i < 600 && diond::testing::ReadFile(dir + "/ready.json").empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel("unix:" + dir + "/d.sock",
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = diond::v1::Optimizer::NewStub(channel);

  diond::v1::CreateSessionRequest create;
  create.set_client_name("service_bench");
  auto* gm = create.add_groups();
  gm->set_name("muon");
  gm->set_algorithm(diond::v1::ALGORITHM_MUON);
  auto* ga = create.add_groups();
  ga->set_name("adamw");
  ga->set_algorithm(diond::v1::ALGORITHM_ADAMW);
  for (const Param& p : params) {
    auto* ps = create.add_parameters();
    ps->set_name(p.name);
    for (int64_t d : p.shape) ps->add_shape(d);
    ps->set_dtype(diond::v1::DTYPE_F32);
    ps->set_group(p.matrix ? "muon" : "adamw");
  }
  diond::v1::CreateSessionResponse layout;
  {
    grpc::ClientContext c;
    Check(stub->CreateSession(&c, create, &layout), "CreateSession");
  }
  // One shm segment: parameters, then gradients.
  const int64_t pbytes = layout.param_arena_bytes(), gbytes = layout.grad_arena_bytes();
  std::string shm_name = absl::StrCat("diond-bench-", getpid());
  int fd = shm_open(("/" + shm_name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, pbytes + gbytes) != 0) {
    std::perror("shm");
    return 1;
  }
  auto* base = static_cast<uint8_t*>(
      mmap(nullptr, pbytes + gbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::vector<float>> local_p(params.size()), local_g(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& l = layout.layout(static_cast<int>(i));
    int64_t n = Numel(params[i].shape);
    local_p[i].resize(n);
    local_g[i].resize(n);
    for (auto& x : local_p[i]) x = normal(rng);
    for (auto& x : local_g[i]) x = normal(rng);
    std::memcpy(base + l.param_offset_bytes(), local_p[i].data(), n * 4);
    std::memcpy(base + pbytes + l.grad_offset_bytes(), local_g[i].data(), n * 4);
  }
  for (auto [role, off, size] : {std::tuple{diond::v1::REGION_ROLE_PARAMETERS, int64_t{0}, pbytes},
                                 std::tuple{diond::v1::REGION_ROLE_GRADIENTS, pbytes, gbytes}}) {
    diond::v1::RegisterRegionRequest r;
    r.set_session_id(layout.session_id());
    r.set_role(role);
    r.set_kind(diond::v1::REGION_KIND_SYSTEM_SHM);
    r.mutable_system_shm()->set_name(shm_name);
    r.mutable_system_shm()->set_offset_bytes(off);
    r.mutable_system_shm()->set_size_bytes(size);
    diond::v1::RegisterRegionResponse resp;
    grpc::ClientContext c;
    Check(stub->RegisterRegion(&c, r, &resp), "RegisterRegion");
  }

  // ---- in-process baseline: the same GroupOptimizer path the daemon runs ----
  diond::optim::GroupConfig muon_cfg, adamw_cfg;
  muon_cfg.algorithm = diond::optim::AlgorithmKind::kMuon;
  muon_cfg.hyperparams = diond::optim::DefaultHyperparams(muon_cfg.algorithm);
  adamw_cfg.algorithm = diond::optim::AlgorithmKind::kAdamW;
  adamw_cfg.hyperparams = diond::optim::DefaultHyperparams(adamw_cfg.algorithm);
  std::vector<diond::optim::ParamShape> ms, as;
  std::vector<float*> mp, ap;
  std::vector<const float*> mg, ag;
  for (size_t i = 0; i < params.size(); ++i) {
    (params[i].matrix ? ms : as).push_back(params[i].shape);
    (params[i].matrix ? mp : ap).push_back(local_p[i].data());
    (params[i].matrix ? mg : ag).push_back(local_g[i].data());
  }
  auto muon = diond::optim::CreateGroupOptimizer(muon_cfg, ms);
  auto adamw = diond::optim::CreateGroupOptimizer(adamw_cfg, as);
  auto ctx = diond::kernels::Context::CpuDefault();
  auto in_process_step = [&] {
    auto t = Clock::now();
    if (!(*muon)->Step(*ctx, mp, mg).ok() || !(*adamw)->Step(*ctx, ap, ag).ok()) std::exit(1);
    return Seconds(t);
  };
  int64_t step_index = 0;
  double daemon_compute = 0;
  auto service_step = [&] {
    diond::v1::StepRequest r;
    r.set_session_id(layout.session_id());
    r.set_step_index(++step_index);
    diond::v1::StepResponse resp;
    grpc::ClientContext c;
    auto t = Clock::now();
    Check(stub->Step(&c, r, &resp), "Step");
    double s = Seconds(t);
    daemon_compute += resp.compute_micros() * 1e-6;
    return s;
  };
  in_process_step();  // warm-up (allocations, page faults)
  service_step();
  daemon_compute = 0;
  double in_total = 0, svc_total = 0;
  for (int i = 0; i < steps; ++i) {
    in_total += in_process_step();
    svc_total += service_step();
  }
  const double in_mean = in_total / steps, svc_mean = svc_total / steps;

  // ---- streaming ----
  const int64_t stream_bytes = int64_t{absl::GetFlag(FLAGS_stream_mb)} << 20;
  // Push the largest tensors until stream_bytes is covered (whole tensors: the daemon requires
  // each named tensor complete).
  std::vector<size_t> chosen;
  int64_t chosen_bytes = 0;
  for (size_t i = 0; i < params.size() && chosen_bytes < stream_bytes; ++i) {
    chosen.push_back(i);
    chosen_bytes += Numel(params[i].shape) * 4;
  }
  auto push = [&] {
    grpc::ClientContext c;
    diond::v1::PushGradientsResponse resp;
    auto writer = stub->PushGradients(&c, &resp);
    bool first = true;
    for (size_t i : chosen) {
      const int64_t bytes = Numel(params[i].shape) * 4;
      for (int64_t off = 0; off < bytes; off += 4 << 20) {
        diond::v1::TensorChunk ch;
        if (first) ch.set_session_id(layout.session_id());
        first = false;
        ch.set_name(params[i].name);
        ch.set_offset_bytes(off);
        ch.set_data(reinterpret_cast<const char*>(local_g[i].data()) + off,
                    static_cast<size_t>(std::min<int64_t>(4 << 20, bytes - off)));
        writer->Write(ch);
      }
    }
    writer->WritesDone();
    Check(writer->Finish(), "PushGradients");
  };
  auto pull = [&] {
    grpc::ClientContext c;
    diond::v1::PullParametersRequest r;
    r.set_session_id(layout.session_id());
    for (size_t i : chosen) r.add_names(params[i].name);
    auto reader = stub->PullParameters(&c, r);
    diond::v1::TensorChunk ch;
    int64_t got = 0;
    while (reader->Read(&ch)) got += static_cast<int64_t>(ch.data().size());
    Check(reader->Finish(), "PullParameters");
    return got;
  };
  push();
  pull();  // warm-up
  auto t = Clock::now();
  push();
  double push_s = Seconds(t);
  t = Clock::now();
  int64_t pulled = pull();
  double pull_s = Seconds(t);
  std::vector<char> src(static_cast<size_t>(chosen_bytes), 1), dst(src.size());
  std::memcpy(dst.data(), src.data(), src.size());  // fault the pages in
  t = Clock::now();
  std::memcpy(dst.data(), src.data(), src.size());
  double memcpy_s = Seconds(t);

  const double gb = chosen_bytes / 1e9;
  std::printf("| measurement | value |\n| --- | --- |\n");
  std::printf("| parameters | %.1f M in %d tensors (%d layers) |\n", total / 1e6,
              static_cast<int>(params.size()), absl::GetFlag(FLAGS_layers));
  std::printf("| in-process step (same kernels), mean of %d | %.1f ms |\n", steps, in_mean * 1e3);
  std::printf("| Step RPC over shm, mean of %d | %.1f ms |\n", steps, svc_mean * 1e3);
  std::printf("| of which daemon compute | %.1f ms |\n", daemon_compute / steps * 1e3);
  std::printf("| overhead | %+.1f ms (%+.2f%%) |\n", (svc_mean - in_mean) * 1e3,
              100 * (svc_mean - in_mean) / in_mean);
  std::printf("| PushGradients %.0f MB | %.2f GB/s |\n", chosen_bytes / 1e6, gb / push_s);
  std::printf("| PullParameters %.0f MB | %.2f GB/s |\n", pulled / 1e6, pulled / 1e9 / pull_s);
  std::printf("| memcpy of the same bytes | %.2f GB/s |\n", gb / memcpy_s);

  munmap(base, pbytes + gbytes);
  shm_unlink(("/" + shm_name).c_str());
  daemon.Signal(SIGTERM);
  daemon.Wait(absl::Seconds(30));
  return 0;
}
