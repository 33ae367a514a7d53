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
// bit-identical to an uninterrupted one). It is not PyTorch's sketch: in exact arithmetic every branch returns the thin-QR Q-factor of P up to the
// sign of each column (P12), and X and M do not depend on those signs, so the stored Q can
// differ from the reference's in column signs only; compare it up to signs.
// Deviation, for robustness (P13): where the reference's randomized Cholesky QR breaks down
// (R₁ singular, or the Cholesky factorization of P₁ᵀP₁ fails, e.g. a rank-deficient P) and would
// go on with a partial factor (inf/NaN, then zeroed), this implementation uses the Householder
// QR of that matrix instead.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

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
// Householder QR where it breaks down (see the file comment).
absl::Status RcqrOne(const kernels::Context& ctx, const DionDims& d,
                     kernels::ConstTensorView sketch, float* p, std::vector<float>* scratch) {
  const MatrixBatch one{1, d.a, d.r};
  scratch->assign(p, p + d.a * d.r);
  absl::Status s = kernels::RandomizedCholeskyQr(ctx, CView3(scratch->data(), one).Matrix(0),
                                                 sketch, View3(p, one).Matrix(0));
  if (s.code() != absl::StatusCode::kFailedPrecondition) return s;
  return kernels::ThinQr(ctx, CView3(scratch->data(), one).Matrix(0), View3(p, one).Matrix(0));
}

// Step 4 for N matrices: P ← Q-factor of P by the group's qr_method (see the file comment).
absl::Status Orthonormalize(const kernels::Context& ctx, const GroupConfig& cfg,
                            const DionDims& d, int64_t N, int64_t step, float* P) {
  const MatrixBatch pb{N, d.a, d.r};
  QrMethod method = cfg.hyperparams.qr_method;
  if (method == QrMethod::kCqr && step <= cfg.hyperparams.cqr_warmup_steps) {
    method = QrMethod::kRcqr;  // Cholesky QR only once the matrices are well-conditioned
  }
  if (method == QrMethod::kQr || (method == QrMethod::kRcqr && d.a <= d.r)) {
    return kernels::ThinQr(ctx, CView3(P, pb), View3(P, pb));
  }
  std::vector<float> sketch, scratch;
  auto rcqr = [&](int64_t j) -> absl::Status {
    float* p = P + j * d.a * d.r;
    if (d.a <= d.r) {
      const MatrixBatch one{1, d.a, d.r};
      return kernels::ThinQr(ctx, CView3(p, one).Matrix(0), View3(p, one).Matrix(0));
    }
    const int64_t k = RcqrSketchRows(d.r, cfg.hyperparams.rcqr_oversample);
    if (sketch.empty()) {
      // S ~ N(0, 1/k), k×a, as the reference's generate_random_sketch_matrix.
      sketch.resize(static_cast<size_t>(k * d.a));
      FillStandardNormal(cfg.seed, SketchStream(d), sketch.data(), k * d.a);
      const float scale = F32(std::sqrt(1.0 / static_cast<double>(k)));
      for (float& v : sketch) v = v * scale;
    }
    const MatrixBatch sb{1, k, d.a};
    return RcqrOne(ctx, d, CView3(sketch.data(), sb).Matrix(0), p, &scratch);
  };
  for (int64_t j = 0; j < N; ++j) {
    if (method == QrMethod::kCqr) {
      float* p = P + j * d.a * d.r;
      const MatrixBatch one{1, d.a, d.r};
      scratch.assign(p, p + d.a * d.r);
      absl::Status s = kernels::CholeskyQr(ctx, CView3(scratch.data(), one).Matrix(0),
                                           View3(p, one).Matrix(0));
      if (s.ok()) continue;
      if (s.code() != absl::StatusCode::kFailedPrecondition) return s;
      std::copy(scratch.begin(), scratch.end(), p);  // the Cholesky factorization failed
    }
    DIOND_RETURN_IF_ERROR(rcqr(j));
  }
  return absl::OkStatus();
}

