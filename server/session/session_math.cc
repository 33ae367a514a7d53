// The conversions between a trainer's dtype and fp32 outside a Step (registration, SetState,
// restore, hand-over between trainers), through the ops API (kernels::Copy on the session's host
// context, Arenas::HostContext), the views a Step's ops take and the synchronous fp32 copies of
// the world phases (session_internal.h). A Step's own passes are ops of kernels/ops.h.
#include <cassert>
#include <cstring>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/session/session_internal.h"

namespace diond::session::internal {

// kernels::Copy widens and narrows exactly as the Step's own passes do (RNE when narrowing),
// vectorized and split over the context's threads; it cannot fail on these views (contiguous,
// equal element counts, host memory on a CPU context), so a failure is a bug (asserted).
void WidenToF32(const kernels::Context& ctx, DType dtype, const uint8_t* src, int64_t n,
                float* out) {
  if (n == 0) return;
  const absl::Status s = kernels::Copy(ctx, HostView(dtype, src, n), HostView(DType::kF32, out, n));
  assert(s.ok());
  (void)s;
}

void NarrowFromF32(const kernels::Context& ctx, DType dtype, const float* in, int64_t n,
                   uint8_t* dst) {
  if (n == 0) return;
  const absl::Status s = kernels::Copy(ctx, HostView(DType::kF32, in, n), HostView(dtype, dst, n));
  assert(s.ok());
  (void)s;
}

kernels::ConstTensorView HostView(DType dtype, const void* p, int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(dtype, {n}));
}

kernels::TensorView HostView(DType dtype, void* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(dtype, {n}));
}

kernels::TensorView StepView(const kernels::Context& ctx, float* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(DType::kF32, {n}), ctx.device());
}

kernels::ConstTensorView StepView(const kernels::Context& ctx, const float* p, int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(DType::kF32, {n}), ctx.device());
}

absl::Status CopyF32(const float* src, float* dst, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  return absl::OkStatus();
}

absl::Status CopyF32ToHost(const kernels::Context& dctx, const float* tensor, float* host,
                           int64_t n) {
  if (n <= 0) return absl::OkStatus();
  return kernels::CopyBytesToHost(dctx, tensor, host, static_cast<size_t>(n) * 4);
}

absl::Status CopyF32ToDevice(const kernels::Context& dctx, const float* host, float* tensor,
                             int64_t n) {
  if (n <= 0) return absl::OkStatus();
  return kernels::CopyBytesFromHost(dctx, host, tensor, static_cast<size_t>(n) * 4);
}

}  // namespace diond::session::internal
