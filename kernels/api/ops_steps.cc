// The dispatcher of kernels/ops.h, continued (ops.cc has the linear algebra, reductions,
// gather/scatter and elementwise ops): the ops of an optimizer step (the fused update phases, the
// finiteness scans and checksums), host <-> device copies and device-side scalars. Argument checks
// only; no arithmetic.
#include <utility>

#include "common/status_macros.h"
#include "kernels/api/validate.h"
#include "kernels/backend.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

constexpr const char* kSetByGraph =
    "scalars_on_device is set by kernels/graph.h only (leave it null)";

absl::Status CheckAdamWArgs(const Context& ctx, const char* kOp, const AdamWParams& p,
                            ConstTensorView grad, TensorView x, TensorView m, TensorView v) {
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "grad", grad, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m", m, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "v", v, x));
  for (auto [name, val] : {std::pair<const char*, float>{"lr", p.lr},
                           {"beta1", p.beta1},
                           {"beta2", p.beta2},
                           {"epsilon", p.epsilon},
                           {"weight_decay", p.weight_decay}}) {
    DIOND_RETURN_IF_ERROR(CheckFinite(kOp, name, val));
  }
  if (p.scalars_on_device != nullptr) return Invalid(kOp, kSetByGraph);
  if (p.step < 1) return Invalid(kOp, "step is ", p.step, ", want >= 1");
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f)) {
    return Invalid(kOp, "betas (", p.beta1, ", ", p.beta2, ") must lie in [0, 1)");
  }
  return absl::OkStatus();
}

absl::Status CheckLionArgs(const Context& ctx, const char* kOp, const LionParams& p,
                           ConstTensorView grad, TensorView x, TensorView m) {
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "grad", grad, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m", m, x));
  for (auto [name, val] : {std::pair<const char*, float>{"lr", p.lr},
                           {"beta1", p.beta1},
                           {"beta2", p.beta2},
                           {"weight_decay", p.weight_decay}}) {
    DIOND_RETURN_IF_ERROR(CheckFinite(kOp, name, val));
  }
  if (p.scalars_on_device != nullptr) return Invalid(kOp, kSetByGraph);
  return absl::OkStatus();
}

// Whether f32 buffers of na and nb elements at a and b share a byte.
bool Overlap(const void* a, int64_t na, const void* b, int64_t nb) {
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  return na > 0 && nb > 0 && pa < pb + nb * 4 && pb < pa + na * 4;
}

// One f32 element, contiguous, not overlapping `x` (the tracked steps' update_sq).
absl::Status CheckScalarOut(const Context& ctx, const char* kOp, TensorView out,
                            ConstTensorView x) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "update_sq", out));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "update_sq", out.layout(), DType::kF32));
  if (out.NumElements() != 1) {
    return Invalid(kOp, "update_sq is ", out.DebugString(), ", want one element");
  }
  if (Overlap(out.data(), 1, x.data(), x.NumElements())) {
    return Invalid(kOp, "update_sq overlaps x");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v) {
  DIOND_RETURN_IF_ERROR(CheckAdamWArgs(ctx, "AdamWStep", p, grad, x, m, v));
  return ctx.backend().adamw_step(ctx, p, grad, x, m, v);
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  DIOND_RETURN_IF_ERROR(CheckLionArgs(ctx, "LionStep", p, grad, x, m));
  return ctx.backend().lion_step(ctx, p, grad, x, m);
}

// ================================ ortho ================================================
absl::Status AddToDiagonal(const Context& ctx, float value, TensorView a) {
  constexpr const char* kOp = "AddToDiagonal";
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, kOp, "a", a));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "a", a.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "value", value));
  if (a.Rows() != a.Cols()) return Invalid(kOp, "a is ", a.DebugString(), ", want square matrices");
  return ctx.backend().add_to_diagonal(ctx, value, a);
}

absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out) {
  constexpr const char* kOp = "Bf16RoundedAxpby";
  // All f32 or all bf16: out's dtype decides, and y and x must match it.
  const DType dt = out.dtype() == DType::kBf16 ? DType::kBf16 : DType::kF32;
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "out", out, out, /*any_dtype=*/true));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "out", out.layout(), dt));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "y", y, out, /*any_dtype=*/true));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "y", y.layout(), dt));
  if (alpha != 0.0f) {
    DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, out, /*any_dtype=*/true));
    DIOND_RETURN_IF_ERROR(CheckDType(kOp, "x", x.layout(), dt));
  }
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "beta", beta));
  return ctx.backend().bf16_rounded_axpby(ctx, alpha, x, beta, y, out);
}
// ================================ end ortho ===================================================

// ================================ kops: fused optimizer phases ================================

absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v, TensorView update_sq) {
  DIOND_RETURN_IF_ERROR(CheckAdamWArgs(ctx, "AdamWStep", p, grad, x, m, v));
  DIOND_RETURN_IF_ERROR(CheckScalarOut(ctx, "AdamWStep", update_sq, x));
  return ctx.backend().adamw_step_tracked(ctx, p, grad, x, m, v, update_sq);
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m, TensorView update_sq) {
  DIOND_RETURN_IF_ERROR(CheckLionArgs(ctx, "LionStep", p, grad, x, m));
  DIOND_RETURN_IF_ERROR(CheckScalarOut(ctx, "LionStep", update_sq, x));
  return ctx.backend().lion_step_tracked(ctx, p, grad, x, m, update_sq);
}

absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u) {
  constexpr const char* kOp = "MomentumUpdate";
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m", m, m));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "m_in", m_in, m));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "grad", grad, m));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "u", u, m));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "mu", mu));
  const int64_t n = m.NumElements();
  if (Overlap(u.data(), n, m.data(), n) || Overlap(u.data(), n, grad.data(), n) ||
      Overlap(u.data(), n, m_in.data(), n)) {
    return Invalid(kOp, "u overlaps m, m_in or grad");
  }
  if (m_in.data() != m.data() && Overlap(m_in.data(), n, m.data(), n)) {
    return Invalid(kOp, "m_in partly overlaps m (pass m itself to update in place)");
  }
  return ctx.backend().momentum_update(ctx, mu, nesterov, grad, m_in, m, u);
}

absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x) {
  constexpr const char* kOp = "ApplyUpdate";
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x", x, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "x_in", x_in, x));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "update", update, x));
  const int64_t n = x.NumElements();
  if (x_in.data() != x.data() && Overlap(x_in.data(), n, x.data(), n)) {
    return Invalid(kOp, "x_in partly overlaps x (pass x itself to update in place)");
  }
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", p.alpha));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "lr_wd", p.lr_wd));
  if (p.scalars_on_device != nullptr) return Invalid(kOp, kSetByGraph);
  return ctx.backend().apply_update(ctx, p, update, x_in, x);
}

absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v) {
  constexpr const char* kOp = "NormalizeNeurons";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "o", o));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "o", o.layout(), DType::kF32));
  if (o.rank() != 2 && o.rank() != 3) {
    return Invalid(kOp, "o is ", o.DebugString(), ", want rank 2 or 3");
  }
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "v", v));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "v", v.layout(), DType::kF32));
  const int64_t units = o.rank() == 3 ? o.dim(0) : 1;
  const int64_t rows = o.dim(o.rank() - 2);
  if (v.NumElements() != units * rows) {
    return Invalid(kOp, "v is ", v.DebugString(), ", want ", units * rows,
                   " elements (one per row of o ", o.DebugString(), ")");
  }
  if (Overlap(v.data(), v.NumElements(), o.data(), o.NumElements())) {
    return Invalid(kOp, "v overlaps o");
  }
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "w", w));
  return ctx.backend().normalize_neurons(ctx, w, o, v);
}

absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq) {
  constexpr const char* kOp = "CopyWithChange";
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "dst", dst, dst));
  DIOND_RETURN_IF_ERROR(CheckF32Like(ctx, kOp, "src", src, dst));
  if (Overlap(src.data(), src.NumElements(), dst.data(), dst.NumElements())) {
    return Invalid(kOp, "src overlaps dst");
  }
  DIOND_RETURN_IF_ERROR(CheckScalarOut(ctx, kOp, update_sq, dst));
  if (Overlap(update_sq.data(), 1, src.data(), src.NumElements())) {
    return Invalid(kOp, "update_sq overlaps src");
  }
  return ctx.backend().copy_with_change(ctx, src, dst, update_sq);
}

