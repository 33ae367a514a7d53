#include "kernels/engine_choice.h"

#include <atomic>

namespace diond::kernels {
namespace {

// Each field its own atomic: readers on the compute threads never see a torn value.
std::atomic<Fp32GemmEngine> g_fp32_gemm{Fp32GemmEngine::kOneDnn};
std::atomic<Fp32GemmEngine> g_fp32_symmetric{Fp32GemmEngine::kOneDnn};
std::atomic<bool> g_bf16_measured{false};
std::atomic<bool> g_bf16_onednn{false};

}  // namespace

AutoEngines CurrentAutoEngines() {
  AutoEngines e;
  e.fp32_gemm = g_fp32_gemm.load(std::memory_order_relaxed);
  e.fp32_symmetric = g_fp32_symmetric.load(std::memory_order_relaxed);
  e.bf16_measured = g_bf16_measured.load(std::memory_order_relaxed);
  e.bf16_onednn = g_bf16_onednn.load(std::memory_order_relaxed);
  return e;
}

void SetAutoEngines(const AutoEngines& e) {
  g_fp32_gemm.store(e.fp32_gemm);
  g_fp32_symmetric.store(e.fp32_symmetric);
  g_bf16_measured.store(e.bf16_measured);
  g_bf16_onednn.store(e.bf16_onednn);
}

}  // namespace diond::kernels
