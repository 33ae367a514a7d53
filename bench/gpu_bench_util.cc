#include "bench/gpu_bench_util.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <utility>

#include "kernels/device_runtime.h"
#include "kernels/graph.h"
#include "kernels/ops.h"
#include "kernels/plugin/plugin_backend.h"

namespace diond::bench {

int GpuBench::Open(const char* program, const std::string& plugin, int r) {
  reps = r;
  absl::Status reg = kernels::RegisterCudaOps(plugin);
  if (!reg.ok()) {
    std::fprintf(stderr, "%s: no GPU to measure: %s\n", program,
                 std::string(reg.message()).c_str());
    return 77;
  }
  dev = kernels::Device{kernels::DeviceType::kCuda, 0};
  auto s = kernels::DeviceRuntimeFor(dev.type).create_stream(dev);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(s.status().message()).c_str());
    return 1;
  }
  stream = *s;
  kernels::ContextOptions o;
  o.device = dev;
  o.stream = stream;
  auto c = kernels::Context::Create(o);
  if (!c.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(c.status().message()).c_str());
    return 1;
  }
  ctx = std::move(*c);
  return 0;
}

GpuBench::~GpuBench() {
  ctx.reset();
  if (stream != nullptr) kernels::DeviceRuntimeFor(dev.type).destroy_stream(dev, stream);
}

absl::StatusOr<double> GpuBench::Time(const std::function<absl::Status()>& f) const {
  absl::Status s = f();
  if (!s.ok()) return s;
  s = kernels::DeviceRuntimeFor(dev.type).synchronize_stream(dev, stream);
  if (!s.ok()) return s;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    s = f();
    if (!s.ok()) return s;
  }
  s = kernels::DeviceRuntimeFor(dev.type).synchronize_stream(dev, stream);
  if (!s.ok()) return s;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

absl::StatusOr<kernels::Buffer> GpuBench::Filled(kernels::DType t,
                                                 const std::vector<int64_t>& shape,
                                                 float value) const {
  auto b = ctx->Allocate(t, shape);
  if (!b.ok()) return b.status();
  absl::Status s = kernels::Fill(*ctx, value, b->view());
  if (!s.ok()) return s;
  return b;
}

absl::StatusOr<double> GpuBench::StepTime(optim::AlgorithmKind kind,
                                          const std::vector<optim::ParamShape>& shapes,
                                          double rank_fraction, optim::Precision precision,
                                          bool graph) const {
  optim::GroupConfig cfg;
  cfg.algorithm = kind;
  cfg.hyperparams = optim::DefaultHyperparams(kind);
  cfg.hyperparams.rank_fraction = rank_fraction;
  cfg.precision = precision;
  auto opt = optim::CreateGroupOptimizer(*ctx, cfg, shapes);
  if (!opt.ok()) return opt.status();
  std::vector<kernels::Buffer> params, grads;
  std::vector<float*> pp;
  std::vector<const float*> gp;
  for (const auto& shape : shapes) {
    auto p = Filled(kernels::DType::kF32, shape, 0.01f);
    auto g = Filled(kernels::DType::kF32, shape, 0.001f);
    if (!p.ok()) return p.status();
    if (!g.ok()) return g.status();
    pp.push_back(p->As<float>());
    gp.push_back(g->As<float>());
    params.push_back(std::move(*p));
    grads.push_back(std::move(*g));
  }
  if (!graph) return Time([&] { return (*opt)->Step(*ctx, pp, gp); });
  // The first step eagerly (as a session's), then Stage through the graph.
  if (absl::Status s = (*opt)->Step(*ctx, pp, gp); !s.ok()) return s;
  kernels::GraphHooks hooks;
  const kernels::DeviceRuntime& rt = kernels::DeviceRuntimeFor(ctx->device().type);
  hooks.begin_capture = rt.begin_capture;
  hooks.end_capture = rt.end_capture;
  hooks.launch = rt.launch_graph;
  hooks.destroy = rt.destroy_graph;
  kernels::StepGraph sg(ctx.get(), hooks);
  int64_t step = 1;
  return Time([&]() -> absl::Status {
    optim::StepOptions o;
    o.lr = 0.01 / static_cast<double>(++step);
    auto out = sg.Run([&] { return (*opt)->Stage(*ctx, pp, gp, o); });
    if (!out.ok()) return out.status();
    if (out->mode == kernels::StepGraph::Mode::kEager) {
      return absl::FailedPreconditionError("the update ran eagerly (" + out->reason + ": " +
                                           out->detail + ")");
    }
    (*opt)->WriteStagedParams(pp);
    (*opt)->CommitStagedState();
    return absl::OkStatus();
  });
}

nlohmann::json Err(const absl::Status& s) {
  return nlohmann::json{{"error", std::string(s.ToString())}};
}

std::vector<optim::ParamShape> Gpt2SmallMatrices(int layers) {
  std::vector<optim::ParamShape> shapes;
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < 4; ++i) shapes.push_back({768, 768});
    shapes.push_back({768, 3072});
    shapes.push_back({3072, 768});
  }
  return shapes;
}

void WriteJson(const nlohmann::json& out, const std::string& path) {
  const std::string text = out.dump(2);
  if (path.empty()) {
    std::cout << text << "\n";
  } else {
    std::ofstream(path) << text << "\n";
  }
}

}  // namespace diond::bench
