// The OpsBackend adapter of the plugin C ABI (plugin_backend.h).
#include "kernels/plugin/plugin_backend.h"

#include <atomic>
#include <cstddef>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

static_assert(DIOND_DT_F32 == static_cast<int>(DType::kF32) &&
                  DIOND_DT_BF16 == static_cast<int>(DType::kBf16) &&
                  DIOND_DT_F16 == static_cast<int>(DType::kF16),
              "C ABI dtype codes follow kernels::DType");
static_assert(math::kUnarySign == static_cast<int>(UnaryOp::kSign) &&
                  math::kUnaryAbs == static_cast<int>(UnaryOp::kAbs) &&
                  math::kUnarySqrt == static_cast<int>(UnaryOp::kSqrt) &&
                  math::kUnarySquare == static_cast<int>(UnaryOp::kSquare) &&
                  math::kUnaryNeg == static_cast<int>(UnaryOp::kNeg) &&
                  math::kUnaryNanToNum == static_cast<int>(UnaryOp::kNanToNum),
              "unary op codes follow kernels::UnaryOp");
static_assert(math::kBinaryAdd == static_cast<int>(BinaryOp::kAdd) &&
                  math::kBinarySub == static_cast<int>(BinaryOp::kSub) &&
                  math::kBinaryMul == static_cast<int>(BinaryOp::kMul) &&
                  math::kBinaryDiv == static_cast<int>(BinaryOp::kDiv) &&
                  math::kBinaryMax == static_cast<int>(BinaryOp::kMax) &&
                  math::kBinaryMin == static_cast<int>(BinaryOp::kMin),
              "binary op codes follow kernels::BinaryOp");
static_assert(static_cast<int>(Axis::kRows) == 0 && static_cast<int>(Axis::kCols) == 1, "axis");
static_assert(static_cast<int>(NormType::kL1) == 0 && static_cast<int>(NormType::kL2) == 1 &&
                  static_cast<int>(NormType::kSumOfSquares) == 2,
              "norm codes");

// Slot 0: kCuda, slot 1: kTest.
std::atomic<const DiondOpsApiV1*> g_ops[2];

int SlotOf(DeviceType t) { return t == DeviceType::kCuda ? 0 : (t == DeviceType::kTest ? 1 : -1); }

template <int S>
const DiondOpsApiV1& Api() {
  return *g_ops[S].load(std::memory_order_acquire);
}

DiondTensor T(const TensorLayout& l, const void* data) {
  DiondTensor t;
  t.data = const_cast<void*>(data);
  t.dtype = static_cast<int32_t>(l.dtype);
  t.rank = l.rank;
  for (int i = 0; i < 3; ++i) {
    t.dims[i] = l.dims[i];
    t.strides[i] = l.strides[i];
  }
  return t;
}
DiondTensor T(ConstTensorView v) { return T(v.layout(), v.data()); }

// One call's record and error buffer.
struct Call {
  explicit Call(const Context& ctx) : c{ctx.device().index, ctx.stream(), err, sizeof(err)} {}
  Call(int device, void* stream) : c{device, stream, err, sizeof(err)} {}
  absl::Status Done(const char* op, int rc, const char* backend) const {
    if (rc == DIOND_OPS_OK) return absl::OkStatus();
    std::string msg = absl::StrCat(op, " on ", backend, ": ", err[0] ? err : "failed");
    switch (rc) {
      case DIOND_OPS_FAILED_PRECONDITION:
        return absl::FailedPreconditionError(msg);
      case DIOND_OPS_RESOURCE_EXHAUSTED:
        return absl::ResourceExhaustedError(msg);
      default:
        return absl::InternalError(msg);
    }
  }
  char err[512] = {0};
  DiondOpsCall c;
};

#define DIOND_DONE(op, rc) call.Done(op, rc, Api<S>().name)

thread_local std::string t_last_allocation_error;

