// The CPU backend of the ops API (kernels/backend.h): the implementations behind the table, for
// use inside kernels/cpu only (they skip the dispatcher's validation; callers pass valid
// arguments). Code outside kernels/cpu calls kernels/ops.h instead (tests/layering_test.sh).
#ifndef DIOND_KERNELS_CPU_BACKEND_H_
#define DIOND_KERNELS_CPU_BACKEND_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace diond::kernels::cpu {

// The table, registered for DeviceType::kCpu before main() (backend.cc).
const OpsBackend& CpuBackend();

// Host memory: 64-byte-aligned heap blocks (device is ignored).
void* HostAllocate(Device device, size_t bytes);
void HostDeallocate(Device device, void* p, size_t bytes);

// Copies the lower triangle of the n×n matrix at c (row stride ldc) onto the upper one
// (gemm.cc; the symmetric products and the Cholesky factorizations use it).
void MirrorLowerToUpper(float* c, int64_t n, int64_t ldc);

absl::Status Gemm(const Context& ctx, const GemmParams& params, ConstTensorView a,
                  ConstTensorView b, TensorView c);
absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c);
absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c);
absl::Status ThinQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r);
absl::Status CholeskyQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r);
absl::Status RandomizedCholeskyQr(const Context& ctx, ConstTensorView a, ConstTensorView sketch,
                                  TensorView q);
absl::Status FrobeniusNorm(const Context& ctx, ConstTensorView a, TensorView out);
absl::Status AxisNorms(const Context& ctx, ConstTensorView a, Axis axis, NormType type,
                       TensorView out);
absl::Status TopKByL1Norm(const Context& ctx, ConstTensorView a, Axis axis, int64_t k,
                          absl::Span<int64_t> indices, TensorView scores_out);
absl::Status IsAllZero(const Context& ctx, ConstTensorView a, bool* all_zero);
absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out);
absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst);
absl::Status Copy(const Context& ctx, ConstTensorView src, TensorView dst);
absl::Status Fill(const Context& ctx, float value, TensorView dst);
absl::Status Axpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                   ConstTensorView y, TensorView out);
absl::Status AddScalar(const Context& ctx, float alpha, ConstTensorView x, float beta,
                       TensorView out);
absl::Status Unary(const Context& ctx, UnaryOp op, ConstTensorView x, TensorView out);
absl::Status Binary(const Context& ctx, BinaryOp op, ConstTensorView x, ConstTensorView y,
                    TensorView out);
absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v);
// steps (session_ops.cc)
absl::Status AllFinite(const Context& ctx, ConstTensorView x, bool* all_finite);
absl::Status WidenScaleCheckFinite(const Context& ctx, ConstTensorView x, float scale,
                                   TensorView out, bool* all_finite);
absl::Status Fnv1aChecksum(const Context& ctx, ConstTensorView x, uint64_t* checksum);
absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m);

// kops: fused optimizer phases (fused.cc).
absl::Status AdamWStepTracked(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                              TensorView x, TensorView m, TensorView v, TensorView update_sq);
absl::Status LionStepTracked(const Context& ctx, const LionParams& p, ConstTensorView grad,
                             TensorView x, TensorView m, TensorView update_sq);
absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u);
absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x);
absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v);
absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq);
absl::Status DecayScatterWithChange(const Context& ctx, float decay, ConstTensorView src, Axis axis,
                                    absl::Span<const int64_t> indices, float alpha, TensorView x,
                                    TensorView update_sq);

// ortho (ortho_ops.cc)
absl::Status AddToDiagonal(const Context& ctx, float value, TensorView a);
absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out);

}  // namespace diond::kernels::cpu

#endif  // DIOND_KERNELS_CPU_BACKEND_H_
