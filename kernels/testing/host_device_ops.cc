// TEST BACKEND (host_device_backend.h): the ops and the C table. Every op of kernels/ops.def
// runs the CPU backend's entry on host memory (Forward below), queued on its stream or, for a
// sync point, after a wait; the few listed in Own run their own bodies: the copies (counted),
// the fused steps (the shared per-element functions on the scalars the adapter sent, so that
// the scalar transport is checked too) and top-k (its index span).
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/context.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"
#include "kernels/plugin/abi_args.h"
#include "kernels/testing/host_device_backend.h"
#include "kernels/testing/host_device_internal.h"

namespace diond::kernels::testing {
namespace host_device {
namespace {

using abi::In;
using abi::Out;

const Context& Cpu() {
  thread_local std::unique_ptr<Context> ctx = Context::CpuDefault(1);
  return *ctx;
}

// The body of an own entry (the stream is checked, and the entry queued or waited for, by the
// Queued / SyncPoint wrappers of the table).
#define DIOND_TEST_OP_BEGIN \
  EntryGuard entry_guard_;  \
  int rc = DIOND_OPS_OK;    \
  (void)rc

// ---- the copies ----
int CopyFromHost(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(dst, host, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_device;
  St().counters.bytes_to_device += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int CopyToHost(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(host, src, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_host;
  St().counters.bytes_to_host += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int CopyFromHostAsync(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(dst, host, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_device;
  ++St().counters.async_copies_to_device;
  St().counters.bytes_to_device += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
int CopyToHostAsync(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  DIOND_TEST_OP_BEGIN;
  std::memcpy(host, src, bytes);
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.copies_to_host;
  ++St().counters.async_copies_to_host;
  St().counters.bytes_to_host += static_cast<int64_t>(bytes);
  return DIOND_OPS_OK;
}
// Its index span has k entries per matrix (a C argument, not the span's length).
int TopKByL1Norm(const DiondOpsCall* call, DiondIn a, int32_t axis, int64_t k, int64_t* indices,
                 DiondOut scores) {
  DIOND_TEST_OP_BEGIN;
  return FromStatus(
      call, kernels::TopKByL1Norm(Cpu(), In(a), static_cast<Axis>(axis), k,
                                  absl::MakeSpan(indices, static_cast<size_t>(k)), Out(scores)));
}
// The fused ops run the shared per-element functions on the scalars the adapter formed.
int64_t Count(const DiondTensor* t) { return In(t).NumElements(); }

int AdamWStep(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad, DiondOut x,
              DiondOut m, DiondOut v) {
  DIOND_TEST_OP_BEGIN;
  math::AdamWScalars s{c->decay,     c->lr_wd,    c->one_minus_b1, c->one_minus_b2, c->beta2,
                       c->step_size, c->sqrt_bc2, c->eps,          c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data),
        *vp = static_cast<float*>(v->data);
  for (int64_t i = 0; i < Count(x); ++i) math::AdamWElement(s, g[i], xp[i], mp[i], vp[i]);
  return DIOND_OPS_OK;
}
int LionStep(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
             DiondOut m) {
  DIOND_TEST_OP_BEGIN;
  math::LionScalars s{c->w1, c->w2, c->lr_wd, c->decay, c->lr, c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data);
  for (int64_t i = 0; i < Count(x); ++i) math::LionElement(s, g[i], xp[i], mp[i]);
  return DIOND_OPS_OK;
}

// ---- kops: the tracked steps run the per-element functions on the adapter's scalars, with the
// change summed in double in element order (the CPU backend's order on one thread); the others
// run the CPU ops themselves.
inline double Sq(float after, float before) {
  const double d = static_cast<double>(after) - static_cast<double>(before);
  return d * d;
}
int AdamWStepTracked(const DiondOpsCall* call, const DiondAdamWScalars* c, DiondIn grad, DiondOut x,
                     DiondOut m, DiondOut v, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  math::AdamWScalars s{c->decay,     c->lr_wd,    c->one_minus_b1, c->one_minus_b2, c->beta2,
                       c->step_size, c->sqrt_bc2, c->eps,          c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data),
        *vp = static_cast<float*>(v->data);
  double sq = 0.0;
  for (int64_t i = 0; i < Count(x); ++i) {
    const float before = xp[i];
    math::AdamWElement(s, g[i], xp[i], mp[i], vp[i]);
    sq += Sq(xp[i], before);
  }
  *static_cast<float*>(update_sq->data) = static_cast<float>(sq);
  return DIOND_OPS_OK;
}
int LionStepTracked(const DiondOpsCall* call, const DiondLionScalars* c, DiondIn grad, DiondOut x,
                    DiondOut m, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  math::LionScalars s{c->w1, c->w2, c->lr_wd, c->decay, c->lr, c->cautious != 0};
  const float* g = static_cast<const float*>(grad->data);
  float *xp = static_cast<float*>(x->data), *mp = static_cast<float*>(m->data);
  double sq = 0.0;
  for (int64_t i = 0; i < Count(x); ++i) {
    const float before = xp[i];
    math::LionElement(s, g[i], xp[i], mp[i]);
    sq += Sq(xp[i], before);
  }
  *static_cast<float*>(update_sq->data) = static_cast<float>(sq);
  return DIOND_OPS_OK;
}
int ApplyUpdate(const DiondOpsCall* call, const DiondApplyUpdateScalars* c, DiondIn update,
                DiondIn x_in, DiondOut x) {
  DIOND_TEST_OP_BEGIN;
  // The CPU op forms decay = 1 − lr_wd itself; the adapter's record must agree with it.
  if (c->decay != 1.0f - c->lr_wd) {
    return Fail(call, DIOND_OPS_INTERNAL, "host-test device: ApplyUpdate decay != 1 - lr_wd");
  }
  ApplyUpdateParams p;
  p.alpha = c->alpha;
  p.lr_wd = c->lr_wd;
  p.cautious = c->cautious != 0;
  p.round_bf16 = c->round_bf16 != 0;
  return FromStatus(call, kernels::ApplyUpdate(Cpu(), p, In(update), In(x_in), Out(x)));
}
// ---- the wrappers of the own entries ----
// An argument of a queued entry, kept until the entry runs: records passed by pointer (tensors,
// scalar structs) are copied, everything else (scalars, device and host pointers) kept as is.
template <typename T, typename = void>
struct Held {
  explicit Held(T x) : v(x) {}
  T get() const { return v; }
  T v;
};
template <typename T>
struct Held<const T*, std::enable_if_t<std::is_class_v<T>>> {
  explicit Held(const T* p) : v(*p) {}
  const T* get() const { return &v; }
  T v;
};

// Queued<F, Fn>::Entry: checks the stream; on the default stream runs Fn at once, on a stream
// of ours queues it.
template <typename F, F Fn>
struct Queued;
template <typename... A, int (*Fn)(const DiondOpsCall*, A...)>
struct Queued<int (*)(const DiondOpsCall*, A...), Fn> {
  static int Entry(const DiondOpsCall* call, A... a) {
    int rc = DIOND_OPS_OK;
    if (!CheckStream(call, &rc)) return rc;
    if (call->stream == nullptr) return Fn(call, a...);
    auto held = std::make_shared<std::tuple<Held<A>...>>(Held<A>(a)...);
    Enqueue(call, name, [held](const DiondOpsCall* c) {
      return std::apply([c](const auto&... h) { return Fn(c, h.get()...); }, *held);
    });
    return DIOND_OPS_OK;
  }
  inline static const char* name = "entry";  // the body's own message names the op
};

// SyncPoint<F, Fn>::Entry: the host waits for the stream (its queue runs, and a queued failure
// is returned), counts one sync, then Fn runs.
template <typename F, F Fn>
struct SyncPoint;
template <typename... A, int (*Fn)(const DiondOpsCall*, A...)>
struct SyncPoint<int (*)(const DiondOpsCall*, A...), Fn> {
  static int Entry(const DiondOpsCall* call, A... a) {
    int rc = DIOND_OPS_OK;
    if (!CheckStream(call, &rc)) return rc;
    if (RefuseWhileCapturing(call, &rc)) return rc;
    EntryGuard entry_guard;
    if (WaitForStream(call, &rc)) return rc;
    CountSync();
    return Fn(call, a...);
  }
};

// The queued host copies: as Queued, except that under capture the host range must be
// host_register'ed (RefusePageableWhileCapturing).
int CopyFromHostAsyncQueued(const DiondOpsCall* call, const void* host, void* dst, size_t bytes) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (RefusePageableWhileCapturing(call, host, bytes, &rc)) return rc;
  return Queued<decltype(&CopyFromHostAsync), &CopyFromHostAsync>::Entry(call, host, dst, bytes);
}
int CopyToHostAsyncQueued(const DiondOpsCall* call, const void* src, void* host, size_t bytes) {
  int rc = DIOND_OPS_OK;
  if (!CheckStream(call, &rc)) return rc;
  if (RefusePageableWhileCapturing(call, host, bytes, &rc)) return rc;
  return Queued<decltype(&CopyToHostAsync), &CopyToHostAsync>::Entry(call, src, host, bytes);
}

// ---- graph: the fused steps with DEVICE-side scalars (*_dev). The record's address is kept
// (not its bytes) and the record is read when the queued work runs, as a GPU kernel reads it: a
// graph replays with whatever the host uploaded before the launch. The address must lie in a
// block of this backend (device memory), else the entry fails.
template <typename R>
struct DeviceRecord {
  const R* p;
};
template <typename R>
int ReadRecord(const DiondOpsCall* call, DeviceRecord<R> r, R* out) {
  if (r.p == nullptr || !OnDevice(r.p, sizeof(R))) {
    return Fail(call, DIOND_OPS_INTERNAL,
                "host-test device: a *_dev entry's scalars are not in device memory");
  }
  std::memcpy(out, r.p, sizeof(R));  // inside the entry's guard (strict mode)
  return DIOND_OPS_OK;
}
int AdamWStepDevBody(const DiondOpsCall* call, DeviceRecord<DiondAdamWScalars> r, DiondIn grad,
                     DiondOut x, DiondOut m, DiondOut v) {
  DIOND_TEST_OP_BEGIN;
  DiondAdamWScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return AdamWStep(call, &c, grad, x, m, v);
}
int LionStepDevBody(const DiondOpsCall* call, DeviceRecord<DiondLionScalars> r, DiondIn grad,
                    DiondOut x, DiondOut m) {
  DIOND_TEST_OP_BEGIN;
  DiondLionScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return LionStep(call, &c, grad, x, m);
}
int AdamWStepTrackedDevBody(const DiondOpsCall* call, DeviceRecord<DiondAdamWScalars> r,
                            DiondIn grad, DiondOut x, DiondOut m, DiondOut v, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  DiondAdamWScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return AdamWStepTracked(call, &c, grad, x, m, v, update_sq);
}
int LionStepTrackedDevBody(const DiondOpsCall* call, DeviceRecord<DiondLionScalars> r, DiondIn grad,
                           DiondOut x, DiondOut m, DiondOut update_sq) {
  DIOND_TEST_OP_BEGIN;
  DiondLionScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return LionStepTracked(call, &c, grad, x, m, update_sq);
}
int ApplyUpdateDevBody(const DiondOpsCall* call, DeviceRecord<DiondApplyUpdateScalars> r,
                       DiondIn update, DiondIn x_in, DiondOut x) {
  DIOND_TEST_OP_BEGIN;
  DiondApplyUpdateScalars c;
  if ((rc = ReadRecord(call, r, &c)) != DIOND_OPS_OK) return rc;
  return ApplyUpdate(call, &c, update, x_in, x);
}
void CountDeviceScalarOp() {
  std::lock_guard<std::mutex> lock(St().mu);
  ++St().counters.device_scalar_ops;
}
// Each *_dev entry: the record's address wrapped, then queued like any op.
#define DIOND_DEV_ENTRY(name, R, ...) int name(const DiondOpsCall* call, const R* c, __VA_ARGS__)
DIOND_DEV_ENTRY(AdamWStepDev, DiondAdamWScalars, DiondIn grad, DiondOut x, DiondOut m, DiondOut v) {
  CountDeviceScalarOp();
  return Queued<decltype(&AdamWStepDevBody), &AdamWStepDevBody>::Entry(
      call, DeviceRecord<DiondAdamWScalars>{c}, grad, x, m, v);
}
DIOND_DEV_ENTRY(LionStepDev, DiondLionScalars, DiondIn grad, DiondOut x, DiondOut m) {
  CountDeviceScalarOp();
  return Queued<decltype(&LionStepDevBody), &LionStepDevBody>::Entry(
      call, DeviceRecord<DiondLionScalars>{c}, grad, x, m);
}
DIOND_DEV_ENTRY(AdamWStepTrackedDev, DiondAdamWScalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut v, DiondOut update_sq) {
  CountDeviceScalarOp();
  return Queued<decltype(&AdamWStepTrackedDevBody), &AdamWStepTrackedDevBody>::Entry(
      call, DeviceRecord<DiondAdamWScalars>{c}, grad, x, m, v, update_sq);
}
DIOND_DEV_ENTRY(LionStepTrackedDev, DiondLionScalars, DiondIn grad, DiondOut x, DiondOut m,
                DiondOut update_sq) {
  CountDeviceScalarOp();
  return Queued<decltype(&LionStepTrackedDevBody), &LionStepTrackedDevBody>::Entry(
      call, DeviceRecord<DiondLionScalars>{c}, grad, x, m, update_sq);
}
DIOND_DEV_ENTRY(ApplyUpdateDev, DiondApplyUpdateScalars, DiondIn update, DiondIn x_in, DiondOut x) {
  CountDeviceScalarOp();
  return Queued<decltype(&ApplyUpdateDevBody), &ApplyUpdateDevBody>::Entry(
      call, DeviceRecord<DiondApplyUpdateScalars>{c}, update, x_in, x);
}
#undef DIOND_DEV_ENTRY

#undef DIOND_DEV_ENTRY
#undef DIOND_TEST_OP_BEGIN

// ---- every other op: forwarded to the CPU backend ----
enum class Kind { kGraph, kWaits, kHostMemory, kHostCopy, kNoCapture };  // kernels/ops.def

// The C arguments taken back into the C++ ones (abi::FromC; an index list is copied, so a
// queued entry keeps its own), then the CPU backend's entry of the same op on them. A kWaits op
// is a sync point (the host waits for the stream first); the others are queued on their stream.
template <auto CppMember, Kind K, typename CSig, typename CppSig>
struct Forward;
template <auto CppMember, Kind K, typename... C, typename... P>
struct Forward<CppMember, K, int (*)(const DiondOpsCall*, C...),
               absl::Status (*)(const Context&, P...)> {
  using Unpack = abi::Unpack<P...>;
  using Held = std::tuple<typename abi::FromC<std::decay_t<P>>::Held...>;
  static_assert(Unpack::kCArgs == sizeof...(C), "an op's C and C++ parameters in ops.def differ");

  static int Entry(const DiondOpsCall* call, C... c) {
    int rc = DIOND_OPS_OK;
    if (!CheckStream(call, &rc)) return rc;
    Held held = Unpack::Take(std::forward_as_tuple(c...), std::index_sequence_for<P...>());
    if constexpr (K == Kind::kWaits) {
      if (RefuseWhileCapturing(call, &rc)) return rc;
      EntryGuard entry_guard;
      if (WaitForStream(call, &rc)) return rc;
      CountSync();
      return Run(call, held);
    } else {
      if (call->stream == nullptr) return Run(call, held);
      Enqueue(call, name, [held = std::move(held)](const DiondOpsCall* q) { return Run(q, held); });
      return DIOND_OPS_OK;
    }
  }
  static int Run(const DiondOpsCall* call, const Held& held) {
    return RunWith(call, held, std::index_sequence_for<P...>());
  }
  template <size_t... I>
  static int RunWith(const DiondOpsCall* call, const Held& held, std::index_sequence<I...>) {
    EntryGuard entry_guard;
    const Context& cpu = Cpu();
    const int rc = FromStatus(
        call,
        (cpu.backend().*CppMember)(cpu, abi::FromC<std::decay_t<P>>::Pass(std::get<I>(held))...));
    (abi::FromC<std::decay_t<P>>::Finish(std::get<I>(held)), ...);
    return rc;
  }
  inline static const char* name = "op";
};

// The ops with an entry of their own (above).
template <auto CEntry>
struct Own {
  static constexpr std::nullptr_t kEntry = nullptr;
};
#define DIOND_OWN(name, entry)            \
  template <>                             \
  struct Own<&DiondOpsApiV1::name> {      \
    static constexpr auto kEntry = entry; \
  };
#define DIOND_QUEUED(fn) &Queued<decltype(&fn), &fn>::Entry
#define DIOND_SYNC_POINT(fn) &SyncPoint<decltype(&fn), &fn>::Entry
DIOND_OWN(copy_from_host, DIOND_SYNC_POINT(CopyFromHost))
DIOND_OWN(copy_to_host, DIOND_SYNC_POINT(CopyToHost))
DIOND_OWN(top_k_by_l1_norm, DIOND_SYNC_POINT(TopKByL1Norm))
DIOND_OWN(adamw_step, DIOND_QUEUED(AdamWStep))
DIOND_OWN(lion_step, DIOND_QUEUED(LionStep))
DIOND_OWN(adamw_step_tracked, DIOND_QUEUED(AdamWStepTracked))
DIOND_OWN(lion_step_tracked, DIOND_QUEUED(LionStepTracked))
DIOND_OWN(apply_update, DIOND_QUEUED(ApplyUpdate))
DIOND_OWN(copy_from_host_async, &CopyFromHostAsyncQueued)
DIOND_OWN(copy_to_host_async, &CopyToHostAsyncQueued)
#undef DIOND_OWN
#undef DIOND_QUEUED
#undef DIOND_SYNC_POINT

template <typename T>
struct MemberOf;
template <typename T, typename S>
struct MemberOf<T S::*> {
  using Type = T;
};

template <auto CEntry, auto CppMember, Kind K>
void Set(DiondOpsApiV1& t, const char* name) {
  if constexpr (!std::is_null_pointer_v<decltype(Own<CEntry>::kEntry)>) {
    t.*CEntry = Own<CEntry>::kEntry;
  } else {
    using F = Forward<CppMember, K, typename MemberOf<decltype(CEntry)>::Type,
                      typename MemberOf<decltype(CppMember)>::Type>;
    F::name = name;
    t.*CEntry = &F::Entry;
  }
}

DiondOpsApiV1 MakeTable() {
  DiondOpsApiV1 t{};
  t.version = DIOND_OPS_API_VERSION;
  t.name = "host-test device (TEST BACKEND)";
#define DIOND_ENTRY(name, Name, ret, c_params) t.name = &Name;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) \
  Set<&DiondOpsApiV1::name, &OpsBackend::name, Kind::kind>(t, #Name);
#define DIOND_OP_DEV(name, Name, host_op, c_params) t.name = &Name;
#include "kernels/ops.def"
  return t;
}

}  // namespace
}  // namespace host_device

const DiondOpsApiV1* HostTestDeviceOps() {
  static const DiondOpsApiV1 table = host_device::MakeTable();
  return &table;
}

}  // namespace diond::kernels::testing
