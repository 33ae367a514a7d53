// Every op (and, on the GPU, every update rule) on a device backend behind the plugin C ABI,
// against the CPU backend on the same inputs. Built twice (kernels/CMakeLists.txt):
//   * device_ops_test (CI): the host-memory TEST backend (kernels/testing/host_device_backend.h),
//     which runs the CPU's arithmetic, so every comparison is bit for bit; this proves the
//     adapter, the ABI records, the explicit copies and that the rules drive a device context
//     only through the ops API.
//   * cuda_ops_test (ctest label `gpu`, scripts/gpu-check.sh): the CUDA plugin. Elementwise,
//     fused, norm, top-k, gather/scatter and copy results must still be bit-identical (same
//     per-element functions, same summation order, --fmad=false); GEMM and factorization
//     results are compared with tolerances (cuBLAS/cuSOLVER sum in another order). Skips with
//     the reason when there is no plugin, driver or GPU.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/test_util.h"
#include "kernels/device_runtime.h"
#include "kernels/engine_choice.h"
#include "kernels/graph.h"
#include "kernels/ops.h"
#include "kernels/optim/group_optimizer.h"
#include "kernels/plugin/plugin_backend.h"
#if DIOND_TEST_CUDA
// Distinct suite names, so that ctest lists both binaries' cases.
#define DeviceOpsTest CudaOpsTest
#define DeviceRuleTest CudaRuleTest
#define DeviceGraphTest CudaGraphTest
#else
#include "kernels/testing/host_device_backend.h"
#define DeviceOpsTest HostDeviceOpsTest
#define DeviceRuleTest HostDeviceRuleTest
#define DeviceGraphTest HostDeviceGraphTest
#endif

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;

#if DIOND_TEST_CUDA
constexpr Device kDev{DeviceType::kCuda, 0};
constexpr bool kExactEverywhere = false;
#else
constexpr Device kDev{DeviceType::kTest, 0};
constexpr bool kExactEverywhere = true;
#endif

// Tolerance classes (absolute, on O(1) data) for the CUDA backend; 0 = bit for bit. kSum: a
// result that goes through a double sum which the GPU adds in another order than the CPU
// (update_sq, docs/GPU.md "Summation order"): the double sums
// agree to ~1e-15 relative, so the f32 result may be one ulp off; checked as a relative
// tolerance of 4 f32 ulps (RelTol below), exact on the TEST backend.
enum class Tol { kExact, kGemm, kFactor, kRule, kSum };
double TolValue(Tol t) {
  if (kExactEverywhere) return 0.0;
  switch (t) {
    case Tol::kExact:
      return 0.0;
    case Tol::kGemm:
      return 2e-5;
    case Tol::kFactor:
      return 2e-4;
    case Tol::kRule:
      return 5e-4;
    case Tol::kSum:
      return 4.0 * 0x1p-23;
  }
  return 0.0;
}

class DeviceOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if DIOND_TEST_CUDA
    absl::Status s = RegisterCudaOps(DIOND_CUDA_PLUGIN);
    if (!s.ok()) GTEST_SKIP() << "no CUDA device for the GPU test: " << s;
#else
    UnregisterOpsBackendForTest(DeviceType::kTest);
    ASSERT_THAT(RegisterPluginOps(DeviceType::kTest, testing::HostTestDeviceOps()), IsOk());
#endif
    auto stream = DeviceRuntimeFor(kDev.type).create_stream(kDev);
    ASSERT_THAT(stream.status(), IsOk());
    stream_ = *stream;
    ContextOptions o;
    o.device = kDev;
    o.stream = stream_;
    auto ctx = Context::Create(o);
    ASSERT_THAT(ctx.status(), IsOk());
    dev_ = std::move(*ctx);
    cpu_ = Context::CpuDefault();
  }
  void TearDown() override {
    dev_.reset();
    if (stream_ != nullptr) DeviceRuntimeFor(kDev.type).destroy_stream(kDev, stream_);
  }

  // A pair of buffers (device, CPU) holding the same values.
  struct Pair {
    Buffer d, h;
  };
  Pair Make(const std::vector<int64_t>& shape, uint32_t seed, DType dtype = DType::kF32,
            float scale = 1.0f) {
    Pair p;
    auto d = dev_->Allocate(dtype, shape);
    auto h = cpu_->Allocate(dtype, shape);
    EXPECT_THAT(d.status(), IsOk());
    EXPECT_THAT(h.status(), IsOk());
    p.d = std::move(*d);
    p.h = std::move(*h);
    const auto v = testing::RandomVector(p.h.NumElements(), seed, scale);
    if (dtype == DType::kF32) {
      std::memcpy(p.h.data(), v.data(), v.size() * 4);
    } else if (dtype == DType::kBf16) {
      const auto b = testing::ToBf16(v);
      std::memcpy(p.h.data(), b.data(), b.size() * 2);
    } else {
      for (size_t i = 0; i < v.size(); ++i) p.h.As<Float16>()[i] = FloatToF16(v[i]);
    }
    Upload(p);
    return p;
  }
  void Upload(Pair& p) {
    EXPECT_THAT(dev_->backend().copy_from_host(*dev_, p.h.data(), p.d.data(), p.h.bytes()), IsOk());
  }
  std::vector<float> Host(const Buffer& d) {
    std::vector<uint8_t> raw(d.bytes());
    EXPECT_THAT(dev_->backend().copy_to_host(*dev_, d.data(), raw.data(), raw.size()), IsOk());
    return Widen(raw.data(), d.dtype(), d.NumElements());
  }
  static std::vector<float> Widen(const void* p, DType t, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      out[i] = t == DType::kF32    ? static_cast<const float*>(p)[i]
               : t == DType::kBf16 ? Bf16ToFloat(static_cast<const BFloat16*>(p)[i])
                                   : F16ToFloat(static_cast<const Float16*>(p)[i]);
    }
    return out;
  }
  // Device result vs CPU result: bit for bit (NaN matches NaN) or within the class tolerance.
  void Expect(const Pair& p, Tol tol, const std::string& what) {
    const std::vector<float> got = Host(p.d);
    const std::vector<float> want = Widen(p.h.data(), p.h.dtype(), p.h.NumElements());
    const double t = TolValue(tol);
    double worst = 0.0;
    int64_t bad = -1;
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isnan(got[i]) && std::isnan(want[i])) continue;
      double e = std::fabs(static_cast<double>(got[i]) - want[i]);
      if (tol == Tol::kSum && want[i] != 0.0f) e /= std::fabs(static_cast<double>(want[i]));
      if (t == 0.0 ? std::memcmp(&got[i], &want[i], 4) != 0 : !(e <= t)) {
        if (bad < 0) bad = static_cast<int64_t>(i);
      }
      if (e > worst) worst = e;
    }
    EXPECT_LT(bad, 0) << what << ": first mismatch at " << bad << " (got "
                      << (bad >= 0 ? got[bad] : 0) << ", want " << (bad >= 0 ? want[bad] : 0)
                      << "), max |diff| " << worst << ", tolerance " << t;
  }

  StreamHandle stream_ = nullptr;
  std::unique_ptr<Context> dev_, cpu_;
};