template <int S>
void* Allocate(Device device, size_t bytes) {
  Call call(device.index, nullptr);
  void* p = nullptr;
  if (Api<S>().allocate(&call.c, bytes, &p) == DIOND_OPS_OK) return p;
  t_last_allocation_error = call.err;
  return nullptr;
}
template <int S>
void Deallocate(Device device, void* p, size_t bytes) {
  Api<S>().deallocate(device.index, nullptr, p, bytes);
}
template <int S>
absl::Status CopyFromHost(const Context& ctx, const void* host, void* dst, size_t bytes) {
  Call call(ctx);
  return DIOND_DONE("copy_from_host", Api<S>().copy_from_host(&call.c, host, dst, bytes));
}
template <int S>
absl::Status CopyToHost(const Context& ctx, const void* src, void* host, size_t bytes) {
  Call call(ctx);
  return DIOND_DONE("copy_to_host", Api<S>().copy_to_host(&call.c, src, host, bytes));
}
template <int S>
absl::Status Gemm(const Context& ctx, const GemmParams& p, ConstTensorView a, ConstTensorView b,
                  TensorView c) {
  Call call(ctx);
  const DiondGemmArgs g{p.trans_a == Trans::kYes ? 1 : 0, p.trans_b == Trans::kYes ? 1 : 0,
                        p.alpha, p.beta};
  const DiondTensor ta = T(a), tb = T(b), tc = T(c);
  return DIOND_DONE("Gemm", Api<S>().gemm(&call.c, &g, &ta, &tb, &tc));
}
template <int S>
absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c) {
  Call call(ctx);
  const DiondTensor ta = T(a), tc = T(c);
  return DIOND_DONE("SymmetricProduct",
                    Api<S>().symmetric_product(&call.c, side == GramSide::kAAt ? 1 : 0, alpha,
                                               &ta, beta, &tc));
}
template <int S>
absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c) {
  Call call(ctx);
  const DiondTensor ta = T(a), tc = T(c);
  return DIOND_DONE("SymmetricProductBf16",
                    Api<S>().symmetric_product_bf16(&call.c, &ta, block, &tc));
}
template <int S>
absl::Status ThinQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  Call call(ctx);
  const DiondTensor ta = T(a), tq = T(q), tr = T(r);
  return DIOND_DONE("ThinQr", Api<S>().thin_qr(&call.c, &ta, &tq, &tr));
}
template <int S>
absl::Status CholeskyQr(const Context& ctx, ConstTensorView a, TensorView q, TensorView r) {
  Call call(ctx);
  const DiondTensor ta = T(a), tq = T(q), tr = T(r);
  return DIOND_DONE("CholeskyQr", Api<S>().cholesky_qr(&call.c, &ta, &tq, &tr));
}
template <int S>
absl::Status RandomizedCholeskyQr(const Context& ctx, ConstTensorView a, ConstTensorView sketch,
                                  TensorView q) {
  Call call(ctx);
  const DiondTensor ta = T(a), ts = T(sketch), tq = T(q);
  return DIOND_DONE("RandomizedCholeskyQr",
                    Api<S>().randomized_cholesky_qr(&call.c, &ta, &ts, &tq));
}
template <int S>
absl::Status FrobeniusNorm(const Context& ctx, ConstTensorView a, TensorView out) {
  Call call(ctx);
  const DiondTensor ta = T(a), to = T(out);
  return DIOND_DONE("FrobeniusNorm", Api<S>().frobenius_norm(&call.c, &ta, &to));
}
template <int S>
absl::Status AxisNorms(const Context& ctx, ConstTensorView a, Axis axis, NormType type,
                       TensorView out) {
  Call call(ctx);
  const DiondTensor ta = T(a), to = T(out);
  return DIOND_DONE("AxisNorms",
                    Api<S>().axis_norms(&call.c, &ta, static_cast<int32_t>(axis),
                                        static_cast<int32_t>(type), &to));
}
template <int S>
absl::Status TopKByL1Norm(const Context& ctx, ConstTensorView a, Axis axis, int64_t k,
                          absl::Span<int64_t> indices, TensorView scores_out) {
  Call call(ctx);
  const DiondTensor ta = T(a), ts = T(scores_out);
  return DIOND_DONE("TopKByL1Norm",
                    Api<S>().top_k_by_l1_norm(&call.c, &ta, static_cast<int32_t>(axis), k,
                                              indices.data(), &ts));
}
template <int S>
absl::Status IsAllZero(const Context& ctx, ConstTensorView a, bool* all_zero) {
  Call call(ctx);
  const DiondTensor ta = T(a);
  int32_t z = 0;
  const int rc = Api<S>().is_all_zero(&call.c, &ta, &z);
  if (rc == DIOND_OPS_OK) *all_zero = z != 0;
  return DIOND_DONE("IsAllZero", rc);
}
template <int S>
absl::Status Gather(const Context& ctx, ConstTensorView a, Axis axis,
                    absl::Span<const int64_t> indices, TensorView out) {
  Call call(ctx);
  const DiondTensor ta = T(a), to = T(out);
  return DIOND_DONE("Gather", Api<S>().gather(&call.c, &ta, static_cast<int32_t>(axis),
                                              indices.data(),
                                              static_cast<int64_t>(indices.size()), &to));
}
template <int S>
absl::Status Scatter(const Context& ctx, ConstTensorView src, Axis axis,
                     absl::Span<const int64_t> indices, float alpha, float beta, TensorView dst) {
  Call call(ctx);
  const DiondTensor ts = T(src), td = T(dst);
  return DIOND_DONE("Scatter", Api<S>().scatter(&call.c, &ts, static_cast<int32_t>(axis),
                                                indices.data(),
                                                static_cast<int64_t>(indices.size()), alpha, beta,
                                                &td));
}
template <int S>
absl::Status Copy(const Context& ctx, ConstTensorView src, TensorView dst) {
  Call call(ctx);
  const DiondTensor ts = T(src), td = T(dst);
  return DIOND_DONE("Copy", Api<S>().copy(&call.c, &ts, &td));
}
template <int S>
absl::Status Fill(const Context& ctx, float value, TensorView dst) {
  Call call(ctx);
  const DiondTensor td = T(dst);
  return DIOND_DONE("Fill", Api<S>().fill(&call.c, value, &td));
}
template <int S>
absl::Status Axpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                   ConstTensorView y, TensorView out) {
  Call call(ctx);
  const DiondTensor tx = T(x), ty = T(y), to = T(out);
  return DIOND_DONE("Axpby", Api<S>().axpby(&call.c, alpha, &tx, beta, &ty, &to));
}
template <int S>
absl::Status AddScalar(const Context& ctx, float alpha, ConstTensorView x, float beta,
                       TensorView out) {
  Call call(ctx);
  const DiondTensor tx = T(x), to = T(out);
  return DIOND_DONE("AddScalar", Api<S>().add_scalar(&call.c, alpha, &tx, beta, &to));
}
template <int S>
absl::Status Unary(const Context& ctx, UnaryOp op, ConstTensorView x, TensorView out) {
  Call call(ctx);
  const DiondTensor tx = T(x), to = T(out);
  return DIOND_DONE("Unary", Api<S>().unary(&call.c, static_cast<int32_t>(op), &tx, &to));
}
template <int S>
absl::Status Binary(const Context& ctx, BinaryOp op, ConstTensorView x, ConstTensorView y,
                    TensorView out) {
  Call call(ctx);
  const DiondTensor tx = T(x), ty = T(y), to = T(out);
  return DIOND_DONE("Binary",
                    Api<S>().binary(&call.c, static_cast<int32_t>(op), &tx, &ty, &to));
}
// graph: the device-side records of ops.h are the plugin's records, field for field.
static_assert(sizeof(AdamWScalarRecord) == sizeof(DiondAdamWScalars) &&
              offsetof(AdamWScalarRecord, eps) == offsetof(DiondAdamWScalars, eps) &&
              offsetof(AdamWScalarRecord, cautious) == offsetof(DiondAdamWScalars, cautious));
