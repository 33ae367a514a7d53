// Gemm and SymmetricProduct (kernels/ops.h) on the CPU: OpenBLAS for f32 (or oneDNN), oneDNN
// for bf16 (Debian's OpenBLAS exports no cblas_sbgemm, TOOLCHAIN.md §12).
#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "common/status_macros.h"
#include "kernels/cpu/onednn_matmul.h"
#include "kernels/cpu/threading.h"
#include "kernels/cpu/backend.h"

namespace diond::kernels::cpu {
namespace {

// Leading dimension for BLAS: must be >= max(1, cols) even for a single row.
int64_t Ld(const TensorLayout& l) {
  const int64_t cols = std::max<int64_t>(l.Cols(), 1);
  return l.Rows() <= 1 ? std::max(l.RowStride(), cols) : l.RowStride();
}

const char* BytePtr(const void* p, int64_t b, const TensorLayout& l) {
  return static_cast<const char*>(p) +
         b * l.BatchStride() * static_cast<int64_t>(DTypeSize(l.dtype));
}

// C ← beta·C for k == 0 (no product term), any C dtype.
absl::Status ScaleOnly(const Context& ctx, float beta, TensorView c) {
  for (int64_t b = 0; b < c.Batch(); ++b) {
    TensorView cm = c.Matrix(b);
    for (int64_t i = 0; i < cm.Rows(); ++i) {
      TensorView row = cm.RowRange(i, 1);
      TensorLayout l = ContiguousLayout(c.dtype(), {cm.Cols()});
      TensorView r(row.data(), l);
      if (beta == 0.0f) {
        DIOND_RETURN_IF_ERROR(cpu::Fill(ctx, 0.0f, r));
      } else {
        DIOND_RETURN_IF_ERROR(cpu::Axpby(ctx, beta, r, 0.0f, ConstTensorView(), r));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Gemm(const Context& ctx, const GemmParams& p, ConstTensorView a, ConstTensorView b,
                  TensorView c) {
  const bool ta = p.trans_a == Trans::kYes, tb = p.trans_b == Trans::kYes;
  const int64_t m = ta ? a.Cols() : a.Rows(), ka = ta ? a.Rows() : a.Cols();
  const int64_t n = tb ? b.Rows() : b.Cols();
  const int64_t batch = c.Batch();
  const bool f32 = a.dtype() == DType::kF32 && b.dtype() == DType::kF32 &&
                   c.dtype() == DType::kF32;
  cpu::ApplyThreadPolicy(ctx);
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  const int64_t k = ka;
  if (k == 0) return ScaleOnly(ctx, p.beta, c);

  Fp32GemmEngine engine = p.engine != Fp32GemmEngine::kAuto ? p.engine : ctx.fp32_gemm_engine();
  // kAuto: OpenBLAS. oneDNN 2.6's f32 matmul measured the same as OpenBLAS here (docs/
  // BENCHMARKS.md, 2048³: ~105 / ~210 GFLOP/s at 1 / 2 threads for both), and staying on
  // OpenBLAS keeps f32 work (GEMM, SYRK, LAPACK) on one thread pool.
  if (engine == Fp32GemmEngine::kAuto) engine = Fp32GemmEngine::kOpenBlas;
  if (f32 && engine == Fp32GemmEngine::kOpenBlas) {
    for (int64_t i = 0; i < batch; ++i) {
      const float* ap = reinterpret_cast<const float*>(BytePtr(a.data(), a.Batch() == 1 ? 0 : i,
                                                               a.layout()));
      const float* bp = reinterpret_cast<const float*>(BytePtr(b.data(), b.Batch() == 1 ? 0 : i,
                                                               b.layout()));
      float* cp = const_cast<float*>(
          reinterpret_cast<const float*>(BytePtr(c.data(), i, c.layout())));
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), p.alpha, ap,
                  static_cast<int>(Ld(a.layout())), bp, static_cast<int>(Ld(b.layout())), p.beta,
                  cp, static_cast<int>(Ld(c.layout())));
    }
    return absl::OkStatus();
  }
  cpu::MatmulShape s;
  s.m = m;
  s.n = n;
  s.k = k;
  s.a_type = a.dtype();
  s.b_type = b.dtype();
  s.c_type = c.dtype();
  const int64_t lda = Ld(a.layout()), ldb = Ld(b.layout()), ldc = Ld(c.layout());
  s.a_strides[0] = ta ? 1 : lda;
  s.a_strides[1] = ta ? lda : 1;
  s.b_strides[0] = tb ? 1 : ldb;
  s.b_strides[1] = tb ? ldb : 1;
  s.c_strides[0] = ldc;
  s.c_strides[1] = 1;
  s.alpha = p.alpha;
  s.beta = p.beta;
  DIOND_ASSIGN_OR_RETURN(auto mm, cpu::OneDnnMatmul::Create(s));
  for (int64_t i = 0; i < batch; ++i) {
    DIOND_RETURN_IF_ERROR(mm->Execute(BytePtr(a.data(), a.Batch() == 1 ? 0 : i, a.layout()),
                                      BytePtr(b.data(), b.Batch() == 1 ? 0 : i, b.layout()),
                                      const_cast<char*>(BytePtr(c.data(), i, c.layout()))));
  }
  return absl::OkStatus();
}

// Copies the lower triangle of the n×n matrix at c (row stride ldc) onto the upper one, in
// 64×64 tiles so that both the read and the write side stay in cache. Serial on purpose: it runs
// between OpenBLAS calls, and an OpenMP region there measured slower (the two thread pools then
// compete for the cores, context.h threading policy).
void MirrorLowerToUpper(float* c, int64_t n, int64_t ldc) {
  constexpr int64_t kTile = 64;
  for (int64_t ib = 0; ib < n; ib += kTile) {
    for (int64_t jb = 0; jb <= ib; jb += kTile) {
      const int64_t ie = std::min(ib + kTile, n), je = std::min(jb + kTile, n);
      for (int64_t i = ib; i < ie; ++i) {
        for (int64_t j = jb; j < std::min(je, i); ++j) c[j * ldc + i] = c[i * ldc + j];
      }
    }
  }
}

absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c) {
  const bool aat = side == GramSide::kAAt;
  const int64_t n = aat ? a.Rows() : a.Cols(), k = aat ? a.Cols() : a.Rows();
  cpu::ApplyThreadPolicy(ctx);
  if (n == 0) return absl::OkStatus();
  for (int64_t i = 0; i < c.Batch(); ++i) {
    const float* ap = reinterpret_cast<const float*>(BytePtr(a.data(), i, a.layout()));
    float* cp = const_cast<float*>(reinterpret_cast<const float*>(BytePtr(c.data(), i, c.layout())));
    const int64_t ldc = Ld(c.layout());
    if (k == 0) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j <= r; ++j) cp[r * ldc + j] = beta == 0.0f ? 0.0f : beta * cp[r * ldc + j];
      }
    } else {
      cblas_ssyrk(CblasRowMajor, CblasLower, aat ? CblasNoTrans : CblasTrans, static_cast<int>(n),
                  static_cast<int>(k), alpha, ap, static_cast<int>(Ld(a.layout())), beta, cp,
                  static_cast<int>(ldc));
    }
    cpu::MirrorLowerToUpper(cp, n, ldc);
  }
  return absl::OkStatus();
}

