// oneDNN 2.6 matmul behind a Status-returning wrapper (TOOLCHAIN.md §12). oneDNN's C++ API
// throws dnnl::error; this is the only place that catches it, converting to INTERNAL.
// Thread-safety: a OneDnnMatmul may be executed from one thread at a time.
#ifndef DIOND_KERNELS_CPU_ONEDNN_MATMUL_H_
#define DIOND_KERNELS_CPU_ONEDNN_MATMUL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace diond::kernels::cpu {

// C[m×n] = alpha·A[m×k]·B[k×n] + beta·C, each operand given by element strides (row, col), so
// transposes are strides. beta == 0 does not read C.
struct MatmulShape {
  int64_t m = 0, n = 0, k = 0;
  DType a_type = DType::kF32, b_type = DType::kF32, c_type = DType::kF32;
  int64_t a_strides[2] = {0, 1};
  int64_t b_strides[2] = {0, 1};
  int64_t c_strides[2] = {0, 1};
  float alpha = 1.0f;
  float beta = 0.0f;
};

class OneDnnMatmul {
 public:
  // m, n, k >= 1. INTERNAL if oneDNN has no implementation for the combination.
  static absl::StatusOr<std::unique_ptr<OneDnnMatmul>> Create(const MatmulShape& shape);
  ~OneDnnMatmul();
  absl::Status Execute(const void* a, const void* b, void* c) const;

 private:
  struct Impl;
  explicit OneDnnMatmul(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diond::kernels::cpu

#endif  // DIOND_KERNELS_CPU_ONEDNN_MATMUL_H_
