// Dion (ALGORITHMS.md §9.4, §10, §20.5), single device, for one shape bucket: all N matrices of
// the bucket go through each phase (GEMMs, QR, column normalization) as one batched call.
//
// Orthonormalization of P follows the group's qr_method as the reference's `orthogonalize`
// (dion/dion_reference.py; dion/dion.py has the rcqr branch only):
//   qr    Householder QR (LAPACK, as torch.linalg.qr);
//   rcqr  Householder QR when P is square (a == r), else randomized Cholesky QR with a Gaussian
//         sketch of 128·⌈oversample·r/128⌉ rows;
//   cqr   rcqr while the step number is <= cqr_warmup_steps; afterwards Cholesky QR, and rcqr
//         for a matrix whose Cholesky factorization fails.
// The sketch is drawn from this implementation's own generator, seeded by the group seed and the
// shape only: the same for every matrix of the bucket, on every worker and at every step (the
// reference draws a fresh one per step from its generator; a fixed one keeps a resumed session
// bit-identical to an uninterrupted one). It is not PyTorch's sketch: in exact arithmetic every
// branch returns the thin-QR Q-factor of P up to the sign of each column (P12), and X and M do not
// depend on those signs, so the stored Q can differ from the reference's in column signs only;
// compare it up to signs. Deviation, for robustness (P13): where the reference's randomized
// Cholesky QR breaks down (R₁ singular, or the Cholesky factorization of P₁ᵀP₁ fails, e.g. a
// rank-deficient P) and would go on with a partial factor (inf/NaN, then zeroed), this
// implementation uses the Householder QR of that matrix instead.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"

namespace diond::optim::internal {
namespace {

using kernels::GemmParams;
using kernels::Trans;

// Standard normal samples from a fixed generator (mt19937_64 and Box-Muller written out, so the
// values are the same on every platform; std::normal_distribution is implementation-defined).
void FillStandardNormal(uint64_t seed, uint64_t stream, float* out, int64_t n) {
  std::mt19937_64 gen(seed * 0x9E3779B97F4A7C15ull + stream * 0xBF58476D1CE4E5B9ull + 1);
  const double two_pi = 6.283185307179586476925286766559;
  for (int64_t i = 0; i < n; i += 2) {
    // Uniform in (0, 1]: 53 random bits.
    const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;
    const double rad = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(rad * std::cos(two_pi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(rad * std::sin(two_pi * u2));
  }
}

struct DionDims {
  int64_t m, n, a, b, r;
  bool transposed;
};

DionDims Dims(const GroupConfig& cfg, const ParamShape& s) {
  DionDims d;
  d.m = s[0];
  d.n = s[1];
  d.transposed = d.m < d.n;  // §9.2
  d.a = std::max(d.m, d.n);
  d.b = std::min(d.m, d.n);
  d.r = DionRank(d.m, d.n, cfg.hyperparams.rank_fraction, cfg.hyperparams.rank_multiple_of);
  return d;
}

// The randomized-QR sketch of one shape has a stream of its own, apart from the Q
// initialisation streams (small parameter indices).
uint64_t SketchStream(const DionDims& d) {
  return 0x8000000000000000ull ^ (static_cast<uint64_t>(d.a) << 24) ^ static_cast<uint64_t>(d.r);
}

// Randomized Cholesky QR of one a×r matrix (a > r) in place, with the shared sketch S (k×a);
// Householder QR where it breaks down (see the file comment). `copy` is scratch of a×r floats.
absl::Status RcqrOne(const kernels::Context& ctx, const DionDims& d,
                     kernels::ConstTensorView sketch, float* p, float* copy) {
  const kernels::Device dev = ctx.device();
  const MatrixBatch one{1, d.a, d.r};
  DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, CView3(p, one, dev), View3(copy, one, dev)));
  absl::Status s = kernels::RandomizedCholeskyQr(ctx, CView3(copy, one, dev).Matrix(0), sketch,
                                                 View3(p, one, dev).Matrix(0));
  if (s.code() != absl::StatusCode::kFailedPrecondition) return s;
  return kernels::ThinQr(ctx, CView3(copy, one, dev).Matrix(0), View3(p, one, dev).Matrix(0));
}

// Step 4 for N matrices: P ← Q-factor of P by the group's qr_method (see the file comment).
// `sketch` is the shape's fixed sketch (k×a; empty when the method never needs one).
// Failed Cholesky factorizations are a host-side branch on a status (a sync point per matrix,
// docs/KERNELS.md).
absl::Status Orthonormalize(const kernels::Context& ctx, const GroupConfig& cfg, const DionDims& d,
                            int64_t N, int64_t step, kernels::ConstTensorView sketch, float* P) {
  const kernels::Device dev = ctx.device();
  const MatrixBatch pb{N, d.a, d.r};
  QrMethod method = cfg.hyperparams.qr_method;
  if (method == QrMethod::kCqr && step <= cfg.hyperparams.cqr_warmup_steps) {
    method = QrMethod::kRcqr;  // Cholesky QR only once the matrices are well-conditioned
  }
  if (method == QrMethod::kQr || (method == QrMethod::kRcqr && d.a <= d.r)) {
    return kernels::ThinQr(ctx, CView3(P, pb, dev), View3(P, pb, dev));
  }
  kernels::ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(float* const copy, ScratchFloats(ctx, d.a * d.r));
  const MatrixBatch one{1, d.a, d.r};
  for (int64_t j = 0; j < N; ++j) {
    float* p = P + j * d.a * d.r;
    if (method == QrMethod::kCqr) {
      DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, CView3(p, one, dev), View3(copy, one, dev)));
      absl::Status s =
          kernels::CholeskyQr(ctx, CView3(copy, one, dev).Matrix(0), View3(p, one, dev).Matrix(0));
      if (s.ok()) continue;
      if (s.code() != absl::StatusCode::kFailedPrecondition) return s;
      // The Cholesky factorization failed: back to the saved P.
      DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, CView3(copy, one, dev), View3(p, one, dev)));
    }
    if (d.a <= d.r) {
      DIOND_RETURN_IF_ERROR(
          kernels::ThinQr(ctx, CView3(p, one, dev).Matrix(0), View3(p, one, dev).Matrix(0)));
    } else {
      DIOND_RETURN_IF_ERROR(RcqrOne(ctx, d, sketch, p, copy));
    }
  }
  return absl::OkStatus();
}

