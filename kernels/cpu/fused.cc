// Fused optimizer-step kernels of kernels/ops.h: AdamWStep, LionStep and
// the kops block (tracked AdamW/Lion, MomentumUpdate, ApplyUpdate, NormalizeNeurons).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/loops.h"
#include "kernels/elementwise_math.h"

namespace diond::kernels::cpu {

namespace {

// Scalars as PyTorch 2.x's fused CPU AdamW forms them (conformance README §5 item 6): double
// arithmetic on the f32 hyperparameters, cast to f32 at use.
math::AdamWScalars AdamWScalarsOf(const AdamWParams& p) {
  const double lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(p.step));
  math::AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.lr_wd = static_cast<float>(lr * wd);
  s.one_minus_b1 = static_cast<float>(1.0 - b1);
  s.one_minus_b2 = static_cast<float>(1.0 - b2);
  s.beta2 = p.beta2;
  s.step_size = static_cast<float>(-lr / bc1);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  s.eps = p.epsilon;
  s.cautious = p.cautious;
  return s;
}

// f32 arithmetic on f32 hyperparameters (ALGORITHMS.md §0: 0-d f32 tensors).
math::LionScalars LionScalarsOf(const LionParams& p) {
  math::LionScalars s;
  s.w1 = 1.0f - p.beta1;
  s.w2 = 1.0f - p.beta2;
  s.lr_wd = p.lr * p.weight_decay;
  s.decay = 1.0f - s.lr_wd;
  s.lr = p.lr;
  s.cautious = p.cautious;
  return s;
}

inline double Sq(float after, float before) {
  const double d = static_cast<double>(after) - static_cast<double>(before);
  return d * d;
}

// ---- kbw: the range kernels, vectorized (DIOND_CPU_CLONES, loops.h) -------------------------
// Each loops over one thread's range [0, n) of raw pointers; the ops below split the work.
// The tracked ones sum (Δx)² in double over kSumLanes lanes (loops.h).

DIOND_CPU_CLONES void AdamWRange(const math::AdamWScalars& s, const float* g, float* x, float* m,
                                 float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) math::AdamWElement(s, g[i], x[i], m[i], v[i]);
}

// lanes[l] += Σ (after − before)² over the elements j ≡ l (mod kSumLanes); n % kSumLanes == 0
// except for a range's last block. Only reads, so the lanes vectorize.
inline void AddSquaredChange(const float* after, const float* before, int64_t n, double* lanes) {
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) lanes[l] += Sq(after[j + l], before[j + l]);
  }
  for (int l = 0; j < n; ++j, ++l) lanes[l] += Sq(after[j], before[j]);
}

// A tracked step in L1-sized blocks: the block's x is kept, the block stepped by the untracked
// loop (vectorized), then its (Δx)² added up; each byte of x still comes from memory once.
inline constexpr int64_t kTrackBlock = 512;  // a multiple of kSumLanes

DIOND_CPU_CLONES double AdamWRangeTracked(const math::AdamWScalars& s, const float* g, float* x,
                                          float* m, float* v, int64_t n) {
  double lanes[kSumLanes] = {};
  float before[kTrackBlock];
  for (int64_t b = 0; b < n; b += kTrackBlock) {
    const int64_t len = n - b < kTrackBlock ? n - b : kTrackBlock;
    for (int64_t j = 0; j < len; ++j) before[j] = x[b + j];
    for (int64_t i = b; i < b + len; ++i) math::AdamWElement(s, g[i], x[i], m[i], v[i]);
    AddSquaredChange(x + b, before, len, lanes);
  }
  return SumLanes(lanes);
}

DIOND_CPU_CLONES void LionRange(const math::LionScalars& s, const float* g, float* x, float* m,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) math::LionElement(s, g[i], x[i], m[i]);
}

DIOND_CPU_CLONES double LionRangeTracked(const math::LionScalars& s, const float* g, float* x,
                                         float* m, int64_t n) {
  double lanes[kSumLanes] = {};
  float before[kTrackBlock];
  for (int64_t b = 0; b < n; b += kTrackBlock) {
    const int64_t len = n - b < kTrackBlock ? n - b : kTrackBlock;
    for (int64_t j = 0; j < len; ++j) before[j] = x[b + j];
    for (int64_t i = b; i < b + len; ++i) math::LionElement(s, g[i], x[i], m[i]);
    AddSquaredChange(x + b, before, len, lanes);
  }
  return SumLanes(lanes);
}

DIOND_CPU_CLONES void MomentumRange(float mu, bool nesterov, const float* g, const float* m_in,
                                    float* m, float* u, int64_t n) {
  if (nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      float mi = m_in[i];
      u[i] = math::MomentumElement(mu, true, g[i], mi);
      m[i] = mi;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float mi = m_in[i];
      u[i] = math::MomentumElement(mu, false, g[i], mi);
      m[i] = mi;
    }
  }
}