// Panel by panel (ops.h). Measured on the target machine (bench/symmetric_bench.cc, under
// load): oneDNN 2.6 ran the earlier block-pair version, whose GEMMs wrote a block of C in place
// (a destination row stride larger than its width), on its generic gemm:jit kernel at ~5
// GFLOP/s; with a dense destination it picks brg:avx512_core_bf16. Even so, the panels' 5/8 to
// 2/3 of the FLOPs take about as long as the full GEMM at 1 thread (768²: 1.1-1.2x, 768×3072:
// 0.9-1.0x, 2048²: 1.1-1.3x): the smaller GEMMs run at lower efficiency.
absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t n = a.Rows();
  if (n == 0 || c.Batch() == 0) return absl::OkStatus();
  block = std::min(block, n);
  GemmParams p;
  p.trans_b = Trans::kYes;
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor panel, Tensor::Allocate(DType::kF32, {block * n}, &ctx.scratch()));
  for (int64_t bi = 0; bi < c.Batch(); ++bi) {
    ConstTensorView am = a.Matrix(bi);
    TensorView cm = c.Matrix(bi);
    for (int64_t i0 = 0; i0 < n; i0 += block) {
      const int64_t r = std::min(block, n - i0), e = i0 + r;
      // P = A[0:e]·A[i0:e]ᵀ (e×r): its transpose is C[i0:e, 0:e]. The small operand is the
      // GEMM's weights, which oneDNN packs on every call.
      TensorView pv = MakeView(panel.As<float>(), {e, r});
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, am.RowRange(0, e), am.RowRange(i0, r), pv));
      DIOND_RETURN_IF_ERROR(
          cpu::Copy(ctx, ConstTensorView(pv).Transposed(), cm.RowRange(i0, r).ColRange(0, e)));
    }
    const int64_t ldc = cm.layout().RowStride();
    MirrorLowerToUpper(static_cast<float*>(cm.data()), n, ldc);
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