// Steps 9-10 for N matrices: X ← (1 − η·λ)·X − s·(P·Q_newᵀ) (transposed: Q_new·Pᵀ),
// s = f32(√(m/n))·η, as one GEMM with beta = 1 − η·λ: the BLAS scales X by beta and then adds
// −s·P·Q_newᵀ, the reference's X.mul_(1 − η·λ) followed by addmm_ (no update buffer). Shared by
// the rule and by DionApplyCaptured (a non-owner reproducing the owner's update from P and
// Q_new), so both compute the same bits.
absl::Status ApplyFactors(const kernels::Context& ctx, const DionDims& d, int64_t N, const float* P,
                          const float* q_new, const StepScalars& scalars, float* x) {
  const kernels::Device dev = ctx.device();
  const MatrixBatch mb{N, d.m, d.n}, pb{N, d.a, d.r}, qb{N, d.b, d.r};
  const float s = F32(std::sqrt(static_cast<double>(d.m) / static_cast<double>(d.n))) * scalars.lr;
  GemmParams gu;
  gu.trans_b = Trans::kYes;
  gu.alpha = -s;
  gu.beta = DecayFactor(scalars.lr, scalars.weight_decay);
  if (d.transposed) {
    return kernels::Gemm(ctx, gu, CView3(q_new, qb, dev), CView3(P, pb, dev), View3(x, mb, dev));
  }
  return kernels::Gemm(ctx, gu, CView3(P, pb, dev), CView3(q_new, qb, dev), View3(x, mb, dev));
}

// Compressed sync (§9.7): the caller's replica_average runs on host memory, or on the context's
// memory when it says so (on_device: a device collective). On the CPU, or on_device, the buffer
// is handed over as it is; otherwise a device buffer is read back, averaged and written back
// (two sync points).
absl::Status ReplicaAverage(const kernels::Context& ctx,
                            const std::function<absl::Status(absl::Span<float>)>& average,
                            bool on_device, float* buf, int64_t n) {
  if (ctx.device().type == kernels::DeviceType::kCpu || on_device) {
    return average(absl::MakeSpan(buf, static_cast<size_t>(n)));
  }
  std::vector<float> host(static_cast<size_t>(n));
  DIOND_RETURN_IF_ERROR(Download(ctx, buf, host.data(), n));
  DIOND_RETURN_IF_ERROR(average(absl::MakeSpan(host)));
  return Upload(ctx, host.data(), buf, n);
}