static_assert(sizeof(LionScalarRecord) == sizeof(DiondLionScalars) &&
              offsetof(LionScalarRecord, lr) == offsetof(DiondLionScalars, lr) &&
              offsetof(LionScalarRecord, cautious) == offsetof(DiondLionScalars, cautious));
static_assert(sizeof(ApplyUpdateScalarRecord) == sizeof(DiondApplyUpdateScalars) &&
              offsetof(ApplyUpdateScalarRecord, lr_wd) == offsetof(DiondApplyUpdateScalars, lr_wd) &&
              offsetof(ApplyUpdateScalarRecord, round_bf16) ==
                  offsetof(DiondApplyUpdateScalars, round_bf16));
const DiondAdamWScalars* Dev(const AdamWParams& p) {
  return reinterpret_cast<const DiondAdamWScalars*>(p.scalars_on_device);
}
const DiondLionScalars* Dev(const LionParams& p) {
  return reinterpret_cast<const DiondLionScalars*>(p.scalars_on_device);
}
const DiondApplyUpdateScalars* Dev(const ApplyUpdateParams& p) {
  return reinterpret_cast<const DiondApplyUpdateScalars*>(p.scalars_on_device);
}

// By value: the same records as ops.h forms for a graph (one formation, checked equal above).
template <typename D, typename P>
D RecordOf(const P& p) {
  const auto r = ScalarRecordOf(p);
  static_assert(sizeof(r) == sizeof(D));
  D d;
  std::memcpy(&d, &r, sizeof(d));
  return d;
}
DiondAdamWScalars AdamWScalarsOf(const AdamWParams& p) { return RecordOf<DiondAdamWScalars>(p); }
DiondLionScalars LionScalarsOf(const LionParams& p) { return RecordOf<DiondLionScalars>(p); }
template <int S>
absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                       TensorView x, TensorView m, TensorView v) {
  Call call(ctx);
  const DiondTensor tg = T(grad), tx = T(x), tm = T(m), tv = T(v);
  if (p.scalars_on_device != nullptr) {
    return DIOND_DONE("AdamWStep", Api<S>().adamw_step_dev(&call.c, Dev(p), &tg, &tx, &tm, &tv));
  }
  const DiondAdamWScalars c = AdamWScalarsOf(p);
  return DIOND_DONE("AdamWStep", Api<S>().adamw_step(&call.c, &c, &tg, &tx, &tm, &tv));
}
template <int S>
absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  Call call(ctx);
  const DiondTensor tg = T(grad), tx = T(x), tm = T(m);
  if (p.scalars_on_device != nullptr) {
    return DIOND_DONE("LionStep", Api<S>().lion_step_dev(&call.c, Dev(p), &tg, &tx, &tm));
  }
  const DiondLionScalars c = LionScalarsOf(p);
  return DIOND_DONE("LionStep", Api<S>().lion_step(&call.c, &c, &tg, &tx, &tm));
}

