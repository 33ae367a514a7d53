// Gemm and SymmetricProduct (kernels/ops.h) on the CPU: f32 on oneDNN or OpenBLAS (kAuto picks
// by shape, AutoGemmEngine), bf16 on oneDNN (Debian's OpenBLAS exports no cblas_sbgemm, TOOLCHAIN.md §12).
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

// kAuto's choices, measured with bench/gemm_engine_bench.cc (diond_bench
// --benchmark_filter=BM_F32, each shape OpenBLAS then oneDNN back to back, 2 threads, on the
// shared 2-core machine under load, so the absolute GFLOP/s are low; the time ratios
// oneDNN ÷ OpenBLAS, docs/BENCHMARKS.md "f32 engines"):
//   GEMM: 768³ 0.29; 768×3072×768 0.53; 3072×768×768 0.48; Gram 768×768×3072 (NT) 0.60,
//   (TN) 0.47; Dion's tall-skinny 768/3072 × 192: 0.46-0.59; 4 × 768³ batched 0.61;
//   2048³ 0.52; but 64³ 1.66 (oneDNN's per-call overhead) and 768×1×768 0.97.
//   Symmetric products (OpenBLAS ssyrk vs LowerBlocksOneDnnF32): 768×768 (k 768) 0.75;
//   768×768 (k 3072, X·Xᵀ) 0.72, (XᵀX) 0.47; 1024×1024 (k 1024) 0.81, (k 4096) 0.67;
//   4 × 768² 0.68; 2048² 0.60.
// So oneDNN, except for products below 128³ multiply-adds (a threshold between the two small
// shapes measured, not tuned) and for matrix-vector shapes, which stay on OpenBLAS. The older
// note that both run at the same speed (docs/BENCHMARKS.md, 2048³ ~210 GFLOP/s each) predates
// OPENBLAS_CORETYPE=Haswell on this machine; the quiet run measured 424 vs 252 GFLOP/s.
constexpr int64_t kOneDnnMinWork = int64_t{128} * 128 * 128;

Fp32GemmEngine AutoGemmEngine(int64_t m, int64_t n, int64_t k) {
  if (m == 1 || n == 1 || m * n * k < kOneDnnMinWork) return Fp32GemmEngine::kOpenBlas;
  return Fp32GemmEngine::kOneDnn;
}