// zero[j] ← whether matrix j of the N contiguous matrices of `per` elements at `buf` is all
// zero (±0; NaN is not zero). On the CPU: IsAllZero per matrix (it stops at the first non-zero).
// On a device, one sync point for the whole bucket instead of one per matrix: the matrices' L1
// norms (AxisNorms over the N×per rows, accumulated in double, so a non-zero element, subnormals
// included, gives a non-zero norm and a NaN a NaN) into the scratch arena, read back in one copy.
absl::Status AllZeroFlags(const kernels::Context& ctx, const float* buf, int64_t N, int64_t per,
                          absl::Span<bool> zero) {
  const kernels::Device dev = ctx.device();
  if (dev.type == kernels::DeviceType::kCpu) {
    for (int64_t j = 0; j < N; ++j) {
      bool z = false;
      DIOND_RETURN_IF_ERROR(kernels::IsAllZero(ctx, CVec(buf + j * per, per, dev), &z));
      zero[static_cast<size_t>(j)] = z;
    }
    return absl::OkStatus();
  }
  kernels::ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(float* const l1, ScratchFloats(ctx, N));
  const kernels::ConstTensorView rows(
      buf, kernels::ContiguousLayout(kernels::DType::kF32, {N, per}), dev);
  DIOND_RETURN_IF_ERROR(
      kernels::AxisNorms(ctx, rows, kernels::Axis::kRows, kernels::NormType::kL1, Vec(l1, N, dev)));
  absl::InlinedVector<float, 16> host(static_cast<size_t>(N));
  DIOND_RETURN_IF_ERROR(Download(ctx, l1, host.data(), N));
  for (size_t j = 0; j < host.size(); ++j) zero[j] = host[j] == 0.0f;
  return absl::OkStatus();
}

