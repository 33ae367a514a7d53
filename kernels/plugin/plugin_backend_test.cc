// The plugin adapter (plugin_backend.h) over the host-memory TEST backend
// (kernels/testing/host_device_backend.h): the public ops on a kTest Context go through the
// OpsBackend adapter, the C ABI records and back, and must give the CPU backend's results bit for
// bit; device memory is only reached through explicit copies; every op is queued on the
// session's stream; the pool accounts for every byte and refuses an over-budget allocation with
// RESOURCE_EXHAUSTED naming the numbers; a plugin's error codes become the right Status.
#include "kernels/plugin/plugin_backend.h"

#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/test_util.h"
#include "kernels/device_runtime.h"
#include "kernels/ops.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::kernels {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

constexpr Device kDev{DeviceType::kTest, 0};

class PluginBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_THAT(device_.status(), IsOk());
    testing::ResetHostTestDevice(0);
    auto sc = testing::HostTestStreamContext::Create(kDev);
    ASSERT_THAT(sc.status(), IsOk());
    sc_ = std::move(*sc);
    ctx_ = &sc_->ctx();
    stream_ = sc_->stream();
    cpu_ = Context::CpuDefault(1);
  }
  void TearDown() override {
    ctx_ = nullptr;
    sc_.reset();
  }
  testing::ScopedHostTestDevice device_{/*strict=*/false};

  // A device buffer holding `v` (f32) or its bf16 rounding.
  Buffer Upload(const std::vector<float>& v, const std::vector<int64_t>& shape,
                DType dtype = DType::kF32) {
    auto b = ctx_->Allocate(dtype, shape);
    EXPECT_THAT(b.status(), IsOk());
    if (dtype == DType::kF32) {
      EXPECT_THAT(ctx_->backend().copy_from_host(*ctx_, v.data(), b->data(), b->bytes()), IsOk());
    } else {
      const auto h = testing::ToBf16(v);
      EXPECT_THAT(ctx_->backend().copy_from_host(*ctx_, h.data(), b->data(), b->bytes()), IsOk());
    }
    return std::move(*b);
  }
  std::vector<uint8_t> Download(const Buffer& b) {
    std::vector<uint8_t> h(b.bytes());
    EXPECT_THAT(ctx_->backend().copy_to_host(*ctx_, b.data(), h.data(), b.bytes()), IsOk());
    return h;
  }
  static std::vector<uint8_t> Bytes(const Tensor& t) {
    const auto* p = static_cast<const uint8_t*>(t.data());
    return std::vector<uint8_t>(p, p + t.NumElements() * DTypeSize(t.dtype()));
  }
  Tensor HostTensor(const std::vector<float>& v, std::initializer_list<int64_t> shape,
                    DType dtype = DType::kF32) {
    auto t = Tensor::Allocate(dtype, shape);
    EXPECT_THAT(t.status(), IsOk());
    if (dtype == DType::kF32) {
      std::memcpy(t->data(), v.data(), v.size() * 4);
    } else {
      const auto h = testing::ToBf16(v);
      std::memcpy(t->data(), h.data(), h.size() * 2);
    }
    return std::move(*t);
  }

  std::unique_ptr<testing::HostTestStreamContext> sc_;
  StreamHandle stream_ = nullptr;
  Context* ctx_ = nullptr;
  std::unique_ptr<Context> cpu_;
};