absl::Status DecayScatterWithChange(const Context& ctx, float decay, ConstTensorView src, Axis axis,
                                    absl::Span<const int64_t> indices, float alpha, TensorView x,
                                    TensorView update_sq) {
  constexpr const char* kOp = "DecayScatterWithChange";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "x", x.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "src", src));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "src", src.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckAxis(kOp, axis));
  if (x.rank() != 2 && x.rank() != 3) {
    return Invalid(kOp, "x is ", x.DebugString(), ", want rank 2 or 3");
  }
  const int64_t batch = x.rank() == 3 ? x.dim(0) : 1;
  const int64_t rows = x.dim(x.rank() - 2), cols = x.dim(x.rank() - 1);
  const int64_t count = static_cast<int64_t>(indices.size());
  if (batch == 0 || count % batch != 0) {
    return Invalid(kOp, count, " indices for ", batch, " matrices: want k per matrix");
  }
  const int64_t k = count / batch;
  const int64_t limit = axis == Axis::kRows ? rows : cols;
  const int64_t want_r = axis == Axis::kRows ? k : rows;
  const int64_t want_c = axis == Axis::kRows ? cols : k;
  if (src.rank() != x.rank() || src.dim(src.rank() - 2) != want_r ||
      src.dim(src.rank() - 1) != want_c || (x.rank() == 3 && src.dim(0) != batch)) {
    return Invalid(kOp, "src is ", src.DebugString(), ", want ", want_r, "x", want_c,
                   " matrices, batch ", batch, " (x ", x.DebugString(), ", ", k,
                   " indices per matrix)");
  }
  std::vector<int64_t> sorted(indices.begin(), indices.end());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = b * k; j < (b + 1) * k; ++j) {
      if (indices[j] < 0 || indices[j] >= limit) {
        return Invalid(kOp, "indices[", j, "] = ", indices[j], " is outside [0, ", limit, ")");
      }
    }
    auto first = sorted.begin() + b * k, last = first + k;
    std::sort(first, last);
    auto dup = std::adjacent_find(first, last);
    if (dup != last) return Invalid(kOp, "index ", *dup, " appears more than once in matrix ", b);
  }
  if (Overlap(src.data(), src.NumElements(), x.data(), x.NumElements())) {
    return Invalid(kOp, "src overlaps x");
  }
  DIOND_RETURN_IF_ERROR(CheckScalarOut(ctx, kOp, update_sq, x));
  if (Overlap(update_sq.data(), 1, src.data(), src.NumElements())) {
    return Invalid(kOp, "update_sq overlaps src");
  }
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "decay", decay));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "alpha", alpha));
  return ctx.backend().decay_scatter_with_change(ctx, decay, src, axis, indices, alpha, x,
                                                 update_sq);
}

// ================================ steps ======================================================

absl::Status AllFinite(const Context& ctx, ConstTensorView x, bool* all_finite) {
  constexpr const char* kOp = "AllFinite";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  if (all_finite == nullptr) return Invalid(kOp, "all_finite is null");
  return ctx.backend().all_finite(ctx, x, all_finite);
}

absl::Status WidenScaleCheckFinite(const Context& ctx, ConstTensorView x, float scale,
                                   TensorView out, bool* all_finite) {
  constexpr const char* kOp = "WidenScaleCheckFinite";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  DIOND_RETURN_IF_ERROR(CheckF32Out(ctx, kOp, out, x.NumElements()));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "scale", scale));
  if (all_finite == nullptr) return Invalid(kOp, "all_finite is null");
  if (x.data() == out.data() && x.dtype() != DType::kF32) {
    return Invalid(kOp, "out aliases a ", x.DebugString(), " x (only an f32 x may be aliased)");
  }
  return ctx.backend().widen_scale_check_finite(ctx, x, scale, out, all_finite);
}