TEST_F(DeviceOpsTest, Gemm) {
  struct G {
    std::vector<int64_t> a, b, c;
    bool ta, tb;
    DType in, out;
  };
  const std::vector<G> cases = {
      {{64, 16}, {16, 8}, {64, 8}, false, false, DType::kF32, DType::kF32},            // tall
      {{8, 40}, {40, 96}, {8, 96}, false, false, DType::kF32, DType::kF32},            // wide
      {{33, 21}, {17, 33}, {21, 17}, true, true, DType::kF32, DType::kF32},            // transposed
      {{4, 24, 12}, {12, 10}, {4, 24, 10}, false, false, DType::kF32, DType::kF32},    // broadcast
      {{3, 12, 20}, {3, 16, 20}, {3, 12, 16}, false, true, DType::kF32, DType::kF32},  // batched
      {{32, 48}, {48, 16}, {32, 16}, false, false, DType::kBf16, DType::kF32},  // bf16 → f32
      {{2, 16, 32}, {2, 24, 32}, {2, 16, 24}, false, true, DType::kBf16, DType::kBf16},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const G& g = cases[i];
    Pair a = Make(g.a, 1 + i, g.in), b = Make(g.b, 2 + i, g.in), c = Make(g.c, 3 + i, g.out);
    GemmParams p;
    p.trans_a = g.ta ? Trans::kYes : Trans::kNo;
    p.trans_b = g.tb ? Trans::kYes : Trans::kNo;
    p.alpha = 0.75f;
    p.beta = 0.5f;
    // oneDNN's bf16 matmul needs the AVX-512 core; the CPU refuses it at the call (the TEST
    // device, which queues, would report it at its next synchronization).
    if (g.in == DType::kBf16 && !CpuHasOneDnnBf16Matmul()) {
      EXPECT_THAT(Gemm(*cpu_, p, a.h.cview(), b.h.cview(), c.h.view()),
                  StatusIs(absl::StatusCode::kFailedPrecondition));
      continue;
    }
    ASSERT_THAT(Gemm(*dev_, p, a.d.cview(), b.d.cview(), c.d.view()), IsOk());
    ASSERT_THAT(Gemm(*cpu_, p, a.h.cview(), b.h.cview(), c.h.view()), IsOk());
    Expect(c, g.out == DType::kBf16 ? Tol::kFactor : Tol::kGemm, "gemm case " + std::to_string(i));
  }
  // A strided view: columns 3..13 of a wider matrix.
  Pair a = Make({20, 30}, 9), b = Make({10, 7}, 10), c = Make({20, 7}, 11);
  ASSERT_THAT(Gemm(*dev_, {}, a.d.cview().ColRange(3, 10), b.d.cview(), c.d.view()), IsOk());
  ASSERT_THAT(Gemm(*cpu_, {}, a.h.cview().ColRange(3, 10), b.h.cview(), c.h.view()), IsOk());
  Expect(c, Tol::kGemm, "strided gemm");
}