TEST_F(PluginBackendTest, MatrixOpsMatchCpuBitForBit) {
  const int64_t m = 24, n = 10, k = 7;
  const auto av = testing::RandomVector(3 * m * k, 1), bv = testing::RandomVector(k * n, 2);
  Buffer a = Upload(av, {3, m, k}), b = Upload(bv, {k, n});
  auto c = ctx_->Allocate(DType::kF32, {3, m, n});
  ASSERT_THAT(c.status(), IsOk());
  GemmParams p;
  p.alpha = 0.5f;
  ASSERT_THAT(Gemm(*ctx_, p, a.cview(), b.cview(), c->view()), IsOk());
  Tensor ah = HostTensor(av, {3, m, k}), bh = HostTensor(bv, {k, n});
  auto ch = Tensor::Allocate(DType::kF32, {3, m, n});
  ASSERT_THAT(Gemm(*cpu_, p, ah.cview(), bh.cview(), ch->view()), IsOk());
  EXPECT_EQ(Download(*c), Bytes(*ch));

  // Thin QR with R, Cholesky QR, symmetric product of the same A.
  auto q = ctx_->Allocate(DType::kF32, {3, m, k});
  auto r = ctx_->Allocate(DType::kF32, {3, k, k});
  ASSERT_THAT(ThinQr(*ctx_, a.cview(), q->view(), r->view()), IsOk());
  auto qh = Tensor::Allocate(DType::kF32, {3, m, k});
  auto rh = Tensor::Allocate(DType::kF32, {3, k, k});
  ASSERT_THAT(ThinQr(*cpu_, ah.cview(), qh->view(), rh->view()), IsOk());
  EXPECT_EQ(Download(*q), Bytes(*qh));
  EXPECT_EQ(Download(*r), Bytes(*rh));
  ASSERT_THAT(CholeskyQr(*ctx_, a.cview(), q->view()), IsOk());
  ASSERT_THAT(CholeskyQr(*cpu_, ah.cview(), qh->view()), IsOk());
  EXPECT_EQ(Download(*q), Bytes(*qh));
  auto g = ctx_->Allocate(DType::kF32, {3, k, k});
  auto gh = Tensor::Allocate(DType::kF32, {3, k, k});
  ASSERT_THAT(SymmetricProduct(*ctx_, GramSide::kAtA, 1.0f, a.cview(), 0.0f, g->view()), IsOk());
  ASSERT_THAT(SymmetricProduct(*cpu_, GramSide::kAtA, 1.0f, ah.cview(), 0.0f, gh->view()), IsOk());
  EXPECT_EQ(Download(*g), Bytes(*gh));
}

TEST_F(PluginBackendTest, ReductionsAndSelectionMatchCpu) {
  const int64_t rows = 16, cols = 9;
  auto v = testing::RandomVector(rows * cols, 3);
  v[5] = v[7];  // a tie
  Buffer a = Upload(v, {rows, cols}, DType::kBf16);
  Tensor ah = HostTensor(v, {rows, cols}, DType::kBf16);
  std::vector<int64_t> got(4), want(4);
  auto scores = ctx_->Allocate(DType::kF32, {rows});
  auto scores_h = Tensor::Allocate(DType::kF32, {rows});
  ASSERT_THAT(TopKByL1Norm(*ctx_, a.cview(), Axis::kRows, 4, absl::MakeSpan(got), scores->view()),
              IsOk());
  ASSERT_THAT(
      TopKByL1Norm(*cpu_, ah.cview(), Axis::kRows, 4, absl::MakeSpan(want), scores_h->view()),
      IsOk());
  EXPECT_EQ(got, want);
  EXPECT_EQ(Download(*scores), Bytes(*scores_h));
  auto norms = ctx_->Allocate(DType::kF32, {cols});
  auto norms_h = Tensor::Allocate(DType::kF32, {cols});
  ASSERT_THAT(AxisNorms(*ctx_, a.cview(), Axis::kCols, NormType::kL2, norms->view()), IsOk());
  ASSERT_THAT(AxisNorms(*cpu_, ah.cview(), Axis::kCols, NormType::kL2, norms_h->view()), IsOk());
  EXPECT_EQ(Download(*norms), Bytes(*norms_h));
  bool zero = true;
  ASSERT_THAT(IsAllZero(*ctx_, a.cview(), &zero), IsOk());
  EXPECT_FALSE(zero);
  // Gather columns into f32, scatter them back scaled.
  const std::vector<int64_t> idx = {8, 0, 3};
  auto out = ctx_->Allocate(DType::kF32, {rows, 3});
  auto out_h = Tensor::Allocate(DType::kF32, {rows, 3});
  ASSERT_THAT(Gather(*ctx_, a.cview(), Axis::kCols, idx, out->view()), IsOk());
  ASSERT_THAT(Gather(*cpu_, ah.cview(), Axis::kCols, idx, out_h->view()), IsOk());
  EXPECT_EQ(Download(*out), Bytes(*out_h));
  ASSERT_THAT(Scatter(*ctx_, out->cview(), Axis::kCols, idx, -2.0f, 1.0f, a.view()), IsOk());
  ASSERT_THAT(Scatter(*cpu_, out_h->cview(), Axis::kCols, idx, -2.0f, 1.0f, ah.view()), IsOk());
  EXPECT_EQ(Download(a), Bytes(ah));
}