// The f32 symmetric-product engine for an n×n result of inner size k: the context's choice, or
// under kAuto the measured faster one (above): kOneDnn is the lower block triangle of oneDNN
// GEMMs, kOpenBlas is ssyrk.
Fp32GemmEngine SymmetricEngine(const Context& ctx, int64_t n, int64_t k) {
  if (ctx.fp32_gemm_engine() != Fp32GemmEngine::kAuto) return ctx.fp32_gemm_engine();
  return n * n * k < 2 * kOneDnnMinWork ? Fp32GemmEngine::kOpenBlas : Fp32GemmEngine::kOneDnn;
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
  // kAuto: by shape (AutoGemmEngine).
  if (engine == Fp32GemmEngine::kAuto) engine = AutoGemmEngine(m, n, k);
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
// 16×16 tiles walked so that the writes are contiguous (row j of the upper part gets column j of
// the lower one). The earlier version walked 64×64 tiles with the writes down a column: with a
// row stride of 1024 floats (4 KiB) every write of a tile fell in the same L1 set, and the mirror
// took 19 % of a 1024² fp32 Polar Express call. Measured serially (standalone loop, 2-core
// machine under load, best of 20): 768² 0.73 → 0.11 ms, 1024² 3.5 → 0.24 ms, 3072² 32 → 6 ms.
// Serial on purpose: an OpenMP region measured no faster at these sizes, and slower when it
// competes with OpenBLAS's own threads (context.h threading policy).
void MirrorLowerToUpper(float* c, int64_t n, int64_t ldc) {
  constexpr int64_t kTile = 16;
  for (int64_t jb = 0; jb < n; jb += kTile) {
    const int64_t je = std::min(jb + kTile, n);
    for (int64_t ib = jb; ib < n; ib += kTile) {
      const int64_t ie = std::min(ib + kTile, n);
      for (int64_t j = jb; j < je; ++j) {
        float* out = c + j * ldc;
        for (int64_t i = std::max(ib, j + 1); i < ie; ++i) out[i] = c[i * ldc + j];
      }
    }
  }
}

namespace {

// The lower block triangle of C ← alpha·op(A)·op(A)ᵀ + beta·C with oneDNN f32 GEMMs on block
// pairs: row panel [i0, e) of C is P = op(A)[i0:e]·op(A)[0:e]ᵀ (r×e, a dense scratch panel, so
// that oneDNN keeps its fast kernel; a strided destination measured slower, see
// SymmetricProductBf16), then C[i0:e, 0:e] ← alpha·P + beta·C[i0:e, 0:e]. About half the
// flops of the full product (n²k/2 + n·block·k/2); the caller mirrors the lower triangle.
absl::Status LowerBlocksOneDnnF32(const Context& ctx, bool aat, float alpha, ConstTensorView a,
                                  float beta, float* c, int64_t ldc, int64_t n, int64_t block) {
  GemmParams p;
  p.engine = Fp32GemmEngine::kOneDnn;
  p.alpha = alpha;
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor panel, Tensor::Allocate(DType::kF32, {block * n}, &ctx.scratch()));
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t r = std::min(block, n - i0), e = i0 + r;
    TensorView pv = MakeView(panel.As<float>(), {r, e});
    if (aat) {  // rows of A
      p.trans_a = Trans::kNo;
      p.trans_b = Trans::kYes;
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, a.RowRange(i0, r), a.RowRange(0, e), pv));
    } else {    // columns of A (AᵀA)
      p.trans_a = Trans::kYes;
      p.trans_b = Trans::kNo;
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, a.ColRange(i0, r), a.ColRange(0, e), pv));
    }
    const float* ps = panel.As<float>();
    for (int64_t i = 0; i < r; ++i) {
      float* crow = c + (i0 + i) * ldc;
      const float* prow = ps + i * e;
      const int64_t len = i0 + i + 1;  // the lower triangle of this row
      if (beta == 0.0f) {
        std::memcpy(crow, prow, static_cast<size_t>(len) * sizeof(float));
      } else {
        for (int64_t j = 0; j < len; ++j) crow[j] = prow[j] + beta * crow[j];
      }
    }
  }
  return absl::OkStatus();
}

// Panel height of the oneDNN block scheme: a quarter of n rounded up to 64, at least 128.
int64_t SymmetricBlock(int64_t n) {
  const int64_t q = ((n + 3) / 4 + 63) / 64 * 64;
  return std::min(n, std::max<int64_t>(128, q));
}

}  // namespace

absl::Status SymmetricProduct(const Context& ctx, GramSide side, float alpha, ConstTensorView a,
                              float beta, TensorView c) {
  const bool aat = side == GramSide::kAAt;
  const int64_t n = aat ? a.Rows() : a.Cols(), k = aat ? a.Cols() : a.Rows();
  cpu::ApplyThreadPolicy(ctx);
  if (n == 0) return absl::OkStatus();
  const bool onednn = SymmetricEngine(ctx, n, k) == Fp32GemmEngine::kOneDnn;
  for (int64_t i = 0; i < c.Batch(); ++i) {
    const float* ap = reinterpret_cast<const float*>(BytePtr(a.data(), i, a.layout()));
    float* cp = const_cast<float*>(reinterpret_cast<const float*>(BytePtr(c.data(), i, c.layout())));
    const int64_t ldc = Ld(c.layout());
    if (k == 0) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j <= r; ++j) cp[r * ldc + j] = beta == 0.0f ? 0.0f : beta * cp[r * ldc + j];
      }
    } else if (onednn) {
      DIOND_RETURN_IF_ERROR(LowerBlocksOneDnnF32(ctx, aat, alpha, a.Matrix(i),
                                                 beta, cp, ldc, n, SymmetricBlock(n)));
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