class DionRule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    const DionDims d = Dims(config, shape);
    return {{std::string(kStateMomentum), shape}, {std::string(kStateQ), {d.b, d.r}}};
  }

  bool InitState(const GroupConfig& config, const ParamShape& shape, size_t spec_index,
                 int64_t count, uint64_t stream, float* host_data) const override {
    if (spec_index != 1) return false;
    const DionDims d = Dims(config, shape);
    FillStandardNormal(config.seed, stream, host_data, count * d.b * d.r);
    return true;
  }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& args) const override {
    const GroupConfig& cfg = *args.config;
    const DionDims d = Dims(cfg, *args.shape);
    const kernels::Device dev = ctx.device();  // every pointer of `args` is on it
    const int64_t N = args.count;
    const MatrixBatch mb{N, d.m, d.n}, pb{N, d.a, d.r}, qb{N, d.b, d.r};
    const int64_t psize = N * d.a * d.r, qsize = N * d.b * d.r;
    float* M = args.state[0];
    float* Q = args.state[1];
    const float mu = F32(cfg.hyperparams.mu);
    const float eps = F32(cfg.hyperparams.epsilon);
    DIOND_ASSIGN_OR_RETURN(kernels::ConstTensorView sketch, Sketch(ctx, cfg, d));

    // P, R and the column norms live in the context's scratch arena (rewound on return).
    kernels::ScratchArena::Scope scope(ctx.scratch());
    DIOND_ASSIGN_OR_RETURN(float* const P, ScratchFloats(ctx, psize));
    DIOND_ASSIGN_OR_RETURN(float* const R, ScratchFloats(ctx, qsize));
    DIOND_ASSIGN_OR_RETURN(float* const norms, ScratchFloats(ctx, N * d.r));

    // 1. M ← M + G.
    // Per matrix: its gradient is the caller's buffer (GroupOptimizer stages no gradient).
    const int64_t numel = d.m * d.n;
    // The persistent M is read once, the staged one written (out of place); Q and X are staged
    // by a copy (Q is small, and the final GEMM updates X in place).
    const int64_t qnumel = d.b * d.r;
    for (int64_t j = 0; j < N; ++j) {
      DIOND_RETURN_IF_ERROR(kernels::Axpby(ctx, 1.0f, CVec(args.state_in[0][j], numel, dev), 1.0f,
                                           CVec(args.g[j], numel, dev),
                                           Vec(M + j * numel, numel, dev)));
      DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, CVec(args.state_in[1][j], qnumel, dev),
                                          Vec(Q + j * qnumel, qnumel, dev)));
      DIOND_RETURN_IF_ERROR(
          kernels::Copy(ctx, CVec(args.x_in[j], numel, dev), Vec(args.x + j * numel, numel, dev)));
    }

    // 2-3. P = B·Q with B = M (a×b) or Mᵀ when transposed.
    GemmParams gp;
    gp.trans_a = d.transposed ? Trans::kYes : Trans::kNo;
    DIOND_RETURN_IF_ERROR(
        kernels::Gemm(ctx, gp, CView3(M, mb, dev), CView3(Q, qb, dev), View3(P, pb, dev)));

    // Whether each matrix's momentum is all zero (judged on P under compressed sync, §9.7).
    absl::InlinedVector<bool, 16> zero(static_cast<size_t>(N), false);
    if (args.replica_average != nullptr) {
      DIOND_RETURN_IF_ERROR(
          ReplicaAverage(ctx, *args.replica_average, args.replica_average_on_device, P, psize));
    }
    DIOND_RETURN_IF_ERROR(args.replica_average != nullptr
                              ? AllZeroFlags(ctx, P, N, d.a * d.r, absl::MakeSpan(zero))
                              : AllZeroFlags(ctx, M, N, numel, absl::MakeSpan(zero)));
    // 4. P ← Q-factor of P by qr_method (see the file comment).
    DIOND_RETURN_IF_ERROR(Orthonormalize(ctx, cfg, d, N, args.step, sketch, P));

    // 5. R = Bᵀ·P (b×r).
    GemmParams gr;
    gr.trans_a = d.transposed ? Trans::kNo : Trans::kYes;
    DIOND_RETURN_IF_ERROR(
        kernels::Gemm(ctx, gr, CView3(M, mb, dev), CView3(P, pb, dev), View3(R, qb, dev)));
    // Compressed sync: R ← mean over replicas of B_iᵀ·P.
    if (args.replica_average != nullptr) {
      DIOND_RETURN_IF_ERROR(
          ReplicaAverage(ctx, *args.replica_average, args.replica_average_on_device, R, qsize));
    }

    // 6. All-zero momentum: P ← 0, R ← Q (P13); otherwise NaN → 0, ±inf → ±FLT_MAX.
    DIOND_RETURN_IF_ERROR(
        kernels::Unary(ctx, kernels::UnaryOp::kNanToNum, CView3(P, pb, dev), View3(P, pb, dev)));
    DIOND_RETURN_IF_ERROR(
        kernels::Unary(ctx, kernels::UnaryOp::kNanToNum, CView3(R, qb, dev), View3(R, qb, dev)));
    for (int64_t j = 0; j < N; ++j) {
      if (!zero[j]) continue;
      DIOND_RETURN_IF_ERROR(kernels::Fill(ctx, 0.0f, View3(P, pb, dev).Matrix(j)));
      DIOND_RETURN_IF_ERROR(
          kernels::Copy(ctx, CView3(Q, qb, dev).Matrix(j), View3(R, qb, dev).Matrix(j)));
    }

    // 7. Error feedback M ← M − (1−μ)·P·Rᵀ (transposed: R·Pᵀ), in the storage orientation.
    GemmParams ge;
    ge.alpha = -(1.0f - mu);
    ge.beta = 1.0f;
    ge.trans_b = Trans::kYes;
    if (d.transposed) {
      DIOND_RETURN_IF_ERROR(
          kernels::Gemm(ctx, ge, CView3(R, qb, dev), CView3(P, pb, dev), View3(M, mb, dev)));
    } else {
      DIOND_RETURN_IF_ERROR(
          kernels::Gemm(ctx, ge, CView3(P, pb, dev), CView3(R, qb, dev), View3(M, mb, dev)));
    }

    // 8. Q_new = R / (‖R_col‖₂ + ε), ε outside the square root (§3.10): the norms, + ε, then
    // one broadcast division.
    kernels::TensorView nv(norms, kernels::ContiguousLayout(kernels::DType::kF32, {N, 1, d.r}),
                           dev);
    DIOND_RETURN_IF_ERROR(kernels::AxisNorms(ctx, CView3(R, qb, dev), kernels::Axis::kCols,
                                             kernels::NormType::kL2, Vec(norms, N * d.r, dev)));
    DIOND_RETURN_IF_ERROR(kernels::AddScalar(ctx, 1.0f, nv, eps, nv));
    DIOND_RETURN_IF_ERROR(
        kernels::Binary(ctx, kernels::BinaryOp::kDiv, CView3(R, qb, dev), nv, View3(R, qb, dev)));

    // 9-10. X ← (1 − η·λ)·X − s·(P·Q_newᵀ) (transposed: Q_new·Pᵀ), s = f32(√(m/n))·η.
    DIOND_RETURN_IF_ERROR(ApplyFactors(ctx, d, N, P, R, args.scalars, args.x));
    // The compact update for other workers: P then Q_new, per matrix (host payloads, read back
    // from the device: two sync points per matrix).
    for (size_t j = 0; j < args.capture.size(); ++j) {
      std::vector<float>& out = *args.capture[j];
      const int64_t ps = d.a * d.r, qs = d.b * d.r;
      out.resize(static_cast<size_t>(ps + qs));
      DIOND_RETURN_IF_ERROR(Download(ctx, P + static_cast<int64_t>(j) * ps, out.data(), ps));
      DIOND_RETURN_IF_ERROR(Download(ctx, R + static_cast<int64_t>(j) * qs, out.data() + ps, qs));
    }
    // 11. Q ← Q_new.
    return kernels::Copy(ctx, CView3(R, qb, dev), View3(Q, qb, dev));
  }

 private:
  // The fixed randomized-QR sketch of a shape (see the file comment): S ~ N(0, 1/k), k×a, as the
  // reference's generate_random_sketch_matrix. It depends on the seed and the shape only, so it
  // is drawn once, at the first step that needs it, into a Buffer of the context's allocator,
  // and reused by every later step (drawing k·a normals per step cost as much as the GEMMs).
  // An empty view when this step's method needs none.
  absl::StatusOr<kernels::ConstTensorView> Sketch(const kernels::Context& ctx,
                                                  const GroupConfig& cfg, const DionDims& d) const {
    if (cfg.hyperparams.qr_method == QrMethod::kQr || d.a <= d.r) {
      return kernels::ConstTensorView();
    }
    // cqr after its warm-up needs the sketch only where a Cholesky factorization fails; it is
    // kept ready all the same, so that the fallback allocates nothing either.
    const int64_t k = RcqrSketchRows(d.r, cfg.hyperparams.rcqr_oversample);
    const SketchKey key{cfg.seed, d.a, d.r, k};
    auto it = sketches_.find(key);
    if (it == sketches_.end()) {
      DIOND_ASSIGN_OR_RETURN(kernels::Buffer buf, ctx.Allocate(kernels::DType::kF32, {k, d.a}));
      // Drawn on the host and uploaded (one copy, at the first step of the shape only).
      std::vector<float> v(static_cast<size_t>(k * d.a));
      FillStandardNormal(cfg.seed, SketchStream(d), v.data(), k * d.a);
      DIOND_RETURN_IF_ERROR(Upload(ctx, v.data(), buf.As<float>(), k * d.a));
      const float scale = F32(std::sqrt(1.0 / static_cast<double>(k)));
      DIOND_RETURN_IF_ERROR(kernels::Scale(ctx, scale, buf.view(), buf.view()));
      it = sketches_.emplace(key, std::move(buf)).first;
    }
    return kernels::ConstTensorView(it->second.view());
  }

  using SketchKey = std::tuple<uint64_t, int64_t, int64_t, int64_t>;
  // Per shape: the rule object belongs to one GroupOptimizer, driven by one thread.
  mutable std::map<SketchKey, kernels::Buffer> sketches_;
};

}  // namespace

std::unique_ptr<UpdateRule> MakeDionRule() { return std::make_unique<DionRule>(); }

int64_t DionCaptureSize(const GroupConfig& config, const ParamShape& shape) {
  if (shape.size() != 2) return 0;
  const DionDims d = Dims(config, shape);
  const int64_t size = d.r * (d.a + d.b);
  return size < d.m * d.n ? size : 0;
}

absl::Status DionApplyCaptured(const kernels::Context& ctx, const GroupConfig& config,
                               const ParamShape& shape, const StepScalars& scalars,
                               const float* payload, float* x) {
  const DionDims d = Dims(config, shape);
  // The (host) payload is uploaded into the context's scratch: P, then Q_new.
  kernels::ScratchArena::Scope scope(ctx.scratch());
  const int64_t n = d.r * (d.a + d.b);
  DIOND_ASSIGN_OR_RETURN(float* const factors, ScratchFloats(ctx, n));
  DIOND_RETURN_IF_ERROR(Upload(ctx, payload, factors, n));
  return ApplyFactors(ctx, d, 1, factors, factors + d.a * d.r, scalars, x);
}

}  // namespace diond::optim::internal