TEST_F(PluginBackendTest, FusedStepsCarryTheScalarsOfTheCpu) {
  const int64_t n = 257;
  const auto gv = testing::RandomVector(n, 4), xv = testing::RandomVector(n, 5);
  auto mv = testing::RandomVector(n, 6);
  auto vv = testing::RandomVector(n, 7);
  for (float& x : vv) x = x * x;
  Buffer g = Upload(gv, {n}), x = Upload(xv, {n}), m = Upload(mv, {n}), v = Upload(vv, {n});
  Tensor gh = HostTensor(gv, {n}), xh = HostTensor(xv, {n}), mh = HostTensor(mv, {n}),
         vh = HostTensor(vv, {n});
  AdamWParams p;
  p.lr = 3e-3f;
  p.weight_decay = 0.1f;
  p.step = 7;
  p.cautious = true;
  ASSERT_THAT(AdamWStep(*ctx_, p, g.cview(), x.view(), m.view(), v.view()), IsOk());
  ASSERT_THAT(AdamWStep(*cpu_, p, gh.cview(), xh.view(), mh.view(), vh.view()), IsOk());
  EXPECT_EQ(Download(x), Bytes(xh));
  EXPECT_EQ(Download(m), Bytes(mh));
  EXPECT_EQ(Download(v), Bytes(vh));
  LionParams lp;
  lp.lr = 1e-3f;
  lp.weight_decay = 0.2f;
  ASSERT_THAT(LionStep(*ctx_, lp, g.cview(), x.view(), m.view()), IsOk());
  ASSERT_THAT(LionStep(*cpu_, lp, gh.cview(), xh.view(), mh.view()), IsOk());
  EXPECT_EQ(Download(x), Bytes(xh));
  EXPECT_EQ(Download(m), Bytes(mh));
  ApplyUpdateParams up;  // cautious decay, then x − α·u, in place
  up.alpha = 0.5f;
  up.lr_wd = 0.3f;
  up.cautious = true;
  ASSERT_THAT(ApplyUpdate(*ctx_, up, g.cview(), x.cview(), x.view()), IsOk());
  ASSERT_THAT(ApplyUpdate(*cpu_, up, gh.cview(), xh.cview(), xh.view()), IsOk());
  EXPECT_EQ(Download(x), Bytes(xh));
  ASSERT_THAT(Binary(*ctx_, BinaryOp::kMax, x.cview(), g.cview(), m.view()), IsOk());
  ASSERT_THAT(Binary(*cpu_, BinaryOp::kMax, xh.cview(), gh.cview(), mh.view()), IsOk());
  EXPECT_EQ(Download(m), Bytes(mh));
}

TEST_F(PluginBackendTest, DeviceTrafficIsExplicitAndOnTheSessionStream) {
  testing::ResetHostTestDevice(0);
  const auto v = testing::RandomVector(64, 8);
  Buffer x = Upload(v, {8, 8});
  auto y = ctx_->Allocate(DType::kF32, {8, 8});
  ASSERT_THAT(Scale(*ctx_, 2.0f, x.cview(), y->view()), IsOk());
  ASSERT_THAT(Unary(*ctx_, UnaryOp::kSqrt, y->cview(), y->view()), IsOk());
  (void)Download(*y);
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).synchronize_stream(kDev, stream_), IsOk());
  const auto c = testing::GetHostTestDeviceCounters();
  EXPECT_EQ(c.copies_to_device, 1);
  EXPECT_EQ(c.copies_to_host, 1);
  EXPECT_EQ(c.bytes_to_device, 64 * 4);
  EXPECT_EQ(c.ops_on_default_stream, 0) << "every op is queued on the session's stream";
  EXPECT_GE(c.ops, 4);
  EXPECT_EQ(c.syncs, 3) << "the two copies and the explicit synchronize";
  EXPECT_GE(c.streams_live, 1);

  // A stream the backend did not create is refused (INTERNAL from the plugin).
  int foreign = 0;
  ContextOptions o;
  o.device = kDev;
  o.stream = &foreign;
  auto bad = Context::Create(o);
  ASSERT_THAT(bad.status(), IsOk());
  EXPECT_THAT(Fill(**bad, 1.0f, y->view()),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("unknown stream")));
}

