// diond-gpu-bench: the GPU benchmarks of issue 11 item 7, each a ratio measured in the same run
// on one GPU through the CUDA plugin's ops backend (docs/GPU.md):
//   * orthogonalization TFLOP/s ÷ cuBLAS bf16 GEMM TFLOP/s, on 4096², 8192² and 4096×16384;
//   * Dion (rank 1/16) step time ÷ Muon step time on one 16384×53248 matrix;
//   * the GPT-2-small matrix set's step time, CUDA graph vs eager.
// A measurement that cannot run yet is written with its reason ("error"), never as a number.
//
//   diond-gpu-bench [--out FILE.json] [--cuda_plugin PATH] [--reps N]
// Without a GPU: one line on stderr, exit 77.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/context.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/optim/orthogonalize.h"
#include "kernels/plugin/plugin_backend.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, out, "", "write the JSON here (default: stdout)");
ABSL_FLAG(std::string, cuda_plugin, "", "path of libdiond_cuda.so");
ABSL_FLAG(int, reps, 10, "timed repetitions per measurement (after one warm-up)");

namespace {

using diond::kernels::Buffer;
using diond::kernels::Context;
using diond::kernels::Device;
using diond::kernels::DType;
using nlohmann::json;

struct Bench {
  Device dev;
  diond::kernels::StreamHandle stream = nullptr;
  std::unique_ptr<Context> ctx;
  int reps = 10;

  // Median-free mean seconds per call of `f` over `reps` calls after one warm-up, synchronized.
  absl::StatusOr<double> Time(const std::function<absl::Status()>& f) const {
    absl::Status s = f();
    if (!s.ok()) return s;
    s = diond::kernels::SynchronizeDeviceStream(dev, stream);
    if (!s.ok()) return s;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      s = f();
      if (!s.ok()) return s;
    }
    s = diond::kernels::SynchronizeDeviceStream(dev, stream);
    if (!s.ok()) return s;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  }
  absl::StatusOr<Buffer> Random(DType t, const std::vector<int64_t>& shape, float value) const {
    auto b = ctx->Allocate(t, shape);
    if (!b.ok()) return b.status();
    absl::Status s = diond::kernels::Fill(*ctx, value, b->view());
    if (!s.ok()) return s;
    return b;
  }
};

json Err(const absl::Status& s) { return json{{"error", std::string(s.ToString())}}; }

// bf16 GEMM X·Xᵀ (m×n·n×m, f32 accumulation, bf16 out) and Polar Express on X (m×n).
json OrthoVsGemm(const Bench& b, int64_t m, int64_t n) {
  json r{{"shape", {m, n}}};
  auto x = b.Random(DType::kBf16, {m, n}, 0.01f);
  auto c = b.ctx->Allocate(DType::kBf16, {m, m});
  auto o = b.ctx->Allocate(DType::kBf16, {m, n});
  if (!x.ok() || !c.ok() || !o.ok()) return Err(!x.ok() ? x.status() : c.status());
  diond::kernels::GemmParams p;
  p.trans_b = diond::kernels::Trans::kYes;
  auto gemm = b.Time([&] { return diond::kernels::Gemm(*b.ctx, p, x->cview(), x->cview(), c->view()); });
  const double gemm_flops = 2.0 * m * m * n;
  if (gemm.ok()) {
    r["gemm_bf16_tflops"] = gemm_flops / *gemm / 1e12;
  } else {
    r["gemm_bf16"] = Err(gemm.status());
  }
  diond::kernels::OrthogonalizeOptions oo;
  oo.precision = diond::kernels::OrthoPrecision::kBf16Reference;
  auto ortho = b.Time([&] { return diond::kernels::Orthogonalize(*b.ctx, oo, x->cview(), o->view()); });
  // Polar Express: 5 iterations of A = XXᵀ (2m²n), B = bA + cA² (2m³), X = aX + BX (2m²n).
  const double ortho_flops = 5.0 * (4.0 * m * m * n + 2.0 * m * m * m);
  if (ortho.ok()) {
    r["ortho_tflops"] = ortho_flops / *ortho / 1e12;
    if (gemm.ok()) r["ratio_ortho_over_gemm"] = (ortho_flops / *ortho) / (gemm_flops / *gemm);
  } else {
    r["ortho"] = Err(ortho.status());
  }
  return r;
}