// Steps 9-10 for N matrices: X ← (1 − η·λ)·X − s·(P·Q_newᵀ) (transposed: Q_new·Pᵀ),
// s = f32(√(m/n))·η. Shared by the rule and by DionApplyCaptured (a non-owner reproducing the
// owner's update from P and Q_new), so both compute the same bits.
absl::Status ApplyFactors(const kernels::Context& ctx, const DionDims& d, int64_t N,
                          const float* P, const float* q_new, const StepScalars& scalars,
                          float* x) {
  const MatrixBatch mb{N, d.m, d.n}, pb{N, d.a, d.r}, qb{N, d.b, d.r};
  const float s = F32(std::sqrt(static_cast<double>(d.m) / static_cast<double>(d.n))) *
                  scalars.lr;
  const float decay = DecayFactor(scalars.lr, scalars.weight_decay);
  std::vector<float> upd(static_cast<size_t>(N * d.m * d.n));
  GemmParams gu;
  gu.trans_b = Trans::kYes;
  if (d.transposed) {
    DIOND_RETURN_IF_ERROR(
        kernels::Gemm(ctx, gu, CView3(q_new, qb), CView3(P, pb), View3(upd.data(), mb)));
  } else {
    DIOND_RETURN_IF_ERROR(
        kernels::Gemm(ctx, gu, CView3(P, pb), CView3(q_new, qb), View3(upd.data(), mb)));
  }
  for (int64_t i = 0; i < N * d.m * d.n; ++i) {
    x[i] = decay * x[i] + (-s) * upd[i];
  }
  return absl::OkStatus();
}

class DionRule final : public UpdateRule {
 public:
  std::vector<StateSpec> Specs(const GroupConfig& config, const ParamShape& shape) const override {
    const DionDims d = Dims(config, shape);
    return {{std::string(kStateMomentum), shape}, {std::string(kStateQ), {d.b, d.r}}};
  }

  void InitState(const GroupConfig& config, const ParamShape& shape, size_t spec_index,
                 int64_t count, uint64_t stream, float* data) const override {
    if (spec_index != 1) return;
    const DionDims d = Dims(config, shape);
    FillStandardNormal(config.seed, stream, data, count * d.b * d.r);
  }