DIOND_CPU_CLONES void ApplyUpdateRange(const math::ApplyUpdateScalars& s, const float* u,
                                       const float* x_in, float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = math::ApplyUpdateElement(s, x_in[i], u[i]);
}

DIOND_CPU_CLONES double CopyWithChangeRange(const float* src, float* dst, int64_t n) {
  double lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      lanes[l] += Sq(src[i + l], dst[i + l]);
      dst[i + l] = src[i + l];
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    lanes[l] += Sq(src[i], dst[i]);
    dst[i] = src[i];
  }
  return SumLanes(lanes);
}

// DecayScatterWithChange's rows (element order within a row, kSumLanes lanes): a row outside
// the slices, and a selected row (kRows; s its update row). A row of a kCols matrix is a
// decayed row whose selected columns are then finished from their saved values.
DIOND_CPU_CLONES double DecayRowRange(float decay, float* x, int64_t n) {
  double lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const float v = math::DecayElement(decay, x[i + l]);
      lanes[l] += Sq(v, x[i + l]);
      x[i + l] = v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = math::DecayElement(decay, x[i]);
    lanes[l] += Sq(v, x[i]);
    x[i] = v;
  }
  return SumLanes(lanes);
}

DIOND_CPU_CLONES double DecayScatterRowRange(float decay, float alpha, const float* s, float* x,
                                             int64_t n) {
  double lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const float v = math::DecayScatterElement(decay, alpha, x[i + l], s[i + l]);
      lanes[l] += Sq(v, x[i + l]);
      x[i + l] = v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = math::DecayScatterElement(decay, alpha, x[i], s[i]);
    lanes[l] += Sq(v, x[i]);
    x[i] = v;
  }
  return SumLanes(lanes);
}

}  // namespace

absl::Status AdamWStep(const Context& ctx, const AdamWParams& p, ConstTensorView grad, TensorView x,
                       TensorView m, TensorView v) {
  cpu::ApplyThreadPolicy(ctx);
  const math::AdamWScalars s = AdamWScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    AdamWRange(s, gp + b, xp + b, mp + b, vp + b, e - b);
  });
  return absl::OkStatus();
}

