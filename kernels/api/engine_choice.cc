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

bool CpuHasOneDnnBf16Matmul() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // GCC's and Clang's checks read CPUID and that the OS saves the AVX-512 state (XGETBV).
  static const bool avx512_core =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512_core;
#else
  return false;
#endif
}

}  // namespace diond::kernels