template <int S>
absl::Status AddToDiagonal(const Context& ctx, float value, TensorView a) {
  Call call(ctx);
  const DiondTensor ta = T(a);
  return DIOND_DONE("AddToDiagonal", Api<S>().add_to_diagonal(&call.c, value, &ta));
}
template <int S>
absl::Status Bf16RoundedAxpby(const Context& ctx, float alpha, ConstTensorView x, float beta,
                              ConstTensorView y, TensorView out) {
  Call call(ctx);
  const DiondTensor tx = T(x), ty = T(y), to = T(out);
  return DIOND_DONE("Bf16RoundedAxpby",
                    Api<S>().bf16_rounded_axpby(&call.c, alpha, &tx, beta, &ty, &to));
}

// ---- kops: fused optimizer phases ----
template <int S>
absl::Status AdamWStepTracked(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                              TensorView x, TensorView m, TensorView v, TensorView update_sq) {
  Call call(ctx);
  const DiondTensor tg = T(grad), tx = T(x), tm = T(m), tv = T(v), tq = T(update_sq);
  if (p.scalars_on_device != nullptr) {
    return DIOND_DONE("AdamWStep (tracked)", Api<S>().adamw_step_tracked_dev(
                                                 &call.c, Dev(p), &tg, &tx, &tm, &tv, &tq));
  }
  const DiondAdamWScalars c = AdamWScalarsOf(p);
  return DIOND_DONE("AdamWStep (tracked)",
                    Api<S>().adamw_step_tracked(&call.c, &c, &tg, &tx, &tm, &tv, &tq));
}
template <int S>
absl::Status LionStepTracked(const Context& ctx, const LionParams& p, ConstTensorView grad,
                             TensorView x, TensorView m, TensorView update_sq) {
  Call call(ctx);
  const DiondTensor tg = T(grad), tx = T(x), tm = T(m), tq = T(update_sq);
  if (p.scalars_on_device != nullptr) {
    return DIOND_DONE("LionStep (tracked)", Api<S>().lion_step_tracked_dev(
                                                &call.c, Dev(p), &tg, &tx, &tm, &tq));
  }
  const DiondLionScalars c = LionScalarsOf(p);
  return DIOND_DONE("LionStep (tracked)",
                    Api<S>().lion_step_tracked(&call.c, &c, &tg, &tx, &tm, &tq));
}
template <int S>
absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u) {
  Call call(ctx);
  const DiondTensor tg = T(grad), ti = T(m_in), tm = T(m), tu = T(u);
  return DIOND_DONE("MomentumUpdate", Api<S>().momentum_update(&call.c, mu, nesterov ? 1 : 0,
                                                               &tg, &ti, &tm, &tu));
}
template <int S>
absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x) {
  Call call(ctx);
  if (p.scalars_on_device != nullptr) {
    const DiondTensor tu = T(update), ti = T(x_in), tx = T(x);
    return DIOND_DONE("ApplyUpdate",
                      Api<S>().apply_update_dev(&call.c, Dev(p), &tu, &ti, &tx));
  }
  const DiondApplyUpdateScalars c = RecordOf<DiondApplyUpdateScalars>(p);
  const DiondTensor tu = T(update), ti = T(x_in), tx = T(x);
  return DIOND_DONE("ApplyUpdate", Api<S>().apply_update(&call.c, &c, &tu, &ti, &tx));
}
template <int S>
absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v) {
  Call call(ctx);
  const DiondTensor to = T(o), tv = T(v);
  return DIOND_DONE("NormalizeNeurons", Api<S>().normalize_neurons(&call.c, w, &to, &tv));
}
template <int S>
absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq) {
  Call call(ctx);
  const DiondTensor ts = T(src), td = T(dst), tq = T(update_sq);
  return DIOND_DONE("CopyWithChange", Api<S>().copy_with_change(&call.c, &ts, &td, &tq));
}
template <int S>
absl::Status AllFinite(const Context& ctx, ConstTensorView x, bool* all_finite) {
  Call call(ctx);
  const DiondTensor tx = T(x);
  int32_t f = 0;
  absl::Status s = DIOND_DONE("AllFinite", Api<S>().all_finite(&call.c, &tx, &f));
  if (s.ok()) *all_finite = f != 0;
  return s;
}
template <int S>
absl::Status WidenScaleCheckFinite(const Context& ctx, ConstTensorView x, float scale,
                                   TensorView out, bool* all_finite) {
  Call call(ctx);
  const DiondTensor tx = T(x), to = T(out);
  int32_t f = 0;
  absl::Status s = DIOND_DONE("WidenScaleCheckFinite",
                              Api<S>().widen_scale_check_finite(&call.c, &tx, scale, &to, &f));
  if (s.ok()) *all_finite = f != 0;
  return s;
}
template <int S>
absl::Status Fnv1aChecksum(const Context& ctx, ConstTensorView x, uint64_t* checksum) {
  Call call(ctx);
  const DiondTensor tx = T(x);
  return DIOND_DONE("Fnv1aChecksum", Api<S>().fnv1a_checksum(&call.c, &tx, checksum));
}