absl::Status AdamWStepTracked(const Context& ctx, const AdamWParams& p, ConstTensorView grad,
                              TensorView x, TensorView m, TensorView v, TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const math::AdamWScalars s = AdamWScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  float* vp = v.As<float>();
  const float* gp = grad.As<float>();
  const double sq = cpu::ParallelSum(x.NumElements(), [&](int64_t b, int64_t e) {
    return AdamWRangeTracked(s, gp + b, xp + b, mp + b, vp + b, e - b);
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

absl::Status LionStep(const Context& ctx, const LionParams& p, ConstTensorView grad, TensorView x,
                      TensorView m) {
  cpu::ApplyThreadPolicy(ctx);
  const math::LionScalars s = LionScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  cpu::ParallelRange(x.NumElements(),
                     [&](int64_t b, int64_t e) { LionRange(s, gp + b, xp + b, mp + b, e - b); });
  return absl::OkStatus();
}

absl::Status LionStepTracked(const Context& ctx, const LionParams& p, ConstTensorView grad,
                             TensorView x, TensorView m, TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const math::LionScalars s = LionScalarsOf(p);
  float* xp = x.As<float>();
  float* mp = m.As<float>();
  const float* gp = grad.As<float>();
  const double sq = cpu::ParallelSum(x.NumElements(), [&](int64_t b, int64_t e) {
    return LionRangeTracked(s, gp + b, xp + b, mp + b, e - b);
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

absl::Status MomentumUpdate(const Context& ctx, float mu, bool nesterov, ConstTensorView grad,
                            ConstTensorView m_in, TensorView m, TensorView u) {
  cpu::ApplyThreadPolicy(ctx);
  const float* gp = grad.As<float>();
  const float* ip = m_in.As<float>();
  float* mp = m.As<float>();
  float* up = u.As<float>();
  cpu::ParallelRange(m.NumElements(), [&](int64_t b, int64_t e) {
    MomentumRange(mu, nesterov, gp + b, ip + b, mp + b, up + b, e - b);
  });
  return absl::OkStatus();
}

absl::Status ApplyUpdate(const Context& ctx, const ApplyUpdateParams& p, ConstTensorView update,
                         ConstTensorView x_in, TensorView x) {
  cpu::ApplyThreadPolicy(ctx);
  math::ApplyUpdateScalars s;
  s.alpha = p.alpha;
  s.lr_wd = p.lr_wd;
  s.decay = 1.0f - p.lr_wd;
  s.cautious = p.cautious;
  s.round_bf16 = p.round_bf16;
  const float* up = update.As<float>();
  const float* ip = x_in.As<float>();
  float* xp = x.As<float>();
  cpu::ParallelRange(x.NumElements(), [&](int64_t b, int64_t e) {
    ApplyUpdateRange(s, up + b, ip + b, xp + b, e - b);
  });
  return absl::OkStatus();
}

absl::Status NormalizeNeurons(const Context& ctx, float w, TensorView o, TensorView v) {
  cpu::ApplyThreadPolicy(ctx);
  const int r = o.rank();
  const int64_t batch = r == 3 ? o.dim(0) : 1;
  const int64_t rows = o.dim(r - 2), cols = o.dim(r - 1);
  const float fcols = static_cast<float>(cols);
  float* const op = o.As<float>();
  float* const vp = v.As<float>();
  // One unit per iteration. Each row sum (Σo², then ΣD²) in the row-sum order (RowSumF32, the
  // GPU's warp order); ‖O‖² and ‖D‖² of the unit are those row sums added in row order, as the
  // GPU adds them, so the result is the GPU's bit for bit and independent of the thread count.
  auto unit = [&](int64_t b) {
    float* u = op + b * rows * cols;
    float* vu = vp + b * rows;
    double f2 = 0.0, d2 = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
      float* row = u + i * cols;
      const double ss = cpu::RowSumF32(/*l1=*/false, row, cols);
      f2 += ss;
      vu[i] = math::NeuronVarianceElement(vu[i], ss, fcols, w);
      const float denom = math::NeuronDenominator(vu[i]);
      for (int64_t c = 0; c < cols; ++c) row[c] = row[c] / denom;
      d2 += cpu::RowSumF32(/*l1=*/false, row, cols);
    }
    const float scale = math::NeuronRescale(f2, d2);
    for (int64_t e = 0; e < rows * cols; ++e) u[e] *= scale;
  };
  if (batch > 1 && omp_get_max_threads() > 1 && rows * cols * batch >= cpu::kParallelGrain) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < batch; ++b) unit(b);
  } else {
    for (int64_t b = 0; b < batch; ++b) unit(b);
  }
  return absl::OkStatus();
}

absl::Status CopyWithChange(const Context& ctx, ConstTensorView src, TensorView dst,
                            TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const float* sp = src.As<float>();
  float* dp = dst.As<float>();
  const double sq = cpu::ParallelSum(dst.NumElements(), [&](int64_t b, int64_t e) {
    return CopyWithChangeRange(sp + b, dp + b, e - b);
  });
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

absl::Status DecayScatterWithChange(const Context& ctx, float decay, ConstTensorView src, Axis axis,
                                    absl::Span<const int64_t> indices, float alpha, TensorView x,
                                    TensorView update_sq) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t batch = x.rank() == 3 ? x.dim(0) : 1;
  const int64_t rows = x.dim(x.rank() - 2), cols = x.dim(x.rank() - 1);
  const int64_t k = static_cast<int64_t>(indices.size()) / batch;
  const bool by_rows = axis == Axis::kRows;
  // kRows: per row of every matrix, its slot in src, or -1.
  std::vector<int32_t> slot(static_cast<size_t>(by_rows ? batch * rows : 0), -1);
  if (by_rows) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < k; ++j) {
        slot[static_cast<size_t>(b * rows + indices[b * k + j])] = static_cast<int32_t>(j);
      }
    }
  }
  float* xp = x.As<float>();
  const float* sp = src.As<float>();
  const int64_t sub = by_rows ? k * cols : rows * k;  // src elements per matrix
  const double sq = cpu::ParallelSum(
      batch * rows,
      [&](int64_t r0, int64_t r1) {
        double acc = 0.0;
        std::vector<float> old(static_cast<size_t>(by_rows ? 0 : k));  // kCols: a row's selected
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = r / rows, i = r % rows;
          float* xrow = xp + r * cols;
          if (by_rows) {
            const int32_t j = slot[static_cast<size_t>(r)];
            acc += j < 0 ? DecayRowRange(decay, xrow, cols)
                         : DecayScatterRowRange(decay, alpha, sp + b * sub + j * cols, xrow, cols);
          } else {
            // The row decays in one vectorized pass (its Σ over every column); then each selected
            // column takes α·s on top of its decayed value, and its term of the sum is corrected
            // from the decayed change to the final one (values as the rows path; the sum differs
            // from element order in the last bits, as GPU.md's sums do).
            const int64_t* ib = indices.data() + b * k;
            const float* srow = sp + b * sub + i * k;
            for (int64_t j = 0; j < k; ++j) old[static_cast<size_t>(j)] = xrow[ib[j]];
            acc += DecayRowRange(decay, xrow, cols);
            for (int64_t j = 0; j < k; ++j) {
              const float before = old[static_cast<size_t>(j)];
              const float v = math::DecayScatterElement(decay, alpha, before, srow[j]);
              acc += Sq(v, before) - Sq(xrow[ib[j]], before);
              xrow[ib[j]] = v;
            }
          }
        }
        return acc;
      },
      std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(1, cols)));
  *update_sq.As<float>() = static_cast<float>(sq);
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