absl::Status Fnv1aChecksum(const Context& ctx, ConstTensorView x, uint64_t* checksum) {
  constexpr const char* kOp = "Fnv1aChecksum";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  DIOND_RETURN_IF_ERROR(CheckDType(kOp, "x", x.layout(), DType::kF32));
  if (checksum == nullptr) return Invalid(kOp, "checksum is null");
  return ctx.backend().fnv1a_checksum(ctx, x, checksum);
}

// ================================ devrules: host <-> device copies ============================

namespace {
// The two sides of an explicit copy: `dev` on the context's device, `host` a CPU view, both
// contiguous, same shape and dtype.
absl::Status CheckHostDeviceCopy(const Context& ctx, const char* op, const char* host_name,
                                 ConstTensorView host, const char* dev_name, ConstTensorView dev) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, dev_name, dev));
  if (host.device().type != DeviceType::kCpu) {
    return Invalid(op, host_name, " is on device ", static_cast<int>(host.device().type), ":",
                   host.device().index, ", want a CPU (host memory) view");
  }
  if (host.rank() < 0 || host.rank() > kMaxRank) {
    return Invalid(op, host_name, " has rank ", host.rank(), ", want 0..", kMaxRank);
  }
  for (int i = 0; i < host.rank(); ++i) {
    if (host.dim(i) < 0) return Invalid(op, host_name, " has a negative dim: ", host.DebugString());
  }
  if (!host.IsContiguous()) {
    return Invalid(op, host_name, " ", host.DebugString(), " is not contiguous");
  }
  if (host.data() == nullptr && host.NumElements() > 0) {
    return Invalid(op, host_name, " ", host.DebugString(), " has a null data pointer");
  }
  if (!SameShape(host.layout(), dev.layout()) || host.dtype() != dev.dtype()) {
    return Invalid(op, dev_name, " is ", dev.DebugString(), ", want the shape and dtype of ",
                   host_name, " ", host.DebugString());
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CopyFromHost(const Context& ctx, ConstTensorView host_src, TensorView dst) {
  DIOND_RETURN_IF_ERROR(CheckHostDeviceCopy(ctx, "CopyFromHost", "host_src", host_src, "dst", dst));
  const size_t bytes = static_cast<size_t>(dst.NumElements()) * DTypeSize(dst.dtype());
  if (bytes == 0) return absl::OkStatus();
  return ctx.backend().copy_from_host(ctx, host_src.data(), dst.data(), bytes);
}

absl::Status CopyToHost(const Context& ctx, ConstTensorView src, TensorView host_dst) {
  DIOND_RETURN_IF_ERROR(CheckHostDeviceCopy(ctx, "CopyToHost", "host_dst", host_dst, "src", src));
  const size_t bytes = static_cast<size_t>(src.NumElements()) * DTypeSize(src.dtype());
  if (bytes == 0) return absl::OkStatus();
  return ctx.backend().copy_to_host(ctx, src.data(), host_dst.data(), bytes);
}
// ================================ end devrules ================================================

// ================================ asynccopy ===================================================

absl::Status CopyFromHostAsync(const Context& ctx, ConstTensorView host_src, TensorView dst) {
  DIOND_RETURN_IF_ERROR(
      CheckHostDeviceCopy(ctx, "CopyFromHostAsync", "host_src", host_src, "dst", dst));
  const size_t bytes = static_cast<size_t>(dst.NumElements()) * DTypeSize(dst.dtype());
  if (bytes == 0) return absl::OkStatus();
  return ctx.backend().copy_from_host_async(ctx, host_src.data(), dst.data(), bytes);
}

absl::Status CopyToHostAsync(const Context& ctx, ConstTensorView src, TensorView host_dst) {
  DIOND_RETURN_IF_ERROR(
      CheckHostDeviceCopy(ctx, "CopyToHostAsync", "host_dst", host_dst, "src", src));
  const size_t bytes = static_cast<size_t>(src.NumElements()) * DTypeSize(src.dtype());
  if (bytes == 0) return absl::OkStatus();
  return ctx.backend().copy_to_host_async(ctx, src.data(), host_dst.data(), bytes);
}

absl::Status Synchronize(const Context& ctx) { return ctx.backend().synchronize(ctx); }

namespace {
// The device flag of AllFiniteFlag / WidenScaleCheckFiniteFlag: one f32 element on the context's
// device, contiguous, not overlapping the tensors the op reads or writes.
absl::Status CheckNonFiniteFlag(const Context& ctx, const char* op, TensorView flag,
                                ConstTensorView x, ConstTensorView out) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, "nonfinite", flag));
  DIOND_RETURN_IF_ERROR(CheckDType(op, "nonfinite", flag.layout(), DType::kF32));
  if (flag.NumElements() != 1) {
    return Invalid(op, "nonfinite ", flag.DebugString(), " has ", flag.NumElements(),
                   " elements, want 1");
  }
  auto overlaps = [&](ConstTensorView v) {
    if (v.empty() || v.data() == nullptr) return false;
    const auto* f = static_cast<const uint8_t*>(flag.data());
    const auto* b = static_cast<const uint8_t*>(v.data());
    const size_t bytes = static_cast<size_t>(v.NumElements()) * DTypeSize(v.dtype());
    return f + 4 > b && f < b + bytes;
  };
  if (overlaps(x)) return Invalid(op, "nonfinite overlaps x ", x.DebugString());
  if (overlaps(out)) return Invalid(op, "nonfinite overlaps out ", out.DebugString());
  return absl::OkStatus();
}
}  // namespace