TEST_F(DeviceOpsTest, SymmetricProducts) {
  Pair a = Make({3, 12, 40}, 20), c = Make({3, 12, 12}, 21), d = Make({3, 40, 40}, 22);
  ASSERT_THAT(SymmetricProduct(*dev_, GramSide::kAAt, 1.0f, a.d.cview(), 0.0f, c.d.view()), IsOk());
  ASSERT_THAT(SymmetricProduct(*cpu_, GramSide::kAAt, 1.0f, a.h.cview(), 0.0f, c.h.view()), IsOk());
  Expect(c, Tol::kGemm, "syrk AAt");
  ASSERT_THAT(SymmetricProduct(*dev_, GramSide::kAtA, 0.5f, a.d.cview(), 0.0f, d.d.view()), IsOk());
  ASSERT_THAT(SymmetricProduct(*cpu_, GramSide::kAtA, 0.5f, a.h.cview(), 0.0f, d.h.view()), IsOk());
  Expect(d, Tol::kGemm, "syrk AtA");
  Pair b16 = Make({2, 40, 24}, 23, DType::kBf16), g = Make({2, 40, 40}, 24);
  if (!CpuHasOneDnnBf16Matmul()) {  // oneDNN's bf16 matmul, as in Gemm above
    EXPECT_THAT(SymmetricProductBf16(*cpu_, b16.h.cview(), 16, g.h.view()),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    return;
  }
  ASSERT_THAT(SymmetricProductBf16(*dev_, b16.d.cview(), 16, g.d.view()), IsOk());
  ASSERT_THAT(SymmetricProductBf16(*cpu_, b16.h.cview(), 16, g.h.view()), IsOk());
  Expect(g, Tol::kGemm, "bf16 blocked gram");
}

TEST_F(DeviceOpsTest, Factorizations) {
  Pair a = Make({3, 50, 8}, 30), q = Make({3, 50, 8}, 31), r = Make({3, 8, 8}, 32);
  ASSERT_THAT(ThinQr(*dev_, a.d.cview(), q.d.view(), r.d.view()), IsOk());
  ASSERT_THAT(ThinQr(*cpu_, a.h.cview(), q.h.view(), r.h.view()), IsOk());
  Expect(q, Tol::kFactor, "ThinQr Q");
  Expect(r, Tol::kFactor, "ThinQr R");
  ASSERT_THAT(CholeskyQr(*dev_, a.d.cview(), q.d.view(), r.d.view()), IsOk());
  ASSERT_THAT(CholeskyQr(*cpu_, a.h.cview(), q.h.view(), r.h.view()), IsOk());
  Expect(q, Tol::kFactor, "CholeskyQr Q");
  Expect(r, Tol::kFactor, "CholeskyQr R");
  Pair s = Make({16, 50}, 33, DType::kF32, 0.25f);
  ASSERT_THAT(RandomizedCholeskyQr(*dev_, a.d.cview(), s.d.cview(), q.d.view()), IsOk());
  ASSERT_THAT(RandomizedCholeskyQr(*cpu_, a.h.cview(), s.h.cview(), q.h.view()), IsOk());
  Expect(q, Tol::kFactor, "RandomizedCholeskyQr");
  // Rank-deficient: FAILED_PRECONDITION on the device as on the CPU.
  Pair z = Make({20, 4}, 34);
  ASSERT_THAT(Fill(*dev_, 1.0f, z.d.view()), IsOk());
  Pair zq = Make({20, 4}, 35);
  EXPECT_THAT(CholeskyQr(*dev_, z.d.cview(), zq.d.view()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(DeviceOpsTest, ReductionsAndSelectionAreBitIdentical) {
  for (DType t : {DType::kF32, DType::kBf16}) {
    Pair a = Make({2, 30, 17}, 40, t), rows = Make({60}, 41), cols = Make({34}, 42),
         fro = Make({2}, 43);
    ASSERT_THAT(AxisNorms(*dev_, a.d.cview(), Axis::kRows, NormType::kL2, rows.d.view()), IsOk());
    ASSERT_THAT(AxisNorms(*cpu_, a.h.cview(), Axis::kRows, NormType::kL2, rows.h.view()), IsOk());
    Expect(rows, Tol::kExact, "row norms");
    ASSERT_THAT(AxisNorms(*dev_, a.d.cview(), Axis::kCols, NormType::kL1, cols.d.view()), IsOk());
    ASSERT_THAT(AxisNorms(*cpu_, a.h.cview(), Axis::kCols, NormType::kL1, cols.h.view()), IsOk());
    Expect(cols, Tol::kExact, "col norms");
    ASSERT_THAT(FrobeniusNorm(*dev_, a.d.cview(), fro.d.view()), IsOk());
    ASSERT_THAT(FrobeniusNorm(*cpu_, a.h.cview(), fro.h.view()), IsOk());
    Expect(fro, Tol::kExact, "frobenius");
  }
  // Top-k of the columns of a 1×300 matrix (scores |v_j|) with ties, ±0 and NaN: the full order.
  std::vector<float> v = testing::RandomVector(300, 44);
  for (size_t i = 0; i < v.size(); i += 7) v[i] = std::round(v[i]);
  v[3] = NAN;
  v[4] = -0.0f;
  v[5] = 0.0f;
  v[6] = -v[8];
  Pair s = Make({1, 300}, 45), s_sc = Make({300}, 49);
  std::memcpy(s.h.data(), v.data(), v.size() * 4);
  Upload(s);
  std::vector<int64_t> got(300), want(300);
  ASSERT_THAT(
      TopKByL1Norm(*dev_, s.d.cview(), Axis::kCols, 300, absl::MakeSpan(got), s_sc.d.view()),
      IsOk());
  ASSERT_THAT(
      TopKByL1Norm(*cpu_, s.h.cview(), Axis::kCols, 300, absl::MakeSpan(want), s_sc.h.view()),
      IsOk());
  EXPECT_EQ(got, want);
  Expect(s_sc, Tol::kExact, "|v| scores");
  Pair m = Make({40, 25}, 46, DType::kBf16), sc = Make({25}, 47);
  std::vector<int64_t> g5(5), w5(5);
  ASSERT_THAT(TopKByL1Norm(*dev_, m.d.cview(), Axis::kCols, 5, absl::MakeSpan(g5), sc.d.view()),
              IsOk());
  ASSERT_THAT(TopKByL1Norm(*cpu_, m.h.cview(), Axis::kCols, 5, absl::MakeSpan(w5), sc.h.view()),
              IsOk());
  EXPECT_EQ(g5, w5);
  Expect(sc, Tol::kExact, "L1 scores");
  bool dz = false, hz = true;
  Pair zero = Make({3, 4}, 48);
  ASSERT_THAT(Fill(*dev_, -0.0f, zero.d.view()), IsOk());
  ASSERT_THAT(IsAllZero(*dev_, zero.d.cview(), &dz), IsOk());
  EXPECT_TRUE(dz);
  ASSERT_THAT(IsAllZero(*dev_, m.d.cview(), &hz), IsOk());
  EXPECT_FALSE(hz);
}

// Row sums, a warp per row on the GPU (docs/GPU.md "Design"): rows of awkward lengths (1,
// 31, 32, 33, 160, 768, 1000), one row and thousands, a padded row stride, f32/bf16/f16, against
// the CPU bit for bit: AxisNorms by rows (L1, L2, Σx²), FrobeniusNorm, TopKByL1Norm's scores and
// order. Rows of testing::OrderProbeRow make the summation order visible in the f32 result (the
// row-sum order gives 1 + 2^-23, index order 1). On the TEST backend this is the CPU against
// itself; it checks the CUDA kernels in cuda_ops_test (label gpu), which runs on a GPU only.
TEST_F(DeviceOpsTest, RowSumsOfAwkwardLengthsAreBitIdentical) {
  struct Shape {
    int64_t batch, rows, cols;
  };
  for (const Shape sh :
       {Shape{1, 1, 1}, Shape{2, 3, 31}, Shape{1, 7, 32}, Shape{3, 5, 33}, Shape{2, 4, 160},
        Shape{1, 768, 768}, Shape{1, 3, 1000}, Shape{1, 5000, 3}}) {
    for (const DType t : {DType::kF32, DType::kBf16, DType::kF16}) {
      for (const int64_t pad : {int64_t{0}, int64_t{3}}) {
        const int64_t ld = sh.cols + pad, n = sh.batch * sh.rows;
        const std::string c = " " + std::to_string(sh.batch) + "x" + std::to_string(sh.rows) + "x" +
                              std::to_string(sh.cols) + " pad " + std::to_string(pad) + " dtype " +
                              std::to_string(static_cast<int>(t));
        Pair a = Make({n * ld}, 200 + static_cast<uint32_t>(sh.cols), t);
        if (sh.cols >= 160 && t != DType::kF16) {
          // Row 0 probes Σ|x|, row 1 Σx² (f16 cannot hold their small terms).
          for (int64_t r = 0; r < 2; ++r) {
            const std::vector<float> probe = testing::OrderProbeRow(sh.cols, r == 1);
            for (int64_t j = 0; j < sh.cols; ++j) {
              if (t == DType::kF32) {
                a.h.As<float>()[r * ld + j] = probe[j];
              } else {
                a.h.As<BFloat16>()[r * ld + j] = FloatToBf16(probe[j]);
              }
            }
          }
          Upload(a);
        }
        TensorLayout l = ContiguousLayout(t, {sh.batch, sh.rows, sh.cols});
        l.strides[1] = ld;
        l.strides[0] = sh.rows * ld;
        const ConstTensorView dv(a.d.data(), l, kDev), hv(a.h.data(), l);
        for (const NormType norm : {NormType::kL1, NormType::kL2, NormType::kSumOfSquares}) {
          Pair out = Make({n}, 201);
          ASSERT_THAT(AxisNorms(*dev_, dv, Axis::kRows, norm, out.d.view()), IsOk());
          ASSERT_THAT(AxisNorms(*cpu_, hv, Axis::kRows, norm, out.h.view()), IsOk());
          Expect(out, Tol::kExact, "row norms " + std::to_string(static_cast<int>(norm)) + c);
          if (sh.cols >= 160 && t != DType::kF16 && norm != NormType::kL2) {
            const float want = 1.0f + 0x1p-23f;
            EXPECT_EQ(out.h.As<float>()[norm == NormType::kL1 ? 0 : 1], want) << c;
          }
        }
        Pair fro = Make({sh.batch}, 202);
        ASSERT_THAT(FrobeniusNorm(*dev_, dv, fro.d.view()), IsOk());
        ASSERT_THAT(FrobeniusNorm(*cpu_, hv, fro.h.view()), IsOk());
        Expect(fro, Tol::kExact, "frobenius" + c);
        if (sh.batch == 1 && t != DType::kF16) {  // TopKByL1Norm: rank 2, f32 or bf16
          const TensorLayout l2 = [&] {
            TensorLayout m = ContiguousLayout(t, {sh.rows, sh.cols});
            m.strides[0] = ld;
            return m;
          }();
          const int64_t k = sh.rows;
          std::vector<int64_t> got(static_cast<size_t>(k)), want(static_cast<size_t>(k));
          Pair sc = Make({sh.rows}, 203);
          ASSERT_THAT(TopKByL1Norm(*dev_, ConstTensorView(a.d.data(), l2, kDev), Axis::kRows, k,
                                   absl::MakeSpan(got), sc.d.view()),
                      IsOk());
          ASSERT_THAT(TopKByL1Norm(*cpu_, ConstTensorView(a.h.data(), l2), Axis::kRows, k,
                                   absl::MakeSpan(want), sc.h.view()),
                      IsOk());
          EXPECT_EQ(got, want) << c;
          Expect(sc, Tol::kExact, "top-k scores" + c);
        }
      }
    }
  }
}

TEST_F(DeviceOpsTest, GatherScatterCopyAreBitIdentical) {
  Pair a = Make({2, 12, 9}, 50, DType::kBf16), g = Make({2, 12, 3}, 51);
  const std::vector<int64_t> idx = {8, 2, 5};
  ASSERT_THAT(Gather(*dev_, a.d.cview(), Axis::kCols, idx, g.d.view()), IsOk());
  ASSERT_THAT(Gather(*cpu_, a.h.cview(), Axis::kCols, idx, g.h.view()), IsOk());
  Expect(g, Tol::kExact, "gather cols");
  ASSERT_THAT(Scatter(*dev_, g.d.cview(), Axis::kCols, idx, 0.5f, 1.0f, a.d.view()), IsOk());
  ASSERT_THAT(Scatter(*cpu_, g.h.cview(), Axis::kCols, idx, 0.5f, 1.0f, a.h.view()), IsOk());
  Expect(a, Tol::kExact, "scatter cols");
  Pair r = Make({3, 9}, 52);
  const std::vector<int64_t> ridx = {11, 0, 4};
  Pair a2 = Make({12, 9}, 53);
  ASSERT_THAT(Gather(*dev_, a2.d.cview(), Axis::kRows, ridx, r.d.view()), IsOk());
  ASSERT_THAT(Gather(*cpu_, a2.h.cview(), Axis::kRows, ridx, r.h.view()), IsOk());
  Expect(r, Tol::kExact, "gather rows");
  ASSERT_THAT(Scatter(*dev_, r.d.cview(), Axis::kRows, ridx, -1.0f, 0.0f, a2.d.view()), IsOk());
  ASSERT_THAT(Scatter(*cpu_, r.h.cview(), Axis::kRows, ridx, -1.0f, 0.0f, a2.h.view()), IsOk());
  Expect(a2, Tol::kExact, "scatter rows");
  // Copy of a transpose into bf16, and f16 widening.
  Pair t = Make({9, 12}, 54, DType::kBf16);
  ASSERT_THAT(Copy(*dev_, a2.d.cview().Transposed(), t.d.view()), IsOk());
  ASSERT_THAT(Copy(*cpu_, a2.h.cview().Transposed(), t.h.view()), IsOk());
  Expect(t, Tol::kExact, "transposed copy");
  Pair f16 = Make({9, 12}, 55, DType::kF16), w = Make({9, 12}, 56);
  ASSERT_THAT(Copy(*dev_, f16.d.cview(), w.d.view()), IsOk());
  ASSERT_THAT(Copy(*cpu_, f16.h.cview(), w.h.view()), IsOk());
  Expect(w, Tol::kExact, "f16 widening");
}

TEST_F(DeviceOpsTest, ElementwiseAndFusedAreBitIdentical) {
  const std::vector<int64_t> shape = {7, 33};
  for (DType t : {DType::kF32, DType::kBf16}) {
    Pair x = Make(shape, 60, t), y = Make(shape, 61, t), o = Make(shape, 62, t);
    ASSERT_THAT(Axpby(*dev_, 0.3f, x.d.cview(), -1.7f, y.d.cview(), o.d.view()), IsOk());
    ASSERT_THAT(Axpby(*cpu_, 0.3f, x.h.cview(), -1.7f, y.h.cview(), o.h.view()), IsOk());
    Expect(o, Tol::kExact, "axpby");
    ASSERT_THAT(AddScalar(*dev_, 1.5f, x.d.cview(), 1e-3f, o.d.view()), IsOk());
    ASSERT_THAT(AddScalar(*cpu_, 1.5f, x.h.cview(), 1e-3f, o.h.view()), IsOk());
    Expect(o, Tol::kExact, "add_scalar");
    for (UnaryOp u : {UnaryOp::kSign, UnaryOp::kAbs, UnaryOp::kSqrt, UnaryOp::kSquare,
                      UnaryOp::kNeg, UnaryOp::kNanToNum}) {
      ASSERT_THAT(Unary(*dev_, u, x.d.cview(), o.d.view()), IsOk());
      ASSERT_THAT(Unary(*cpu_, u, x.h.cview(), o.h.view()), IsOk());
      Expect(o, Tol::kExact, "unary " + std::to_string(static_cast<int>(u)));
    }
    Pair col = Make({7, 1}, 63);
    for (BinaryOp b : {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul, BinaryOp::kDiv,
                       BinaryOp::kMax, BinaryOp::kMin}) {
      ASSERT_THAT(Binary(*dev_, b, x.d.cview(), col.d.cview(), o.d.view()), IsOk());
      ASSERT_THAT(Binary(*cpu_, b, x.h.cview(), col.h.cview(), o.h.view()), IsOk());
      Expect(o, Tol::kExact, "binary broadcast " + std::to_string(static_cast<int>(b)));
    }
    ASSERT_THAT(Fill(*dev_, 0.1f, o.d.view()), IsOk());
    ASSERT_THAT(Fill(*cpu_, 0.1f, o.h.view()), IsOk());
    Expect(o, Tol::kExact, "fill");
  }
  Pair g = Make({1000}, 64), x = Make({1000}, 65), m = Make({1000}, 66), v = Make({1000}, 67);
  ASSERT_THAT(Unary(*dev_, UnaryOp::kSquare, v.d.cview(), v.d.view()), IsOk());
  ASSERT_THAT(Unary(*cpu_, UnaryOp::kSquare, v.h.cview(), v.h.view()), IsOk());
  AdamWParams ap;
  ap.lr = 1e-3f;
  ap.weight_decay = 0.1f;
  ap.step = 5;
  for (bool cautious : {false, true}) {
    ap.cautious = cautious;
    ASSERT_THAT(AdamWStep(*dev_, ap, g.d.cview(), x.d.view(), m.d.view(), v.d.view()), IsOk());
    ASSERT_THAT(AdamWStep(*cpu_, ap, g.h.cview(), x.h.view(), m.h.view(), v.h.view()), IsOk());
    Expect(x, Tol::kExact, "adamw x");
    Expect(m, Tol::kExact, "adamw m");
    Expect(v, Tol::kExact, "adamw v");
  }
  LionParams lp;
  lp.lr = 1e-4f;
  lp.weight_decay = 0.5f;
  ASSERT_THAT(LionStep(*dev_, lp, g.d.cview(), x.d.view(), m.d.view()), IsOk());
  ASSERT_THAT(LionStep(*cpu_, lp, g.h.cview(), x.h.view(), m.h.view()), IsOk());
  Expect(x, Tol::kExact, "lion x");
  Expect(m, Tol::kExact, "lion m");
}

// kops's fused optimizer phases. Sizes stay under the CPU's parallel grain (2^15 elements), so
// the CPU sums update_sq in element order whatever its thread count, as the TEST backend does.
TEST_F(DeviceOpsTest, TrackedStepsAreBitIdentical) {
  const int64_t n = 3000;
  Pair g = Make({n}, 100), x = Make({n}, 101), m = Make({n}, 102), v = Make({n}, 103),
       sq = Make({1}, 104);
  ASSERT_THAT(Unary(*dev_, UnaryOp::kSquare, v.d.cview(), v.d.view()), IsOk());
  ASSERT_THAT(Unary(*cpu_, UnaryOp::kSquare, v.h.cview(), v.h.view()), IsOk());
  AdamWParams ap;
  ap.lr = 1e-2f;
  ap.weight_decay = 0.1f;
  ap.step = 3;
  for (bool cautious : {false, true}) {
    ap.cautious = cautious;
    const std::string c = cautious ? " (cautious)" : "";
    ASSERT_THAT(AdamWStep(*dev_, ap, g.d.cview(), x.d.view(), m.d.view(), v.d.view(), sq.d.view()),
                IsOk());
    ASSERT_THAT(AdamWStep(*cpu_, ap, g.h.cview(), x.h.view(), m.h.view(), v.h.view(), sq.h.view()),
                IsOk());
    Expect(x, Tol::kExact, "tracked adamw x" + c);
    Expect(m, Tol::kExact, "tracked adamw m" + c);
    Expect(v, Tol::kExact, "tracked adamw v" + c);
    Expect(sq, Tol::kSum, "tracked adamw update_sq" + c);
    EXPECT_GT(sq.h.As<float>()[0], 0.0f);
  }
  LionParams lp;
  lp.lr = 1e-3f;
  lp.weight_decay = 0.5f;
  for (bool cautious : {false, true}) {
    lp.cautious = cautious;
    const std::string c = cautious ? " (cautious)" : "";
    ASSERT_THAT(LionStep(*dev_, lp, g.d.cview(), x.d.view(), m.d.view(), sq.d.view()), IsOk());
    ASSERT_THAT(LionStep(*cpu_, lp, g.h.cview(), x.h.view(), m.h.view(), sq.h.view()), IsOk());
    Expect(x, Tol::kExact, "tracked lion x" + c);
    Expect(m, Tol::kExact, "tracked lion m" + c);
    Expect(sq, Tol::kSum, "tracked lion update_sq" + c);
    EXPECT_GT(sq.h.As<float>()[0], 0.0f);
  }
}

TEST_F(DeviceOpsTest, MomentumAndApplyUpdateAreBitIdentical) {
  const std::vector<int64_t> shape = {37, 53};
  Pair g = Make(shape, 110), state = Make(shape, 111), m = Make(shape, 112), u = Make(shape, 113),
       x = Make(shape, 114), x2 = Make(shape, 115);
  for (bool nesterov : {false, true}) {
    const std::string c = nesterov ? " (nesterov)" : "";
    // Out of place (m_in the persistent state, m its staged copy), then in place.
    ASSERT_THAT(MomentumUpdate(*dev_, 0.95f, nesterov, g.d.cview(), state.d.cview(), m.d.view(),
                               u.d.view()),
                IsOk());
    ASSERT_THAT(MomentumUpdate(*cpu_, 0.95f, nesterov, g.h.cview(), state.h.cview(), m.h.view(),
                               u.h.view()),
                IsOk());
    Expect(m, Tol::kExact, "momentum m" + c);
    Expect(u, Tol::kExact, "momentum u" + c);
    Expect(state, Tol::kExact, "momentum m_in untouched" + c);
    ASSERT_THAT(
        MomentumUpdate(*dev_, 0.9f, nesterov, g.d.cview(), m.d.cview(), m.d.view(), u.d.view()),
        IsOk());
    ASSERT_THAT(
        MomentumUpdate(*cpu_, 0.9f, nesterov, g.h.cview(), m.h.cview(), m.h.view(), u.h.view()),
        IsOk());
    Expect(m, Tol::kExact, "momentum in place m" + c);
    Expect(u, Tol::kExact, "momentum in place u" + c);
  }
  for (bool cautious : {false, true}) {
    for (bool round_bf16 : {false, true}) {
      ApplyUpdateParams p;
      p.alpha = 0.37f;
      p.lr_wd = 0.02f * 0.1f;
      p.cautious = cautious;
      p.round_bf16 = round_bf16;
      const std::string c = std::string(cautious ? " cautious" : "") + (round_bf16 ? " bf16" : "");
      ASSERT_THAT(ApplyUpdate(*dev_, p, u.d.cview(), x.d.cview(), x2.d.view()), IsOk());
      ASSERT_THAT(ApplyUpdate(*cpu_, p, u.h.cview(), x.h.cview(), x2.h.view()), IsOk());
      Expect(x2, Tol::kExact, "apply_update out of place" + c);
      ASSERT_THAT(ApplyUpdate(*dev_, p, u.d.cview(), x.d.cview(), x.d.view()), IsOk());
      ASSERT_THAT(ApplyUpdate(*cpu_, p, u.h.cview(), x.h.cview(), x.h.view()), IsOk());
      Expect(x, Tol::kExact, "apply_update in place" + c);
    }
  }
}

// graph: the fused steps with their scalar record in device memory (ops.h `scalars_on_device`,
// the plugin's *_dev entries), called through the table as kernels/graph.h calls them, equal the
// CPU's eager ops; the params' own fields are set to nonsense, so only the record can give the
// right bits. (That a replayed graph reads the record when it runs is step_graph_test's.)
TEST_F(DeviceOpsTest, DeviceScalarFormsOfTheFusedStepsAreBitIdentical) {
  const int64_t n = 2500;
  Pair g = Make({n}, 120), x = Make({n}, 121), m = Make({n}, 122), v = Make({n}, 123),
       sq = Make({1}, 124), u = Make({n}, 125);
  ASSERT_THAT(Unary(*dev_, UnaryOp::kSquare, v.d.cview(), v.d.view()), IsOk());
  ASSERT_THAT(Unary(*cpu_, UnaryOp::kSquare, v.h.cview(), v.h.view()), IsOk());
  auto record = dev_->Allocate(DType::kF32, {16});
  ASSERT_THAT(record.status(), IsOk());
  auto put = [&](const void* rec, size_t bytes) {
    ASSERT_THAT(dev_->backend().copy_from_host(*dev_, rec, record->data(), bytes), IsOk());
  };
  const OpsBackend& be = dev_->backend();
  for (bool tracked : {false, true}) {
    for (bool cautious : {false, true}) {
      const std::string c = std::string(tracked ? " tracked" : "") + (cautious ? " cautious" : "");
      AdamWParams ap;
      ap.lr = 2e-2f;
      ap.weight_decay = 0.1f;
      ap.step = 4;
      ap.cautious = cautious;
      const AdamWScalarRecord ar = ScalarRecordOf(ap);
      put(&ar, sizeof(ar));
      AdamWParams ad = ap;
      ad.lr = 99.0f;  // ignored: the record rules
      ad.scalars_on_device = static_cast<const AdamWScalarRecord*>(record->data());
      ASSERT_THAT(tracked
                      ? be.adamw_step_tracked(*dev_, ad, g.d.cview(), x.d.view(), m.d.view(),
                                              v.d.view(), sq.d.view())
                      : be.adamw_step(*dev_, ad, g.d.cview(), x.d.view(), m.d.view(), v.d.view()),
                  IsOk());
      ASSERT_THAT(tracked ? AdamWStep(*cpu_, ap, g.h.cview(), x.h.view(), m.h.view(), v.h.view(),
                                      sq.h.view())
                          : AdamWStep(*cpu_, ap, g.h.cview(), x.h.view(), m.h.view(), v.h.view()),
                  IsOk());
      Expect(x, Tol::kExact, "adamw_step_dev x" + c);
      Expect(m, Tol::kExact, "adamw_step_dev m" + c);
      Expect(v, Tol::kExact, "adamw_step_dev v" + c);
      if (tracked) Expect(sq, Tol::kSum, "adamw_step_dev update_sq" + c);
      LionParams lp;
      lp.lr = 1e-3f;
      lp.weight_decay = 0.5f;
      lp.cautious = cautious;
      const LionScalarRecord lr = ScalarRecordOf(lp);
      put(&lr, sizeof(lr));
      LionParams ld = lp;
      ld.lr = 99.0f;
      ld.scalars_on_device = static_cast<const LionScalarRecord*>(record->data());
      ASSERT_THAT(tracked ? be.lion_step_tracked(*dev_, ld, g.d.cview(), x.d.view(), m.d.view(),
                                                 sq.d.view())
                          : be.lion_step(*dev_, ld, g.d.cview(), x.d.view(), m.d.view()),
                  IsOk());
      ASSERT_THAT(tracked ? LionStep(*cpu_, lp, g.h.cview(), x.h.view(), m.h.view(), sq.h.view())
                          : LionStep(*cpu_, lp, g.h.cview(), x.h.view(), m.h.view()),
                  IsOk());
      Expect(x, Tol::kExact, "lion_step_dev x" + c);
      Expect(m, Tol::kExact, "lion_step_dev m" + c);
      if (tracked) Expect(sq, Tol::kSum, "lion_step_dev update_sq" + c);
      ApplyUpdateParams up;
      up.alpha = -0.3f;
      up.lr_wd = 0.002f;
      up.cautious = cautious;
      up.round_bf16 = tracked;  // both roundings
      const ApplyUpdateScalarRecord ur = ScalarRecordOf(up);
      put(&ur, sizeof(ur));
      ApplyUpdateParams ud = up;
      ud.alpha = 99.0f;
      ud.scalars_on_device = static_cast<const ApplyUpdateScalarRecord*>(record->data());
      ASSERT_THAT(be.apply_update(*dev_, ud, u.d.cview(), x.d.cview(), x.d.view()), IsOk());
      ASSERT_THAT(ApplyUpdate(*cpu_, up, u.h.cview(), x.h.cview(), x.h.view()), IsOk());
      Expect(x, Tol::kExact, "apply_update_dev" + c);
    }
  }
}

TEST_F(DeviceOpsTest, NormalizeNeuronsMatches) {
  // Rank 2 and batches of units, rows around the 32 lanes, one 768×768 unit; w below and above
  // 0.5 (the two lerp branches).
  for (std::vector<int64_t> shape :
       {std::vector<int64_t>{24, 70}, std::vector<int64_t>{3, 17, 40}, std::vector<int64_t>{1, 1},
        std::vector<int64_t>{3, 33, 31}, std::vector<int64_t>{5, 2, 32},
        std::vector<int64_t>{2, 9, 33}, std::vector<int64_t>{768, 768}}) {
    const int64_t units = shape.size() == 3 ? shape[0] : 1;
    const int64_t rows = shape[shape.size() - 2];
    Pair o = Make(shape, 120), v = Make({units * rows}, 121);
    ASSERT_THAT(Unary(*dev_, UnaryOp::kSquare, v.d.cview(), v.d.view()), IsOk());
    ASSERT_THAT(Unary(*cpu_, UnaryOp::kSquare, v.h.cview(), v.h.view()), IsOk());
    for (float w : {0.05f, 0.75f}) {
      const std::string c = " rank " + std::to_string(shape.size()) + " w " + std::to_string(w);
      ASSERT_THAT(NormalizeNeurons(*dev_, w, o.d.view(), v.d.view()), IsOk());
      ASSERT_THAT(NormalizeNeurons(*cpu_, w, o.h.view(), v.h.view()), IsOk());
      // Every sum in the CPU's order (row sums a warp per row, a unit's in row order): exact.
      Expect(v, Tol::kExact, "normalize_neurons v" + c);
      Expect(o, Tol::kExact, "normalize_neurons o" + c);
    }
  }
}

TEST_F(DeviceOpsTest, CopyWithChangeIsBitIdentical) {
  Pair src = Make({41, 29}, 130), dst = Make({41, 29}, 131), sq = Make({1}, 132);
  ASSERT_THAT(CopyWithChange(*dev_, src.d.cview(), dst.d.view(), sq.d.view()), IsOk());
  ASSERT_THAT(CopyWithChange(*cpu_, src.h.cview(), dst.h.view(), sq.h.view()), IsOk());
  Expect(dst, Tol::kExact, "copy_with_change dst");
  Expect(sq, Tol::kSum, "copy_with_change update_sq");
  EXPECT_GT(sq.h.As<float>()[0], 0.0f);
  // Again: nothing changes now, so the change is exactly +0.
  ASSERT_THAT(CopyWithChange(*dev_, src.d.cview(), dst.d.view(), sq.d.view()), IsOk());
  ASSERT_THAT(CopyWithChange(*cpu_, src.h.cview(), dst.h.view(), sq.h.view()), IsOk());
  Expect(sq, Tol::kExact, "copy_with_change no change");
  EXPECT_EQ(Host(sq.d)[0], 0.0f);
}

TEST_F(DeviceOpsTest, DecayScatterWithChangeIsBitIdentical) {
  // Both axes, a batch of 3 matrices with their own indices; x in place on both sides.
  for (const Axis axis : {Axis::kRows, Axis::kCols}) {
    const int64_t batch = 3, rows = 23, cols = 37;
    const int64_t len = axis == Axis::kRows ? rows : cols, k = 6;
    const int64_t sr = axis == Axis::kRows ? k : rows, sc = axis == Axis::kRows ? cols : k;
    Pair x = Make({batch, rows, cols}, 133), src = Make({batch, sr, sc}, 134), sq = Make({1}, 135);
    std::vector<int64_t> idx;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < k; ++j) idx.push_back((5 * j + b) % len);
    }
    const std::string c = axis == Axis::kRows ? " rows" : " cols";
    ASSERT_THAT(DecayScatterWithChange(*dev_, 0.995f, src.d.cview(), axis, idx, -0.02f, x.d.view(),
                                       sq.d.view()),
                IsOk());
    ASSERT_THAT(DecayScatterWithChange(*cpu_, 0.995f, src.h.cview(), axis, idx, -0.02f, x.h.view(),
                                       sq.h.view()),
                IsOk());
    Expect(x, Tol::kExact, "decay_scatter_with_change x" + c);
    Expect(sq, Tol::kSum, "decay_scatter_with_change update_sq" + c);
    EXPECT_GT(sq.h.As<float>()[0], 0.0f);
  }
}

TEST_F(DeviceOpsTest, OrthogonalizerOpsAreBitIdentical) {
  Pair x = Make({9, 40}, 70), y = Make({9, 40}, 71), o = Make({9, 40}, 72);
  for (float alpha : {0.0f, -1.25f}) {
    ASSERT_THAT(Bf16RoundedAxpby(*dev_, alpha, x.d.cview(), 3.4445f, y.d.cview(), o.d.view()),
                IsOk());
    ASSERT_THAT(Bf16RoundedAxpby(*cpu_, alpha, x.h.cview(), 3.4445f, y.h.cview(), o.h.view()),
                IsOk());
    Expect(o, Tol::kExact, "bf16_rounded_axpby alpha " + std::to_string(alpha));
  }
  for (std::vector<int64_t> shape : {std::vector<int64_t>{12, 12}, std::vector<int64_t>{3, 8, 8}}) {
    Pair s = Make(shape, 73);
    ASSERT_THAT(AddToDiagonal(*dev_, 0.75f, s.d.view()), IsOk());
    ASSERT_THAT(AddToDiagonal(*cpu_, 0.75f, s.h.view()), IsOk());
    Expect(s, Tol::kExact, "add_to_diagonal rank " + std::to_string(shape.size()));
  }
}

// Every update rule through GroupOptimizer on a device context (parameters, gradients and state
// in device memory) against the same rule on the CPU: bit for bit on the TEST backend, within
// kRule on the GPU. (kernels/optim/device_step_test covers the variants, in strict mode.)
class DeviceRuleTest : public DeviceOpsTest,
                       public ::testing::WithParamInterface<optim::AlgorithmKind> {};

TEST_P(DeviceRuleTest, ThreeStepsMatchTheCpu) {
  optim::GroupConfig config;
  config.algorithm = GetParam();
  config.hyperparams.lr = 0.02;
  config.hyperparams.rank_fraction = 0.5;
  config.seed = 7;
  const std::vector<optim::ParamShape> shapes = {{32, 48}, {32, 48}, {24, 16}};
  auto dev_opt = optim::CreateGroupOptimizer(*dev_, config, shapes);
  auto cpu_opt = optim::CreateGroupOptimizer(*cpu_, config, shapes);
  ASSERT_THAT(dev_opt.status(), IsOk());
  ASSERT_THAT(cpu_opt.status(), IsOk());
  std::vector<Pair> params, grads;
  for (size_t i = 0; i < shapes.size(); ++i) params.push_back(Make(shapes[i], 70 + i));
  for (int step = 0; step < 3; ++step) {
    grads.clear();
    for (size_t i = 0; i < shapes.size(); ++i) grads.push_back(Make(shapes[i], 80 + 10 * step + i));
    std::vector<float*> dp, hp;
    std::vector<const float*> dg, hg;
    for (size_t i = 0; i < shapes.size(); ++i) {
      dp.push_back(params[i].d.As<float>());
      hp.push_back(params[i].h.As<float>());
      dg.push_back(grads[i].d.As<float>());
      hg.push_back(grads[i].h.As<float>());
    }
    ASSERT_THAT((*dev_opt)->Step(*dev_, dp, dg), IsOk()) << "step " << step;
    ASSERT_THAT((*cpu_opt)->Step(*cpu_, hp, hg), IsOk()) << "step " << step;
  }
  const bool elementwise =
      GetParam() == optim::AlgorithmKind::kAdamW || GetParam() == optim::AlgorithmKind::kLion;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Expect(params[i], elementwise ? Tol::kExact : Tol::kRule,
           std::string(optim::AlgorithmName(GetParam())) + " param " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, DeviceRuleTest,
    ::testing::Values(optim::AlgorithmKind::kMuon, optim::AlgorithmKind::kNorMuon,
                      optim::AlgorithmKind::kDion, optim::AlgorithmKind::kDion2,
                      optim::AlgorithmKind::kNorDion2, optim::AlgorithmKind::kAdamW,
                      optim::AlgorithmKind::kLion),
    [](const ::testing::TestParamInfo<optim::AlgorithmKind>& i) {
      return std::string(optim::AlgorithmName(i.param));
    });

// graph (docs/GPU.md "CUDA graphs"): the update of the capturable rules through kernels::StepGraph
// on this device (captured, then replayed with a new learning rate each step) against the same
// optimizer stepped eagerly on it: bit for bit on the TEST backend (its capture is emulated); on
// a GPU exact for AdamW/Lion, within kRule for the matrix rules (a library may pick other
// algorithms under capture). On a GPU this is the check that the real capture of cuBLAS and the
// *_dev kernels works: a fallback fails the test with its reason.
class DeviceGraphTest : public DeviceOpsTest,
                        public ::testing::WithParamInterface<optim::AlgorithmKind> {};

TEST_P(DeviceGraphTest, ReplayedUpdatesMatchTheEagerStep) {
  optim::GroupConfig config;
  config.algorithm = GetParam();
  config.hyperparams = optim::DefaultHyperparams(GetParam());
  config.hyperparams.weight_decay = 0.05;
  const std::vector<optim::ParamShape> shapes = {{32, 48}, {32, 48}, {24, 16}};
  auto graph_opt = optim::CreateGroupOptimizer(*dev_, config, shapes);
  auto eager_opt = optim::CreateGroupOptimizer(*dev_, config, shapes);
  ASSERT_THAT(graph_opt.status(), IsOk());
  ASSERT_THAT(eager_opt.status(), IsOk());
  std::vector<Pair> xg, xe, g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    xg.push_back(Make(shapes[i], 170 + i));
    xe.push_back(Make(shapes[i], 170 + i));
    g.push_back(Make(shapes[i], 180 + i));
  }
  GraphHooks hooks;
  const DeviceRuntime& rt = DeviceRuntimeFor(kDev.type);
  hooks.begin_capture = rt.begin_capture;
  hooks.end_capture = rt.end_capture;
  hooks.launch = rt.launch_graph;
  hooks.destroy = rt.destroy_graph;
  StepGraph sg(dev_.get(), hooks);
  std::vector<float*> pg, pe;
  std::vector<const float*> gg;
  for (size_t i = 0; i < shapes.size(); ++i) {
    pg.push_back(xg[i].d.As<float>());
    pe.push_back(xe[i].d.As<float>());
    gg.push_back(g[i].d.As<float>());
  }
  constexpr int kSteps = 6;
  for (int step = 1; step <= kSteps; ++step) {
    // New gradients in the same buffers (as a session's staging).
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto v = testing::RandomVector(g[i].h.NumElements(), 190 + 10 * step + i);
      std::memcpy(g[i].h.data(), v.data(), v.size() * 4);
      Upload(g[i]);
    }
    optim::StepOptions o;
    o.lr = 0.02 / step;
    if (step == 1) {
      ASSERT_THAT((*graph_opt)->Stage(*dev_, pg, gg, o), IsOk());
    } else {
      auto out = sg.Run([&] { return (*graph_opt)->Stage(*dev_, pg, gg, o); });
      ASSERT_THAT(out.status(), IsOk());
      ASSERT_NE(out->mode, StepGraph::Mode::kEager) << out->reason << ": " << out->detail;
    }
    (*graph_opt)->WriteStagedParams(pg);
    (*graph_opt)->CommitStagedState();
    ASSERT_THAT((*eager_opt)->Stage(*dev_, pe, gg, o), IsOk());
    (*eager_opt)->WriteStagedParams(pe);
    (*eager_opt)->CommitStagedState();
  }
  EXPECT_EQ(sg.captures(), 2);  // the staged state's two forms
  EXPECT_EQ(sg.replays(), kSteps - 3);
  const bool elementwise =
      GetParam() == optim::AlgorithmKind::kAdamW || GetParam() == optim::AlgorithmKind::kLion;
#if DIOND_TEST_CUDA
  const Tol tol = elementwise ? Tol::kExact : Tol::kRule;
#else
  const Tol tol = Tol::kExact;
  (void)elementwise;
#endif
  for (size_t i = 0; i < shapes.size(); ++i) {
    // The eager run's parameters as the reference.
    const std::vector<float> want = Host(xe[i].d);
    std::memcpy(xg[i].h.data(), want.data(), want.size() * 4);
    Expect(xg[i], tol,
           std::string(optim::AlgorithmName(GetParam())) + " graph param " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, DeviceGraphTest,
                         ::testing::Values(optim::AlgorithmKind::kMuon,
                                           optim::AlgorithmKind::kNorMuon,
                                           optim::AlgorithmKind::kAdamW,
                                           optim::AlgorithmKind::kLion),
                         [](const ::testing::TestParamInfo<optim::AlgorithmKind>& i) {
                           return std::string(optim::AlgorithmName(i.param));
                         });

}  // namespace
}  // namespace diond::kernels