// ---- asynccopy: stream-ordered copies, the TEST backend's deferred stream work, device flags ----

TEST_F(PluginBackendTest, AsyncCopiesCompleteOnlyWhenTheStreamIsWaitedFor) {
  testing::ResetHostTestDevice(0);
  std::vector<float> h = testing::RandomVector(64, 3);
  const std::vector<float> h2 = testing::RandomVector(64, 4);
  auto x = ctx_->Allocate(DType::kF32, {64});
  auto y = ctx_->Allocate(DType::kF32, {64});
  ASSERT_THAT(x.status(), IsOk());
  ASSERT_THAT(y.status(), IsOk());
  ASSERT_THAT(CopyFromHostAsync(*ctx_, MakeView(h.data(), {64}), x->view()), IsOk());
  // The host writes the source before the wait: on the stream the copy has not run yet, so the
  // device gets the new bytes (the contract forbids this; the TEST backend makes it visible).
  h = h2;
  ASSERT_THAT(Scale(*ctx_, 2.0f, x->cview(), y->view()), IsOk());
  std::vector<float> out(64, -7.0f);
  ASSERT_THAT(CopyToHostAsync(*ctx_, y->cview(), MakeView(out.data(), {64})), IsOk());
  // Before the wait the destination holds its old bytes: a host read here is the missing sync.
  EXPECT_EQ(out, std::vector<float>(64, -7.0f));
  testing::HostTestDeviceCounters c = testing::GetHostTestDeviceCounters();
  EXPECT_EQ(c.syncs, 0) << "nothing waited yet";
  EXPECT_EQ(c.deferred, 3) << "the two copies and the scale are queued";
  EXPECT_EQ(c.copies_to_device, 0) << "counted when they run";
  ASSERT_THAT(Synchronize(*ctx_), IsOk());
  std::vector<float> want(64);
  ASSERT_THAT(Scale(*cpu_, 2.0f, MakeView(h2.data(), {64}), MakeView(want.data(), {64})), IsOk());
  EXPECT_EQ(out, want);
  c = testing::GetHostTestDeviceCounters();
  EXPECT_EQ(c.syncs, 1);
  EXPECT_EQ(c.copies_to_device, 1);
  EXPECT_EQ(c.async_copies_to_device, 1);
  EXPECT_EQ(c.copies_to_host, 1);
  EXPECT_EQ(c.async_copies_to_host, 1);
  EXPECT_EQ(c.bytes_to_host, 64 * 4);
  EXPECT_EQ(c.ops_on_default_stream, 0);

  // A synchronous copy waits for what was queued before it (one sync, the stream's order kept).
  ASSERT_THAT(Fill(*ctx_, 3.0f, y->view()), IsOk());
  std::vector<float> back(64, 0.0f);
  ASSERT_THAT(CopyToHost(*ctx_, y->cview(), MakeView(back.data(), {64})), IsOk());
  EXPECT_EQ(back, std::vector<float>(64, 3.0f));
  EXPECT_EQ(testing::GetHostTestDeviceCounters().syncs, 2);

  // Validation as the synchronous copies: a device view on the host side is refused at once.
  EXPECT_THAT(CopyToHostAsync(*ctx_, y->cview(), x->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host_dst")));
  EXPECT_THAT(CopyFromHostAsync(*ctx_, MakeView(back.data(), {32}), y->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dst")));
}

TEST_F(PluginBackendTest, AQueuedFailureIsReturnedByTheNextWaitOnly) {
  // The adapter never sends a mismatched ApplyUpdate record; through the C table directly the
  // TEST backend refuses it, but only when the stream runs it.
  const DiondOpsApiV1* api = testing::HostTestDeviceOps();
  auto x = ctx_->Allocate(DType::kF32, {4});
  ASSERT_THAT(x.status(), IsOk());
  ASSERT_THAT(Fill(*ctx_, 5.0f, x->view()), IsOk());
  DiondTensor t{x->data(), static_cast<int32_t>(DType::kF32), 1, {4, 0, 0}, {1, 0, 0}};
  const DiondApplyUpdateScalars bad{0.5f, 0.25f, 0.5f, 0, 0};  // decay != 1 - lr_wd
  char err[256] = {0};
  DiondOpsCall call{0, stream_, err, sizeof(err)};
  EXPECT_EQ(api->apply_update(&call, &bad, &t, &t, &t), DIOND_OPS_OK) << "queued, not run";
  EXPECT_EQ(api->fill(&call, 1.0f, &t), DIOND_OPS_OK);
  EXPECT_EQ(api->stream_synchronize(&call), DIOND_OPS_INTERNAL);
  EXPECT_THAT(std::string(err), HasSubstr("decay != 1 - lr_wd"));
  err[0] = 0;
  EXPECT_EQ(api->stream_synchronize(&call), DIOND_OPS_OK) << "reported once";
  // The work queued after the failure was dropped with it (the fill of 1 never ran); what was
  // queued before it (the fill of 5) did.
  std::vector<float> back(4, 0.0f);
  ASSERT_THAT(CopyToHost(*ctx_, x->cview(), MakeView(back.data(), {4})), IsOk());
  EXPECT_EQ(back, std::vector<float>(4, 5.0f));
}

TEST_F(PluginBackendTest, FinitenessFlagsStayOnTheDeviceAndOrTogether) {
  testing::ResetHostTestDevice(0);
  std::vector<float> v = testing::RandomVector(32, 5);
  Buffer finite = Upload(v, {32});
  v[17] = std::numeric_limits<float>::quiet_NaN();
  Buffer nan = Upload(v, {32});
  auto flag = ctx_->Allocate(DType::kF32, {1});
  auto out = ctx_->Allocate(DType::kF32, {32});
  ASSERT_THAT(flag.status(), IsOk());
  auto read_flag = [&] {
    float f = -1.0f;
    EXPECT_THAT(CopyToHost(*ctx_, flag->cview(), MakeView(&f, {1})), IsOk());
    return f;
  };
  ASSERT_THAT(Fill(*ctx_, 0.0f, flag->view()), IsOk());
  const int64_t syncs = testing::GetHostTestDeviceCounters().syncs;
  ASSERT_THAT(AllFiniteFlag(*ctx_, finite.cview(), flag->view()), IsOk());
  EXPECT_EQ(testing::GetHostTestDeviceCounters().syncs, syncs) << "not a sync point";
  EXPECT_EQ(read_flag(), 0.0f);
  ASSERT_THAT(AllFiniteFlag(*ctx_, nan.cview(), flag->view()), IsOk());
  ASSERT_THAT(AllFiniteFlag(*ctx_, finite.cview(), flag->view()), IsOk());
  EXPECT_EQ(read_flag(), 1.0f) << "a later finite tensor leaves the flag set";

  // Widen + scale: finite bf16 inputs whose scaled values overflow set the flag; the widened
  // output is the host-bool op's, bit for bit.
  const std::vector<float> big(32, 3e38f);
  Buffer b16 = Upload(big, {32}, DType::kBf16);
  ASSERT_THAT(Fill(*ctx_, 0.0f, flag->view()), IsOk());
  ASSERT_THAT(WidenScaleCheckFiniteFlag(*ctx_, b16.cview(), 0.5f, out->view(), flag->view()),
              IsOk());
  EXPECT_EQ(read_flag(), 0.0f);
  ASSERT_THAT(WidenScaleCheckFiniteFlag(*ctx_, b16.cview(), 4.0f, out->view(), flag->view()),
              IsOk());
  EXPECT_EQ(read_flag(), 1.0f);
  Tensor hb = HostTensor(big, {32}, DType::kBf16);
  Tensor want = *Tensor::Allocate(DType::kF32, {32});
  bool ok = true;
  ASSERT_THAT(WidenScaleCheckFinite(*cpu_, hb.cview(), 4.0f, want.view(), &ok), IsOk());
  EXPECT_FALSE(ok);
  EXPECT_EQ(Download(*out), Bytes(want));

  // The flag is one f32 element that overlaps nothing the op reads or writes.
  auto two = ctx_->Allocate(DType::kF32, {2});
  EXPECT_THAT(AllFiniteFlag(*ctx_, finite.cview(), two->view()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nonfinite")));
  EXPECT_THAT(
      WidenScaleCheckFiniteFlag(*ctx_, finite.cview(), 1.0f, out->view(),
                                TensorView(out->data(), ContiguousLayout(DType::kF32, {1}), kDev)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps out")));
}

TEST(CpuAsyncCopies, AreImmediateCopiesAndTheFlagsMatchTheHostBoolOps) {
  auto cpu = Context::CpuDefault(1);
  std::vector<float> src = testing::RandomVector(16, 9), dst(16, 0.0f);
  ASSERT_THAT(CopyFromHostAsync(*cpu, MakeView(src.data(), {16}), MakeView(dst.data(), {16})),
              IsOk());
  EXPECT_EQ(dst, src) << "the CPU has no stream: the copy is done when the call returns";
  std::vector<float> back(16, 0.0f);
  ASSERT_THAT(CopyToHostAsync(*cpu, MakeView(dst.data(), {16}), MakeView(back.data(), {16})),
              IsOk());
  EXPECT_EQ(back, src);
  EXPECT_THAT(Synchronize(*cpu), IsOk());
  float flag = 0.0f;
  ASSERT_THAT(AllFiniteFlag(*cpu, MakeView(src.data(), {16}), MakeView(&flag, {1})), IsOk());
  EXPECT_EQ(flag, 0.0f);
  src[3] = -std::numeric_limits<float>::infinity();
  ASSERT_THAT(AllFiniteFlag(*cpu, MakeView(src.data(), {16}), MakeView(&flag, {1})), IsOk());
  EXPECT_EQ(flag, 1.0f);
}

TEST_F(PluginBackendTest, PoolAccountsEveryByteAndRefusesOverBudget) {
  auto before = DeviceRuntimeFor(kDev.type).memory_stats(kDev);
  ASSERT_THAT(before.status(), IsOk());
  {
    auto b = ctx_->Allocate(DType::kF32, {1000});
    ASSERT_THAT(b.status(), IsOk());
    auto during = DeviceRuntimeFor(kDev.type).memory_stats(kDev);
    EXPECT_GE(during->in_use, before->in_use + 4000);
    EXPECT_GE(during->peak, during->in_use);
  }
  EXPECT_EQ(DeviceRuntimeFor(kDev.type).memory_stats(kDev)->in_use, before->in_use)
      << "freed on Buffer destruction";

  testing::ResetHostTestDevice(before->in_use + 4096);
  auto ok = ctx_->Allocate(DType::kF32, {512});
  ASSERT_THAT(ok.status(), IsOk());
  auto over = ctx_->Allocate(DType::kF32, {4096});
  EXPECT_THAT(over.status(), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).last_allocation_error(),
              HasSubstr("pool budget " + std::to_string(before->in_use + 4096) + " bytes"));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).last_allocation_error(), HasSubstr("requested"));
  testing::ResetHostTestDevice(0);
}

TEST_F(PluginBackendTest, PluginErrorCodesBecomeStatuses) {
  std::vector<float> v(20 * 3, 1.0f);  // rank 1: AᵀA singular
  Buffer a = Upload(v, {20, 3});
  auto q = ctx_->Allocate(DType::kF32, {20, 3});
  EXPECT_THAT(CholeskyQr(*ctx_, a.cview(), q->view()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("host-test device (TEST BACKEND)")));
}

TEST_F(PluginBackendTest, HostRegistrationsArePairedAndCounted) {
  // devsession: host_register / host_unregister through the adapter; the TEST backend refuses a
  // second registration of an overlapping range and an unregister of an unknown pointer.
  std::vector<uint8_t> a(4096), b(4096);
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).host_register(kDev, a.data(), a.size()), IsOk());
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).host_register(kDev, b.data(), b.size()), IsOk());
  EXPECT_EQ(testing::GetHostTestDeviceCounters().host_registered_live, 2);
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).host_register(kDev, a.data() + 100, 8),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("already registered")));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).host_unregister(kDev, a.data() + 1),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("not registered")));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).host_unregister(kDev, a.data()), IsOk());
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).host_unregister(kDev, b.data()), IsOk());
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).host_unregister(kDev, b.data()),
              StatusIs(absl::StatusCode::kInternal));
  const testing::HostTestDeviceCounters c = testing::GetHostTestDeviceCounters();
  EXPECT_EQ(c.host_registers, 3);
  EXPECT_EQ(c.host_unregisters, 4);
  EXPECT_EQ(c.host_registered_live, 0);
  EXPECT_EQ(c.host_register_errors, 3);
  EXPECT_THAT(DeviceRuntimeFor(DeviceType::kCuda)
                  .host_register(Device{DeviceType::kCuda, 0}, a.data(), a.size()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(PluginBackendTest, TheTestBackendEmulatesStreamCapture) {
  // devsession / graph: the graph entries go through the adapter; the host backend records what
  // a capturing stream is given instead of running it, and a launch queues it again.
  auto b = ctx_->Allocate(DType::kF32, {4});
  ASSERT_THAT(b.status(), IsOk());
  ASSERT_THAT(Fill(*ctx_, 1.0f, b->view()), IsOk());
  ASSERT_THAT(Synchronize(*ctx_), IsOk());
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).begin_capture(kDev, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("default stream")));
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).end_capture(kDev, stream_).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not capturing")));
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).begin_capture(kDev, stream_), IsOk());
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).begin_capture(kDev, stream_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already capturing")));
  ASSERT_THAT(AddScalar(*ctx_, 1.0f, b->view(), 2.0f, b->view()), IsOk());  // x + 2, captured
  auto graph = DeviceRuntimeFor(kDev.type).end_capture(kDev, stream_);
  ASSERT_THAT(graph.status(), IsOk());
  ASSERT_NE(*graph, nullptr);
  std::vector<float> host(4);
  auto read = [&] {
    EXPECT_THAT(ctx_->backend().copy_to_host(*ctx_, b->data(), host.data(), 16), IsOk());
    return host[0];
  };
  EXPECT_EQ(read(), 1.0f) << "a captured op does not run";
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).launch_graph(kDev, stream_, *graph), IsOk());
  EXPECT_EQ(read(), 3.0f);
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).launch_graph(kDev, stream_, *graph), IsOk());
  ASSERT_THAT(DeviceRuntimeFor(kDev.type).launch_graph(kDev, stream_, *graph), IsOk());
  EXPECT_EQ(read(), 7.0f);
  const testing::HostTestDeviceCounters c = testing::GetHostTestDeviceCounters();
  EXPECT_EQ(c.graph_captures, 1);
  EXPECT_EQ(c.graphs_made, 1);
  EXPECT_EQ(c.graph_launches, 3);
  EXPECT_THAT(DeviceRuntimeFor(kDev.type).launch_graph(kDev, stream_, nullptr),
              StatusIs(absl::StatusCode::kInternal));
  DeviceRuntimeFor(kDev.type).destroy_graph(kDev, *graph);
  DeviceRuntimeFor(kDev.type).destroy_graph(kDev, nullptr);  // a no-op
}

TEST(PluginBackendAdapt, RefusesBadTables) {
  EXPECT_THAT(AdaptPluginOps(DeviceType::kCpu, testing::HostTestDeviceOps()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AdaptPluginOps(DeviceType::kTest, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  DiondOpsApiV1 t = *testing::HostTestDeviceOps();
  t.version = DIOND_OPS_API_VERSION + 1;
  EXPECT_THAT(AdaptPluginOps(DeviceType::kTest, &t).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version")));
  t = *testing::HostTestDeviceOps();
  t.lion_step = nullptr;
  EXPECT_THAT(AdaptPluginOps(DeviceType::kTest, &t).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null entry")));
}

}  // namespace
}  // namespace diond::kernels