// ---- asynccopy ----
template <int S>
absl::Status CopyFromHostAsync(const Context& ctx, const void* host, void* dst, size_t bytes) {
  Call call(ctx);
  return DIOND_DONE("copy_from_host_async",
                    Api<S>().copy_from_host_async(&call.c, host, dst, bytes));
}
template <int S>
absl::Status CopyToHostAsync(const Context& ctx, const void* src, void* host, size_t bytes) {
  Call call(ctx);
  return DIOND_DONE("copy_to_host_async", Api<S>().copy_to_host_async(&call.c, src, host, bytes));
}
template <int S>
absl::Status Synchronize(const Context& ctx) {
  Call call(ctx);
  return DIOND_DONE("stream_synchronize", Api<S>().stream_synchronize(&call.c));
}
template <int S>
absl::Status AllFiniteFlag(const Context& ctx, ConstTensorView x, TensorView nonfinite) {
  Call call(ctx);
  const DiondTensor tx = T(x), tf = T(nonfinite);
  return DIOND_DONE("AllFiniteFlag", Api<S>().all_finite_flag(&call.c, &tx, &tf));
}
template <int S>
absl::Status WidenScaleCheckFiniteFlag(const Context& ctx, ConstTensorView x, float scale,
                                       TensorView out, TensorView nonfinite) {
  Call call(ctx);
  const DiondTensor tx = T(x), to = T(out), tf = T(nonfinite);
  return DIOND_DONE("WidenScaleCheckFiniteFlag",
                    Api<S>().widen_scale_check_finite_flag(&call.c, &tx, scale, &to, &tf));
}
template <int S>
absl::Status DecayScatterWithChange(const Context& ctx, float decay, ConstTensorView src,
                                    Axis axis, absl::Span<const int64_t> indices, float alpha,
                                    TensorView x, TensorView update_sq) {
  Call call(ctx);
  const DiondTensor ts = T(src), tx = T(x), tq = T(update_sq);
  return DIOND_DONE("DecayScatterWithChange",
                    Api<S>().decay_scatter_with_change(
                        &call.c, decay, &ts, static_cast<int32_t>(axis), indices.data(),
                        static_cast<int64_t>(indices.size()), alpha, &tx, &tq));
}
// ---- end asynccopy ----

#undef DIOND_DONE

