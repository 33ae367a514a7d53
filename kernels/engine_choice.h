// What the `auto` engines resolve to for large products in this process: oneDNN's fp32 GEMM by
// default, or what a start-up calibration (kernels/engine_calibration.h) measured faster. Set
// once at start-up, before any session exists; read by the CPU backend (kernels/cpu/gemm.cc)
// and by optim::ResolveBf16Matmul.
#ifndef DIOND_KERNELS_ENGINE_CHOICE_H_
#define DIOND_KERNELS_ENGINE_CHOICE_H_

#include "kernels/context.h"

namespace diond::kernels {

struct AutoEngines {
  // Fp32GemmEngine::kAuto for GEMMs and symmetric products of at least 128³ multiply-adds
  // (smaller and matrix-vector products stay on OpenBLAS): kOneDnn or kOpenBlas.
  Fp32GemmEngine fp32_gemm = Fp32GemmEngine::kOneDnn;
  Fp32GemmEngine fp32_symmetric = Fp32GemmEngine::kOneDnn;
  // bf16_reference's bf16_matmul=auto. Unset (false): the ISA rule of ResolveBf16Matmul
  // (oneDNN's bf16 matmul where the CPU has the AVX-512 core, as PyTorch decides). Set: the
  // faster of the two engines bf16_reference offers (both keep the reference's rounding points).
  bool bf16_measured = false;
  bool bf16_onednn = false;  // with bf16_measured: oneDNN bf16 (true) or the widened fp32 GEMM
};

AutoEngines CurrentAutoEngines();
// Not thread-safe against concurrent GEMMs: call before the compute threads start.
void SetAutoEngines(const AutoEngines& engines);

// Whether oneDNN 2.6 has a bf16 matmul on this CPU: it needs the AVX-512 core (F, BW, VL, DQ,
// with the OS saving their state). Without it every bf16 GEMM op fails (FAILED_PRECONDITION),
// bf16_matmul=auto takes the widened fp32 GEMM, and an explicit onednn request is refused.
bool CpuHasOneDnnBf16Matmul();

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_ENGINE_CHOICE_H_
