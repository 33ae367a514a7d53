// diond-gpu-bench: the GPU benchmarks, each a ratio of two times measured in the same run (so that
// the GPU's clock and load cancel out) on one GPU through the CUDA plugin's ops backend
// (docs/GPU.md):
//   * orthogonalization TFLOP/s ÷ cuBLAS bf16 GEMM TFLOP/s, on 4096², 8192² and 4096×16384;
//   * Dion (rank 1/16) step time ÷ Muon step time on one 16384×53248 matrix;
//   * the GPT-2-small matrix set's step time, CUDA graph vs eager.
// A measurement that cannot run yet is written with its reason ("error"), never as a number.
//
//   diond-gpu-bench [--out FILE.json] [--cuda_plugin PATH] [--reps N]
// Without a GPU: one line on stderr, exit 77.
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/gpu_bench_util.h"
#include "kernels/ops.h"
#include "kernels/optim/orthogonalize.h"

ABSL_FLAG(std::string, out, "", "write the JSON here (default: stdout)");
ABSL_FLAG(std::string, cuda_plugin, "", "path of libdiond_cuda.so");
ABSL_FLAG(int, reps, 10, "timed repetitions per measurement (after one warm-up)");

namespace {

using diond::bench::Err;
using diond::bench::GpuBench;
using diond::kernels::DType;
using nlohmann::json;

// bf16 GEMM X·Xᵀ (m×n·n×m, f32 accumulation, bf16 out) and Polar Express on X (m×n).
json OrthoVsGemm(const GpuBench& b, int64_t m, int64_t n) {
  json r{{"shape", {m, n}}};
  auto x = b.Filled(DType::kBf16, {m, n}, 0.01f);
  auto c = b.ctx->Allocate(DType::kBf16, {m, m});
  auto o = b.ctx->Allocate(DType::kBf16, {m, n});
  if (!x.ok() || !c.ok() || !o.ok()) return Err(!x.ok() ? x.status() : c.status());
  diond::kernels::GemmParams p;
  p.trans_b = diond::kernels::Trans::kYes;
  auto gemm =
      b.Time([&] { return diond::kernels::Gemm(*b.ctx, p, x->cview(), x->cview(), c->view()); });
  const double gemm_flops = 2.0 * m * m * n;
  if (gemm.ok()) {
    r["gemm_bf16_tflops"] = gemm_flops / *gemm / 1e12;
  } else {
    r["gemm_bf16"] = Err(gemm.status());
  }
  diond::kernels::OrthogonalizeOptions oo;
  oo.precision = diond::kernels::OrthoPrecision::kBf16Reference;
  auto ortho =
      b.Time([&] { return diond::kernels::Orthogonalize(*b.ctx, oo, x->cview(), o->view()); });
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

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  GpuBench b;
  if (int rc =
          b.Open("diond-gpu-bench", absl::GetFlag(FLAGS_cuda_plugin), absl::GetFlag(FLAGS_reps));
      rc != 0) {
    return rc;
  }
  json out;
  out["reps"] = b.reps;
  for (auto [m, n] :
       std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192}, {4096, 16384}}) {
    out["ortho_vs_gemm"].push_back(OrthoVsGemm(b, m, n));
  }
  using diond::optim::AlgorithmKind;
  using diond::optim::Precision;
  const std::vector<diond::optim::ParamShape> big = {{16384, 53248}};
  auto dion = b.StepTime(AlgorithmKind::kDion, big, 1.0 / 16.0, Precision::kBf16Reference);
  auto muon = b.StepTime(AlgorithmKind::kMuon, big, 1.0, Precision::kBf16Reference);
  json dm{{"shape", {16384, 53248}}, {"dion_rank_fraction", 1.0 / 16.0}};
  if (dion.ok())
    dm["dion_step_s"] = *dion;
  else
    dm["dion"] = Err(dion.status());
  if (muon.ok())
    dm["muon_step_s"] = *muon;
  else
    dm["muon"] = Err(muon.status());
  if (dion.ok() && muon.ok()) dm["ratio_dion_over_muon"] = *dion / *muon;
  out["dion_vs_muon"] = dm;
  auto eager = b.StepTime(AlgorithmKind::kMuon, diond::bench::Gpt2SmallMatrices(1), 1.0,
                          Precision::kBf16Reference);
  json ge;
  if (eager.ok())
    ge["eager_step_s"] = *eager;
  else
    ge["eager"] = Err(eager.status());
  auto graphed = b.StepTime(AlgorithmKind::kMuon, diond::bench::Gpt2SmallMatrices(1), 1.0,
                            Precision::kBf16Reference, /*graph=*/true);
  if (graphed.ok())
    ge["graph_step_s"] = *graphed;
  else
    ge["graph"] = Err(graphed.status());
  if (eager.ok() && graphed.ok()) ge["ratio_graph_over_eager"] = *graphed / *eager;
  out["gpt2_graph_vs_eager"] = ge;
  diond::bench::WriteJson(out, absl::GetFlag(FLAGS_out));
  return 0;
}