absl::Status AllFiniteFlag(const Context& ctx, ConstTensorView x, TensorView nonfinite) {
  constexpr const char* kOp = "AllFiniteFlag";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  DIOND_RETURN_IF_ERROR(CheckNonFiniteFlag(ctx, kOp, nonfinite, x, {}));
  return ctx.backend().all_finite_flag(ctx, x, nonfinite);
}

absl::Status WidenScaleCheckFiniteFlag(const Context& ctx, ConstTensorView x, float scale,
                                       TensorView out, TensorView nonfinite) {
  constexpr const char* kOp = "WidenScaleCheckFiniteFlag";
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, kOp, "x", x));
  DIOND_RETURN_IF_ERROR(CheckF32Out(ctx, kOp, out, x.NumElements()));
  DIOND_RETURN_IF_ERROR(CheckFinite(kOp, "scale", scale));
  if (x.data() == out.data() && x.dtype() != DType::kF32) {
    return Invalid(kOp, "out aliases a ", x.DebugString(), " x (only an f32 x may be aliased)");
  }
  DIOND_RETURN_IF_ERROR(CheckNonFiniteFlag(ctx, kOp, nonfinite, x, out));
  return ctx.backend().widen_scale_check_finite_flag(ctx, x, scale, out, nonfinite);
}
// ================================ end asynccopy ===============================================

// ================================ graph: device-side scalars ===================================

AdamWScalarRecord ScalarRecordOf(const AdamWParams& p) {
  const math::AdamWScalars s =
      math::MakeAdamWScalars(p.lr, p.beta1, p.beta2, p.epsilon, p.weight_decay, p.step, p.cautious);
  return AdamWScalarRecord{s.decay,     s.lr_wd,    s.one_minus_b1, s.one_minus_b2,    s.beta2,
                           s.step_size, s.sqrt_bc2, s.eps,          s.cautious ? 1 : 0};
}
LionScalarRecord ScalarRecordOf(const LionParams& p) {
  const math::LionScalars s =
      math::MakeLionScalars(p.lr, p.beta1, p.beta2, p.weight_decay, p.cautious);
  return LionScalarRecord{s.w1, s.w2, s.lr_wd, s.decay, s.lr, s.cautious ? 1 : 0};
}
ApplyUpdateScalarRecord ScalarRecordOf(const ApplyUpdateParams& p) {
  const math::ApplyUpdateScalars s =
      math::MakeApplyUpdateScalars(p.alpha, p.lr_wd, p.cautious, p.round_bf16);
  return ApplyUpdateScalarRecord{s.alpha, s.decay, s.lr_wd, s.cautious ? 1 : 0,
                                 s.round_bf16 ? 1 : 0};
}

}  // namespace diond::kernels
