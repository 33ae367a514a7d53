// Gemm and SymmetricProduct (kernels/ops.h) on the CPU: f32 on oneDNN or OpenBLAS (kAuto picks
// by shape and by the start-up calibration, AutoGemmEngine), bf16 on oneDNN (Debian's OpenBLAS
// exports no cblas_sbgemm, TOOLCHAIN.md §12).
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/onednn_matmul.h"
#include "kernels/cpu/threading.h"
#include "kernels/engine_choice.h"

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
// shapes measured, not tuned) and for matrix-vector shapes, which stay on OpenBLAS. Those ratios
// hold for OpenBLAS on its AVX2/AVX-512 kernels; on another machine (or a generic core) the
// large-product engine is what the start-up calibration measured faster (CurrentAutoEngines,
// kernels/engine_calibration.h; oneDNN until one ran). The older
// note that both run at the same speed (docs/BENCHMARKS.md, 2048³ ~210 GFLOP/s each) predates
// OPENBLAS_CORETYPE=Haswell on this machine; the quiet run measured 424 vs 252 GFLOP/s.
constexpr int64_t kOneDnnMinWork = int64_t{128} * 128 * 128;

Fp32GemmEngine AutoGemmEngine(int64_t m, int64_t n, int64_t k) {
  if (m == 1 || n == 1 || m * n * k < kOneDnnMinWork) return Fp32GemmEngine::kOpenBlas;
  return CurrentAutoEngines().fp32_gemm;
}

// The f32 symmetric-product engine for an n×n result of inner size k: the context's choice, or
// under kAuto the measured faster one (above): kOneDnn is the lower block triangle of oneDNN
// GEMMs, kOpenBlas is ssyrk.
Fp32GemmEngine SymmetricEngine(const Context& ctx, int64_t n, int64_t k) {
  if (ctx.fp32_gemm_engine() != Fp32GemmEngine::kAuto) return ctx.fp32_gemm_engine();
  return n * n * k < 2 * kOneDnnMinWork ? Fp32GemmEngine::kOpenBlas
                                        : CurrentAutoEngines().fp32_symmetric;
}

}  // namespace