template <int S>
OpsBackend MakeTable(const char* name) {
  OpsBackend b;
  b.name = name;
  b.allocate = &Allocate<S>;
  b.deallocate = &Deallocate<S>;
  b.copy_from_host = &CopyFromHost<S>;
  b.copy_to_host = &CopyToHost<S>;
  b.gemm = &Gemm<S>;
  b.symmetric_product = &SymmetricProduct<S>;
  b.symmetric_product_bf16 = &SymmetricProductBf16<S>;
  b.thin_qr = &ThinQr<S>;
  b.cholesky_qr = &CholeskyQr<S>;
  b.randomized_cholesky_qr = &RandomizedCholeskyQr<S>;
  b.frobenius_norm = &FrobeniusNorm<S>;
  b.axis_norms = &AxisNorms<S>;
  b.top_k_by_l1_norm = &TopKByL1Norm<S>;
  b.is_all_zero = &IsAllZero<S>;
  b.gather = &Gather<S>;
  b.scatter = &Scatter<S>;
  b.copy = &Copy<S>;
  b.fill = &Fill<S>;
  b.axpby = &Axpby<S>;
  b.add_scalar = &AddScalar<S>;
  b.unary = &Unary<S>;
  b.binary = &Binary<S>;
  b.adamw_step = &AdamWStep<S>;
  b.lion_step = &LionStep<S>;
  b.add_to_diagonal = &AddToDiagonal<S>;
  b.bf16_rounded_axpby = &Bf16RoundedAxpby<S>;
  b.adamw_step_tracked = &AdamWStepTracked<S>;
  b.lion_step_tracked = &LionStepTracked<S>;
  b.momentum_update = &MomentumUpdate<S>;
  b.apply_update = &ApplyUpdate<S>;
  b.normalize_neurons = &NormalizeNeurons<S>;
  b.copy_with_change = &CopyWithChange<S>;
  b.all_finite = &AllFinite<S>;
  b.widen_scale_check_finite = &WidenScaleCheckFinite<S>;
  b.fnv1a_checksum = &Fnv1aChecksum<S>;
  // asynccopy
  b.copy_from_host_async = &CopyFromHostAsync<S>;
  b.copy_to_host_async = &CopyToHostAsync<S>;
  b.synchronize = &Synchronize<S>;
  b.all_finite_flag = &AllFiniteFlag<S>;
  b.widen_scale_check_finite_flag = &WidenScaleCheckFiniteFlag<S>;
  b.decay_scatter_with_change = &DecayScatterWithChange<S>;
  return b;
}

bool HasNullEntry(const DiondOpsApiV1& o) {
  const void* entries[] = {
      reinterpret_cast<const void*>(o.allocate),
      reinterpret_cast<const void*>(o.deallocate),
      reinterpret_cast<const void*>(o.copy_from_host),
      reinterpret_cast<const void*>(o.copy_to_host),
      reinterpret_cast<const void*>(o.stream_create),
      reinterpret_cast<const void*>(o.stream_destroy),
      reinterpret_cast<const void*>(o.stream_synchronize),
      reinterpret_cast<const void*>(o.memory_stats),
      reinterpret_cast<const void*>(o.gemm),
      reinterpret_cast<const void*>(o.symmetric_product),
      reinterpret_cast<const void*>(o.symmetric_product_bf16),
      reinterpret_cast<const void*>(o.thin_qr),
      reinterpret_cast<const void*>(o.cholesky_qr),
      reinterpret_cast<const void*>(o.randomized_cholesky_qr),
      reinterpret_cast<const void*>(o.frobenius_norm),
      reinterpret_cast<const void*>(o.axis_norms),
      reinterpret_cast<const void*>(o.top_k_by_l1_norm),
      reinterpret_cast<const void*>(o.is_all_zero),
      reinterpret_cast<const void*>(o.gather),
      reinterpret_cast<const void*>(o.scatter),
      reinterpret_cast<const void*>(o.copy),
      reinterpret_cast<const void*>(o.fill),
      reinterpret_cast<const void*>(o.axpby),
      reinterpret_cast<const void*>(o.add_scalar),
      reinterpret_cast<const void*>(o.unary),
      reinterpret_cast<const void*>(o.binary),
      reinterpret_cast<const void*>(o.adamw_step),
      reinterpret_cast<const void*>(o.lion_step),
      reinterpret_cast<const void*>(o.add_to_diagonal),
      reinterpret_cast<const void*>(o.bf16_rounded_axpby),
      reinterpret_cast<const void*>(o.adamw_step_tracked),
      reinterpret_cast<const void*>(o.lion_step_tracked),
      reinterpret_cast<const void*>(o.momentum_update),
      reinterpret_cast<const void*>(o.apply_update),
      reinterpret_cast<const void*>(o.normalize_neurons),
      reinterpret_cast<const void*>(o.copy_with_change),
      reinterpret_cast<const void*>(o.all_finite),
      reinterpret_cast<const void*>(o.widen_scale_check_finite),
      reinterpret_cast<const void*>(o.fnv1a_checksum),
      // handoff
      reinterpret_cast<const void*>(o.device_uuids),
      reinterpret_cast<const void*>(o.ipc_open_mem_handle),
      reinterpret_cast<const void*>(o.ipc_close_mem_handle),
      reinterpret_cast<const void*>(o.vmm_import_fd),
      reinterpret_cast<const void*>(o.vmm_unmap),
      reinterpret_cast<const void*>(o.ipc_open_event),
      reinterpret_cast<const void*>(o.event_destroy),
      reinterpret_cast<const void*>(o.stream_wait_event),
      reinterpret_cast<const void*>(o.event_record),
      // devsession
      reinterpret_cast<const void*>(o.host_register),
      reinterpret_cast<const void*>(o.host_unregister),
      reinterpret_cast<const void*>(o.graph_begin_capture),
      reinterpret_cast<const void*>(o.graph_end_capture),
      reinterpret_cast<const void*>(o.graph_launch),
      reinterpret_cast<const void*>(o.graph_destroy),
      // asynccopy
      reinterpret_cast<const void*>(o.copy_from_host_async),
      reinterpret_cast<const void*>(o.copy_to_host_async),
      reinterpret_cast<const void*>(o.all_finite_flag),
      reinterpret_cast<const void*>(o.widen_scale_check_finite_flag),
      reinterpret_cast<const void*>(o.decay_scatter_with_change),
      // graph
      reinterpret_cast<const void*>(o.adamw_step_dev),
      reinterpret_cast<const void*>(o.lion_step_dev),
      reinterpret_cast<const void*>(o.adamw_step_tracked_dev),
      reinterpret_cast<const void*>(o.lion_step_tracked_dev),
      reinterpret_cast<const void*>(o.apply_update_dev),
      reinterpret_cast<const void*>(o.device_health),
  };
  for (const void* e : entries) {
    if (e == nullptr) return true;
  }
  return o.name == nullptr;
}