  absl::Status Apply(const kernels::Context& ctx, const BucketArgs& args) const override {
    const GroupConfig& cfg = *args.config;
    const DionDims d = Dims(cfg, *args.shape);
    const int64_t N = args.count;
    const MatrixBatch mb{N, d.m, d.n}, pb{N, d.a, d.r}, qb{N, d.b, d.r};
    float* M = args.state[0];
    float* Q = args.state[1];
    const float mu = F32(cfg.hyperparams.mu);
    const float eps = F32(cfg.hyperparams.epsilon);

    // 1. M ← M + G.
    for (int64_t i = 0; i < N * d.m * d.n; ++i) M[i] = M[i] + args.g[i];

    // 2-3. P = B·Q with B = M (a×b) or Mᵀ when transposed.
    std::vector<float> P(static_cast<size_t>(N * d.a * d.r));
    GemmParams gp;
    gp.trans_a = d.transposed ? Trans::kYes : Trans::kNo;
    DIOND_RETURN_IF_ERROR(kernels::Gemm(ctx, gp, CView3(M, mb), CView3(Q, qb), View3(P.data(), pb)));

    std::vector<bool> zero(static_cast<size_t>(N));
    if (args.replica_average != nullptr) {
      // Compressed sync (§9.7): P ← mean over replicas of B_i·Q; B ≡ 0 judged on the mean.
      DIOND_RETURN_IF_ERROR((*args.replica_average)(absl::MakeSpan(P)));
      for (int64_t j = 0; j < N; ++j) {
        bool z = false;
        DIOND_RETURN_IF_ERROR(kernels::IsAllZero(ctx, CView3(P.data(), pb).Matrix(j), &z));
        zero[j] = z;
      }
    } else {
      for (int64_t j = 0; j < N; ++j) {
        bool z = false;
        DIOND_RETURN_IF_ERROR(kernels::IsAllZero(
            ctx, CView3(M, mb).Matrix(j), &z));
        zero[j] = z;
      }
    }
    // 4. P ← Q-factor of P by qr_method (see the file comment).
    DIOND_RETURN_IF_ERROR(Orthonormalize(ctx, cfg, d, N, args.step, P.data()));

    // 5. R = Bᵀ·P (b×r).
    std::vector<float> R(static_cast<size_t>(N * d.b * d.r));
    GemmParams gr;
    gr.trans_a = d.transposed ? Trans::kNo : Trans::kYes;
    DIOND_RETURN_IF_ERROR(
        kernels::Gemm(ctx, gr, CView3(M, mb), CView3(P.data(), pb), View3(R.data(), qb)));
    // Compressed sync: R ← mean over replicas of B_iᵀ·P.
    if (args.replica_average != nullptr) {
      DIOND_RETURN_IF_ERROR((*args.replica_average)(absl::MakeSpan(R)));
    }

    // 6. All-zero momentum: P ← 0, R ← Q (P13); otherwise NaN → 0, ±inf → ±FLT_MAX.
    DIOND_RETURN_IF_ERROR(kernels::Unary(ctx, kernels::UnaryOp::kNanToNum, CView3(P.data(), pb),
                                         View3(P.data(), pb)));
    DIOND_RETURN_IF_ERROR(kernels::Unary(ctx, kernels::UnaryOp::kNanToNum, CView3(R.data(), qb),
                                         View3(R.data(), qb)));
    for (int64_t j = 0; j < N; ++j) {
      if (!zero[j]) continue;
      std::fill_n(P.data() + j * d.a * d.r, d.a * d.r, 0.0f);
      std::copy_n(Q + j * d.b * d.r, d.b * d.r, R.data() + j * d.b * d.r);
    }

    // 7. Error feedback M ← M − (1−μ)·P·Rᵀ (transposed: R·Pᵀ), in the storage orientation.
    GemmParams ge;
    ge.alpha = -(1.0f - mu);
    ge.beta = 1.0f;
    ge.trans_b = Trans::kYes;
    if (d.transposed) {
      DIOND_RETURN_IF_ERROR(
          kernels::Gemm(ctx, ge, CView3(R.data(), qb), CView3(P.data(), pb), View3(M, mb)));
    } else {
      DIOND_RETURN_IF_ERROR(
          kernels::Gemm(ctx, ge, CView3(P.data(), pb), CView3(R.data(), qb), View3(M, mb)));
    }

    // 8. Q_new = R / (‖R_col‖₂ + ε), ε outside the square root (§3.10).
    std::vector<float> norms(static_cast<size_t>(N * d.r));
    DIOND_RETURN_IF_ERROR(kernels::AxisNorms(ctx, CView3(R.data(), qb), kernels::Axis::kCols,
                                             kernels::NormType::kL2,
                                             kernels::MakeView(norms.data(), {N * d.r})));
    for (int64_t j = 0; j < N; ++j) {
      for (int64_t i = 0; i < d.b; ++i) {
        float* row = R.data() + (j * d.b + i) * d.r;
        for (int64_t c = 0; c < d.r; ++c) row[c] = row[c] / (norms[j * d.r + c] + eps);
      }
    }

    // 9-10. X ← (1 − η·λ)·X − s·(P·Q_newᵀ) (transposed: Q_new·Pᵀ), s = f32(√(m/n))·η.
    DIOND_RETURN_IF_ERROR(ApplyFactors(ctx, d, N, P.data(), R.data(), args.scalars, args.x));
    // The compact update for other workers: P then Q_new, per matrix.
    for (size_t j = 0; j < args.capture.size(); ++j) {
      std::vector<float>& out = *args.capture[j];
      const int64_t ps = d.a * d.r, qs = d.b * d.r;
      out.resize(static_cast<size_t>(ps + qs));
      std::copy_n(P.data() + static_cast<int64_t>(j) * ps, ps, out.data());
      std::copy_n(R.data() + static_cast<int64_t>(j) * qs, qs, out.data() + ps);
    }
    // 11. Q ← Q_new.
    std::copy(R.begin(), R.end(), Q);
    return absl::OkStatus();
  }
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
  return ApplyFactors(ctx, d, 1, payload, payload + d.a * d.r, scalars, x);
}

}  // namespace diond::optim::internal