absl::Status Gemm(const Context& ctx, const GemmParams& p, ConstTensorView a, ConstTensorView b,
                  TensorView c) {
  const bool ta = p.trans_a == Trans::kYes, tb = p.trans_b == Trans::kYes;
  const int64_t m = ta ? a.Cols() : a.Rows(), ka = ta ? a.Rows() : a.Cols();
  const int64_t n = tb ? b.Rows() : b.Cols();
  const int64_t batch = c.Batch();
  const bool f32 = a.dtype() == DType::kF32 && b.dtype() == DType::kF32 && c.dtype() == DType::kF32;
  cpu::ApplyThreadPolicy(ctx);
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  const int64_t k = ka;
  if (k == 0) return ScaleOnly(ctx, p.beta, c);

  Fp32GemmEngine engine = p.engine != Fp32GemmEngine::kAuto ? p.engine : ctx.fp32_gemm_engine();
  // kAuto: by shape (AutoGemmEngine).
  if (engine == Fp32GemmEngine::kAuto) engine = AutoGemmEngine(m, n, k);
  if (f32 && engine == Fp32GemmEngine::kOpenBlas) {
    for (int64_t i = 0; i < batch; ++i) {
      const float* ap =
          reinterpret_cast<const float*>(BytePtr(a.data(), a.Batch() == 1 ? 0 : i, a.layout()));
      const float* bp =
          reinterpret_cast<const float*>(BytePtr(b.data(), b.Batch() == 1 ? 0 : i, b.layout()));
      float* cp =
          const_cast<float*>(reinterpret_cast<const float*>(BytePtr(c.data(), i, c.layout())));
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
// the lower one). Not 64×64 tiles with the writes down a column: with a row stride of 1024 floats
// (4 KiB) every write of such a tile falls in the same L1 set, and that mirror took 19 % of a
// 1024² fp32 Polar Express call. Measured serially (standalone loop, 2-core machine under load,
// best of 20), column-wise 64×64 → these tiles: 768² 0.73 → 0.11 ms, 1024² 3.5 → 0.24 ms,
// 3072² 32 → 6 ms.
// Serial on purpose: an OpenMP region measured no faster at these sizes, and slower when it
// competes with OpenBLAS's own threads (context.h threading policy). T: float or BFloat16 (the
// bits are copied, never converted).
template <typename T>
void MirrorLower(T* c, int64_t n, int64_t ldc) {
  constexpr int64_t kTile = 16;
  for (int64_t jb = 0; jb < n; jb += kTile) {
    const int64_t je = std::min(jb + kTile, n);
    for (int64_t ib = jb; ib < n; ib += kTile) {
      const int64_t ie = std::min(ib + kTile, n);
      for (int64_t j = jb; j < je; ++j) {
        T* out = c + j * ldc;
        for (int64_t i = std::max(ib, j + 1); i < ie; ++i) out[i] = c[i * ldc + j];
      }
    }
  }
}

void MirrorLowerToUpper(float* c, int64_t n, int64_t ldc) { MirrorLower(c, n, ldc); }

namespace {

// The lower triangle of C ← alpha·op(A)·op(A)ᵀ + beta·C (one matrix; op(A) = A for kAAt, Aᵀ
// for kAtA; n×n) in column panels of `block` columns, each one oneDNN GEMM into a dense scratch
// panel of C's dtype: panel [j0, e) is P = alpha·op(A)[j0:n]·op(A)[j0:e]ᵀ ((n − j0)×r, r = e −
// j0), whose row i holds C[j0 + i, j0:e]; its entries on and below the diagonal are copied into
// C (beta == 0) or added (C ← P + beta·C, f32 C only). The caller mirrors the lower triangle.
// (nb + 1) / (2·nb) of the full product's flops for nb panels.
//
// Why this shape: each panel GEMM writes a dense destination, so oneDNN 2.6 keeps its brgemm
// kernel (a destination row stride wider than the panel sends it to the generic gemm:jit, ~5
// GFLOP/s); and for A·Aᵀ of a row-major A, every entry of a panel is bit for bit the full
// product's (oneDNN accumulates each entry along k in the same order whatever the m and n of
// the call, and its A·Aᵀ is exactly symmetric; gemm_test checks both on the machine it runs
// on), so the bf16 orthogonalizer can use it without changing a bit. In bf16, column panels
// measured slightly faster than row panels ([i0, e) × [0, e)) on the target machine, and both
// 1.3-1.7x faster than the full product at n = 768-1024; in f32 the two orientations measured
// the same (docs/BENCHMARKS.md, "Half-work Gram products").
template <typename T>
absl::Status LowerColumnPanels(const Context& ctx, bool aat, float alpha, ConstTensorView a,
                               float beta, T* c, int64_t ldc, int64_t block) {
  const int64_t n = aat ? a.Rows() : a.Cols();
  const DType ct = std::is_same_v<T, float> ? DType::kF32 : DType::kBf16;
  GemmParams p;
  p.engine = Fp32GemmEngine::kOneDnn;
  p.alpha = alpha;
  p.trans_a = aat ? Trans::kNo : Trans::kYes;
  p.trans_b = aat ? Trans::kYes : Trans::kNo;
  ScratchArena::Scope scope(ctx.scratch());
  DIOND_ASSIGN_OR_RETURN(Tensor panel, Tensor::Allocate(ct, {n * block}, &ctx.scratch()));
  T* ps = static_cast<T*>(panel.data());
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t r = std::min(block, n - j0), h = n - j0;
    TensorView pv = MakeView(ps, {h, r});
    if (aat) {
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, a.RowRange(j0, h), a.RowRange(j0, r), pv));
    } else {
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, a.ColRange(j0, h), a.ColRange(j0, r), pv));
    }
    for (int64_t i = 0; i < h; ++i) {
      T* crow = c + (j0 + i) * ldc + j0;
      const T* prow = ps + i * r;
      const int64_t len = std::min(r, i + 1);  // on and below the diagonal
      if (beta == 0.0f) {
        std::memcpy(crow, prow, static_cast<size_t>(len) * sizeof(T));
      } else if constexpr (std::is_same_v<T, float>) {
        for (int64_t j = 0; j < len; ++j) crow[j] = prow[j] + beta * crow[j];
      }
    }
  }
  return absl::OkStatus();
}

// Panel width of SymmetricProduct's f32 oneDNN scheme: a quarter of n rounded up to 64, at least
// 128 (a sweep of 128, 256, 384 and n put the quarter panels at or near the best,
// docs/BENCHMARKS.md "f32 engines").
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
    float* cp =
        const_cast<float*>(reinterpret_cast<const float*>(BytePtr(c.data(), i, c.layout())));
    const int64_t ldc = Ld(c.layout());
    if (k == 0) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j <= r; ++j)
          cp[r * ldc + j] = beta == 0.0f ? 0.0f : beta * cp[r * ldc + j];
      }
    } else if (onednn) {
      DIOND_RETURN_IF_ERROR(
          LowerColumnPanels(ctx, aat, alpha, a.Matrix(i), beta, cp, ldc, SymmetricBlock(n)));
    } else {
      cblas_ssyrk(CblasRowMajor, CblasLower, aat ? CblasNoTrans : CblasTrans, static_cast<int>(n),
                  static_cast<int>(k), alpha, ap, static_cast<int>(Ld(a.layout())), beta, cp,
                  static_cast<int>(ldc));
    }
    cpu::MirrorLowerToUpper(cp, n, ldc);
  }
  return absl::OkStatus();
}