const DiondOpsApiV1* OpsFor(Device device) {
  const int slot = SlotOf(device.type);
  return slot < 0 ? nullptr : g_ops[slot].load(std::memory_order_acquire);
}

}  // namespace

std::string LastDeviceAllocationError() { return t_last_allocation_error; }

absl::StatusOr<const OpsBackend*> AdaptPluginOps(DeviceType type, const DiondOpsApiV1* ops) {
  const int slot = SlotOf(type);
  if (slot < 0) return absl::InvalidArgumentError("AdaptPluginOps: type must be kCuda or kTest");
  if (ops == nullptr) return absl::InvalidArgumentError("AdaptPluginOps: null ops table");
  if (ops->version != DIOND_OPS_API_VERSION) {
    return absl::InvalidArgumentError(absl::StrCat("AdaptPluginOps: ops table version ",
                                                   ops->version, " != ",
                                                   DIOND_OPS_API_VERSION));
  }
  if (HasNullEntry(*ops)) return absl::InvalidArgumentError("AdaptPluginOps: null entry");
  const DiondOpsApiV1* expected = nullptr;
  if (!g_ops[slot].compare_exchange_strong(expected, ops) && expected != ops) {
    if (FindOpsBackend(type) != nullptr) {
      return absl::AlreadyExistsError("AdaptPluginOps: another table is registered");
    }
    g_ops[slot].store(ops, std::memory_order_release);
  }
  static const OpsBackend cuda = MakeTable<0>("cuda (plugin)");
  static const OpsBackend test = MakeTable<1>("host-test device (TEST BACKEND)");
  return slot == 0 ? &cuda : &test;
}

absl::Status RegisterPluginOps(DeviceType type, const DiondOpsApiV1* ops) {
  auto table = AdaptPluginOps(type, ops);
  if (!table.ok()) return table.status();
  return RegisterOpsBackend(type, *table);
}

absl::Status RegisterCudaOps(const std::string& plugin_path) {
  auto plugin = LoadCudaPlugin(plugin_path);
  if (!plugin.ok()) return plugin.status();
  if ((*plugin)->ops == nullptr) {
    return absl::FailedPreconditionError("the CUDA plugin has no ops table");
  }
  char err[256] = {0};
  const int count = (*plugin)->device_count(err, sizeof(err));
  if (count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no GPU: ", count < 0 ? err : "no CUDA device present"));
  }
  return RegisterPluginOps(DeviceType::kCuda, (*plugin)->ops);
}

absl::StatusOr<StreamHandle> CreateDeviceStream(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  void* stream = nullptr;
  absl::Status s = call.Done("stream_create", ops->stream_create(&call.c, &stream), ops->name);
  if (!s.ok()) return s;
  return stream;
}

void DestroyDeviceStream(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops != nullptr && stream != nullptr) ops->stream_destroy(device.index, stream);
}

absl::Status SynchronizeDeviceStream(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("stream_synchronize", ops->stream_synchronize(&call.c), ops->name);
}

absl::StatusOr<DeviceMemoryStats> GetDeviceMemoryStats(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  DeviceMemoryStats st;
  absl::Status s = call.Done("memory_stats", ops->memory_stats(&call.c, &st.in_use, &st.peak),
                             ops->name);
  if (!s.ok()) return s;
  return st;
}

absl::Status DeviceHealth(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("device_health", ops->device_health(&call.c), ops->name);
}

// ---- handoff (issue 12): device UUIDs, CUDA IPC / VMM imports, interprocess events ----