// One GroupOptimizer step on device-resident parameters and gradients.
absl::StatusOr<double> StepTime(const Bench& b, diond::optim::AlgorithmKind kind,
                                const std::vector<diond::optim::ParamShape>& shapes,
                                double rank_fraction) {
  diond::optim::GroupConfig cfg;
  cfg.algorithm = kind;
  cfg.hyperparams = diond::optim::DefaultHyperparams(kind);
  cfg.hyperparams.rank_fraction = rank_fraction;
  cfg.precision = diond::optim::Precision::kBf16Reference;
  auto opt = diond::optim::CreateGroupOptimizer(*b.ctx, cfg, shapes);
  if (!opt.ok()) return opt.status();
  std::vector<Buffer> params, grads;
  std::vector<float*> pp;
  std::vector<const float*> gp;
  for (const auto& s : shapes) {
    auto p = b.Random(DType::kF32, s, 0.01f);
    auto g = b.Random(DType::kF32, s, 0.001f);
    if (!p.ok()) return p.status();
    if (!g.ok()) return g.status();
    pp.push_back(p->As<float>());
    gp.push_back(g->As<float>());
    params.push_back(std::move(*p));
    grads.push_back(std::move(*g));
  }
  return b.Time([&] { return (*opt)->Step(*b.ctx, pp, gp); });
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Bench b;
  b.reps = absl::GetFlag(FLAGS_reps);
  absl::Status reg = diond::kernels::RegisterCudaOps(absl::GetFlag(FLAGS_cuda_plugin));
  if (!reg.ok()) {
    std::fprintf(stderr, "diond-gpu-bench: no GPU to measure: %s\n",
                 std::string(reg.message()).c_str());
    return 77;
  }
  b.dev = Device{diond::kernels::DeviceType::kCuda, 0};
  auto stream = diond::kernels::CreateDeviceStream(b.dev);
  if (!stream.ok()) {
    std::fprintf(stderr, "diond-gpu-bench: %s\n", std::string(stream.status().message()).c_str());
    return 1;
  }
  b.stream = *stream;
  diond::kernels::ContextOptions o;
  o.device = b.dev;
  o.stream = b.stream;
  auto ctx = Context::Create(o);
  if (!ctx.ok()) {
    std::fprintf(stderr, "diond-gpu-bench: %s\n", std::string(ctx.status().message()).c_str());
    return 1;
  }
  b.ctx = std::move(*ctx);

  json out;
  out["reps"] = b.reps;
  for (auto [m, n] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192},
                                                               {4096, 16384}}) {
    out["ortho_vs_gemm"].push_back(OrthoVsGemm(b, m, n));
  }
  const std::vector<diond::optim::ParamShape> big = {{16384, 53248}};
  auto dion = StepTime(b, diond::optim::AlgorithmKind::kDion, big, 1.0 / 16.0);
  auto muon = StepTime(b, diond::optim::AlgorithmKind::kMuon, big, 1.0);
  json dm{{"shape", {16384, 53248}}, {"dion_rank_fraction", 1.0 / 16.0}};
  if (dion.ok()) dm["dion_step_s"] = *dion; else dm["dion"] = Err(dion.status());
  if (muon.ok()) dm["muon_step_s"] = *muon; else dm["muon"] = Err(muon.status());
  if (dion.ok() && muon.ok()) dm["ratio_dion_over_muon"] = *dion / *muon;
  out["dion_vs_muon"] = dm;
  const std::vector<diond::optim::ParamShape> gpt2 = {{768, 768}, {768, 768}, {768, 768},
                                                      {768, 768}, {768, 3072}, {3072, 768}};
  auto eager = StepTime(b, diond::optim::AlgorithmKind::kMuon, gpt2, 1.0);
  json ge;
  if (eager.ok()) ge["eager_step_s"] = *eager; else ge["eager"] = Err(eager.status());
  ge["graph"] = json{{"error", "not implemented: the CUDA-graph-captured step does not exist yet"}};
  out["gpt2_graph_vs_eager"] = ge;

  b.ctx.reset();
  diond::kernels::DestroyDeviceStream(b.dev, b.stream);
  const std::string text = out.dump(2);
  if (absl::GetFlag(FLAGS_out).empty()) {
    std::cout << text << "\n";
  } else {
    std::ofstream(absl::GetFlag(FLAGS_out)) << text << "\n";
  }
  return 0;
}