namespace {

// Whether LowerColumnPanels gives the full bf16 GEMM's bits for A·Aᵀ of an n×k A with row stride
// lda and `block` columns, into a C of `ct`, at the context's thread count. On AVX-512 cores
// oneDNN 2.6 accumulates each entry along k in one order whatever the call's m and n; its AMX
// kernels block k by the call's shape (measured on a Sapphire Rapids core: a contiguous 200×2000
// A differs in about 60 % of the f32 entries, a padded row stride in none). So each shape is
// checked once per process, on seeded values, against the full product, in f32 (a bf16 C rounds
// most differences away on one set of values and not on the next) and in C's dtype; a shape
// that differs gets the full GEMM. The check costs one full and one half product of the shape.
bool PanelsAreTheFullProduct(const Context& ctx, int64_t n, int64_t k, int64_t lda, int64_t block,
                             DType ct) {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int, DType>;
  static std::mutex mu;
  static auto* known = new std::map<Key, bool>();
  const Key key{n, k, lda, block, ctx.num_threads(), ct};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = known->find(key); it != known->end()) return it->second;
  }
  std::vector<BFloat16> a(static_cast<size_t>(n * lda));
  uint32_t x = 12345;
  for (BFloat16& v : a) {  // uniform in [-1, 1), a 32-bit LCG
    x = x * 1664525u + 1013904223u;
    v = FloatToBf16(static_cast<float>(x >> 8) / 8388608.0f - 1.0f);
  }
  TensorLayout al = ContiguousLayout(DType::kBf16, {n, k});
  al.strides[0] = lda;
  const ConstTensorView av(a.data(), al);
  GemmParams p;
  p.trans_b = Trans::kYes;
  bool same = true;
  for (DType t : {DType::kF32, ct}) {
    const size_t es = DTypeSize(t);
    std::vector<uint8_t> half(static_cast<size_t>(n * n) * es), full(half.size());
    absl::Status s =
        cpu::Gemm(ctx, p, av, av, TensorView(full.data(), ContiguousLayout(t, {n, n})));
    if (s.ok()) {
      s = t == DType::kBf16 ? LowerColumnPanels(ctx, true, 1.0f, av, 0.0f,
                                                reinterpret_cast<BFloat16*>(half.data()), n, block)
                            : LowerColumnPanels(ctx, true, 1.0f, av, 0.0f,
                                                reinterpret_cast<float*>(half.data()), n, block);
    }
    same = same && s.ok();
    for (int64_t i = 0; i < n && same; ++i) {  // the lower triangle the panels wrote
      const size_t row = static_cast<size_t>(i * n) * es;
      same =
          std::memcmp(half.data() + row, full.data() + row, static_cast<size_t>(i + 1) * es) == 0;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  (*known)[key] = same;
  return same;
}

// Whether oneDNN runs its AMX kernels here. Their full bf16 GEMM outruns the panels
// (docs/BENCHMARKS.md "Half-work Gram products": the panels at 0.58-1.07 of its speed with a
// bf16 C on a Sapphire Rapids core), so there SymmetricProductBf16 is the full GEMM.
bool OneDnnUsesAmx() {
  static const bool amx = [] {
    const int isa = static_cast<int>(dnnl_get_effective_cpu_isa());
    return (isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx;
  }();
  return amx;
}

}  // namespace

// Column panels of `block` columns, at least 16 (LowerColumnPanels), f32 or bf16 C, mirrored
// (ops.h); the full GEMM on AMX cores, and where the panels would not give its bits
// (PanelsAreTheFullProduct).
absl::Status SymmetricProductBf16(const Context& ctx, ConstTensorView a, int64_t block,
                                  TensorView c) {
  cpu::ApplyThreadPolicy(ctx);
  const int64_t n = a.Rows();
  if (n == 0 || c.Batch() == 0) return absl::OkStatus();
  // Panels at least 16 columns wide: oneDNN computes a one-column product with another kernel
  // whose f32 sums differ from the full product's in the last bit (gemm_test, block 1).
  block = std::min(std::max<int64_t>(block, 16), n);
  if (OneDnnUsesAmx() ||
      !PanelsAreTheFullProduct(ctx, n, a.Cols(), Ld(a.layout()), block, c.dtype())) {
    GemmParams p;
    p.trans_b = Trans::kYes;
    for (int64_t bi = 0; bi < c.Batch(); ++bi) {
      DIOND_RETURN_IF_ERROR(cpu::Gemm(ctx, p, a.Matrix(bi), a.Matrix(bi), c.Matrix(bi)));
    }
    return absl::OkStatus();
  }
  for (int64_t bi = 0; bi < c.Batch(); ++bi) {
    TensorView cm = c.Matrix(bi);
    const int64_t ldc = Ld(cm.layout());
    if (c.dtype() == DType::kBf16) {
      auto* cp = static_cast<BFloat16*>(cm.data());
      DIOND_RETURN_IF_ERROR(LowerColumnPanels(ctx, true, 1.0f, a.Matrix(bi), 0.0f, cp, ldc, block));
      MirrorLower(cp, n, ldc);
    } else {
      auto* cp = static_cast<float*>(cm.data());
      DIOND_RETURN_IF_ERROR(LowerColumnPanels(ctx, true, 1.0f, a.Matrix(bi), 0.0f, cp, ldc, block));
      MirrorLower(cp, n, ldc);
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::cpu