namespace {

absl::Status CheckHandle(const char* what, absl::Span<const uint8_t> handle) {
  if (handle.size() != DIOND_CUDA_IPC_HANDLE_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be ", DIOND_CUDA_IPC_HANDLE_BYTES,
                                                   " bytes, got ", handle.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<GpuUuid>> ListDeviceUuids(DeviceType type) {
  const DiondOpsApiV1* ops = OpsFor(Device{type, 0});
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this type");
  Call call(0, nullptr);
  int32_t count = 0;
  DIOND_RETURN_IF_ERROR(
      call.Done("device_uuids", ops->device_uuids(&call.c, nullptr, 0, &count), ops->name));
  if (count < 0 || count > 1024) {
    return absl::InternalError(absl::StrCat("device_uuids: ", count, " devices"));
  }
  std::vector<GpuUuid> out(static_cast<size_t>(count));
  int32_t again = 0;
  DIOND_RETURN_IF_ERROR(call.Done(
      "device_uuids",
      ops->device_uuids(&call.c, count == 0 ? nullptr : out[0].data(), count, &again),
      ops->name));
  if (again != count) {
    return absl::InternalError(
        absl::StrCat("device_uuids: ", count, " devices, then ", again));
  }
  return out;
}

absl::StatusOr<IpcMapping> OpenIpcMemHandle(Device device, absl::Span<const uint8_t> handle) {
  DIOND_RETURN_IF_ERROR(CheckHandle("a CUDA IPC memory handle", handle));
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  IpcMapping m;
  DIOND_RETURN_IF_ERROR(call.Done(
      "ipc_open_mem_handle", ops->ipc_open_mem_handle(&call.c, handle.data(), &m.ptr, &m.bytes),
      ops->name));
  return m;
}

absl::Status CloseIpcMemHandle(Device device, void* ptr) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("ipc_close_mem_handle", ops->ipc_close_mem_handle(&call.c, ptr), ops->name);
}

absl::StatusOr<VmmMapping> ImportVmmFd(Device device, int fd, uint64_t bytes,
                                       uint64_t granularity) {
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("VMM fd ", fd, " is not an fd"));
  if (bytes == 0 || granularity == 0 || bytes % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("VMM mapping of ", bytes,
                                                   " bytes must be a non-zero multiple of its "
                                                   "granularity ",
                                                   granularity));
  }
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  VmmMapping m;
  m.bytes = bytes;
  DIOND_RETURN_IF_ERROR(call.Done(
      "vmm_import_fd", ops->vmm_import_fd(&call.c, fd, bytes, granularity, &m.ptr, &m.handle),
      ops->name));
  return m;
}

absl::Status UnmapVmm(Device device, const VmmMapping& mapping) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("vmm_unmap",
                   ops->vmm_unmap(&call.c, mapping.ptr, mapping.bytes, mapping.handle), ops->name);
}

absl::StatusOr<void*> OpenIpcEvent(Device device, absl::Span<const uint8_t> handle) {
  DIOND_RETURN_IF_ERROR(CheckHandle("a CUDA IPC event handle", handle));
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  void* event = nullptr;
  DIOND_RETURN_IF_ERROR(call.Done(
      "ipc_open_event", ops->ipc_open_event(&call.c, handle.data(), &event), ops->name));
  return event;
}

absl::Status DestroyEvent(Device device, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("event_destroy", ops->event_destroy(&call.c, event), ops->name);
}

absl::Status StreamWaitEvent(Device device, StreamHandle stream, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("stream_wait_event", ops->stream_wait_event(&call.c, event), ops->name);
}

absl::Status RecordEvent(Device device, StreamHandle stream, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("event_record", ops->event_record(&call.c, event), ops->name);
}

// ---- devsession ----
absl::Status HostRegister(Device device, void* ptr, size_t bytes) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("host_register", ops->host_register(&call.c, ptr, bytes), ops->name);
}

absl::Status HostUnregister(Device device, void* ptr) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("host_unregister", ops->host_unregister(&call.c, ptr), ops->name);
}
absl::Status BeginStreamCapture(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("graph_begin_capture", ops->graph_begin_capture(&call.c), ops->name);
}

absl::StatusOr<void*> EndStreamCapture(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  void* graph = nullptr;
  absl::Status s =
      call.Done("graph_end_capture", ops->graph_end_capture(&call.c, &graph), ops->name);
  if (!s.ok()) return s;
  return graph;
}

absl::Status LaunchGraph(Device device, StreamHandle stream, void* graph) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("graph_launch", ops->graph_launch(&call.c, graph), ops->name);
}

void DestroyGraph(Device device, void* graph) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops != nullptr && graph != nullptr) ops->graph_destroy(device.index, graph);
}
// ---- end devsession ----

}  // namespace diond::kernels
