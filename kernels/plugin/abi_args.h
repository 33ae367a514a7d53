// The C ABI form of each C++ argument type of an op (kernels/ops.def): ToC, the adapter's way
// (kernels/plugin/plugin_backend.cc), and FromC, the way back (the host-memory TEST backend,
// kernels/testing). A row of ops.def lists both parameter lists; these conversions, chosen by
// type, are what make an op's forwarding generic, and the adapter static_asserts that they give
// exactly the row's C parameters. A C++ type with no FromC (the fused steps' params, top-k's
// output span) is one the TEST backend implements by hand.
//
// Internal to kernels/plugin and kernels/testing. Thread-compatible (plain values).
#ifndef DIOND_KERNELS_PLUGIN_ABI_ARGS_H_
#define DIOND_KERNELS_PLUGIN_ABI_ARGS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "kernels/cuda/plugin_api.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace diond::kernels::abi {

inline DiondTensor Tensor(const TensorLayout& l, const void* data) {
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
inline DiondTensor Tensor(ConstTensorView v) { return Tensor(v.layout(), v.data()); }

inline TensorLayout Layout(const DiondTensor& t) {
  TensorLayout l;
  l.dtype = static_cast<DType>(t.dtype);
  l.rank = t.rank;
  for (int i = 0; i < 3; ++i) {
    l.dims[i] = t.dims[i];
    l.strides[i] = t.strides[i];
  }
  return l;
}
// Rank 0 and null data: "no tensor" (an optional output not requested).
inline ConstTensorView In(const DiondTensor* t) {
  return t->data == nullptr && t->rank == 0 ? ConstTensorView()
                                            : ConstTensorView(t->data, Layout(*t));
}
inline TensorView Out(const DiondTensor* t) {
  return t->data == nullptr && t->rank == 0 ? TensorView() : TensorView(t->data, Layout(*t));
}

// The scalar records of ops.h are the plugin's records, field for field.
static_assert(sizeof(AdamWScalarRecord) == sizeof(DiondAdamWScalars) &&
              offsetof(AdamWScalarRecord, eps) == offsetof(DiondAdamWScalars, eps) &&
              offsetof(AdamWScalarRecord, cautious) == offsetof(DiondAdamWScalars, cautious));
static_assert(sizeof(LionScalarRecord) == sizeof(DiondLionScalars) &&
              offsetof(LionScalarRecord, lr) == offsetof(DiondLionScalars, lr) &&
              offsetof(LionScalarRecord, cautious) == offsetof(DiondLionScalars, cautious));
static_assert(sizeof(ApplyUpdateScalarRecord) == sizeof(DiondApplyUpdateScalars) &&
              offsetof(ApplyUpdateScalarRecord, lr_wd) ==
                  offsetof(DiondApplyUpdateScalars, lr_wd) &&
              offsetof(ApplyUpdateScalarRecord, round_bf16) ==
                  offsetof(DiondApplyUpdateScalars, round_bf16));

// ---- ToC<P>: holds the C form of one argument of C++ type P (decayed) for the length of a call.
// c() is the tuple of C arguments it stands for (an index list is two: pointer and count);
// Finish(rc) writes an output back after the call. ----
template <typename P>
struct ToC;

template <typename P>
struct Same {  // passed as is: numbers, and host or device addresses
  explicit Same(P v) : v(v) {}
  std::tuple<P> c() const { return {v}; }
  void Finish(int) {}
  P v;
};
template <>
struct ToC<float> : Same<float> {
  using Same::Same;
};
template <>
struct ToC<int64_t> : Same<int64_t> {
  using Same::Same;
};
template <>
struct ToC<size_t> : Same<size_t> {
  using Same::Same;
};
template <>
struct ToC<const void*> : Same<const void*> {
  using Same::Same;
};
template <>
struct ToC<void*> : Same<void*> {
  using Same::Same;
};
template <>
struct ToC<uint64_t*> : Same<uint64_t*> {
  using Same::Same;
};

template <typename E>
struct Code : Same<int32_t> {  // an enum's value (its codes are static_assert'ed by the adapter)
  explicit Code(E e) : Same(static_cast<int32_t>(e)) {}
};
template <>
struct ToC<Axis> : Code<Axis> {
  using Code::Code;
};
template <>
struct ToC<NormType> : Code<NormType> {
  using Code::Code;
};
template <>
struct ToC<UnaryOp> : Code<UnaryOp> {
  using Code::Code;
};
template <>
struct ToC<BinaryOp> : Code<BinaryOp> {
  using Code::Code;
};
template <>
struct ToC<GramSide> : Same<int32_t> {  // aat: 1 for A·Aᵀ
  explicit ToC(GramSide s) : Same(s == GramSide::kAAt ? 1 : 0) {}
};
template <>
struct ToC<bool> : Same<int32_t> {
  explicit ToC(bool b) : Same(b ? 1 : 0) {}
};

template <>
struct ToC<ConstTensorView> {
  explicit ToC(ConstTensorView v) : t(Tensor(v)) {}
  std::tuple<const DiondTensor*> c() const { return {&t}; }
  void Finish(int) {}
  DiondTensor t;
};
template <>
struct ToC<TensorView> : ToC<ConstTensorView> {
  explicit ToC(TensorView v) : ToC<ConstTensorView>(v) {}
};

template <>
struct ToC<absl::Span<int64_t>> : Same<int64_t*> {  // its length is another argument (k)
  explicit ToC(absl::Span<int64_t> s) : Same(s.data()) {}
};
template <>
struct ToC<absl::Span<const int64_t>> {
  explicit ToC(absl::Span<const int64_t> s) : s(s) {}
  std::tuple<const int64_t*, int64_t> c() const {
    return {s.data(), static_cast<int64_t>(s.size())};
  }
  void Finish(int) {}
  absl::Span<const int64_t> s;
};

template <>
struct ToC<bool*> {  // written back only when the entry succeeded
  explicit ToC(bool* out) : out(out) {}
  std::tuple<int32_t*> c() { return {&v}; }
  void Finish(int rc) {
    if (rc == DIOND_OPS_OK) *out = v != 0;
  }
  bool* out;
  int32_t v = 0;
};

template <>
struct ToC<GemmParams> {
  explicit ToC(const GemmParams& p)
      : g{p.trans_a == Trans::kYes ? 1 : 0, p.trans_b == Trans::kYes ? 1 : 0, p.alpha, p.beta} {}
  std::tuple<const DiondGemmArgs*> c() const { return {&g}; }
  void Finish(int) {}
  DiondGemmArgs g;
};

// The fused steps' params: the scalar record formed on the host (ops.h ScalarRecordOf, the same
// formation as a graph's), or, when the params carry scalars_on_device, that device address;
// then on_device() is true and the adapter calls the row's DIOND_OP_DEV entry.
template <typename Params, typename Record>
struct Scalars {
  explicit Scalars(const Params& p)
      : dev(static_cast<const Record*>(static_cast<const void*>(p.scalars_on_device))) {
    if (dev == nullptr) {
      const auto r = ScalarRecordOf(p);
      static_assert(sizeof(r) == sizeof(Record));
      std::memcpy(&host, &r, sizeof(host));
    }
  }
  std::tuple<const Record*> c() const { return {dev != nullptr ? dev : &host}; }
  bool on_device() const { return dev != nullptr; }
  void Finish(int) {}
  const Record* dev;
  Record host{};
};
template <>
struct ToC<AdamWParams> : Scalars<AdamWParams, DiondAdamWScalars> {
  using Scalars::Scalars;
};
template <>
struct ToC<LionParams> : Scalars<LionParams, DiondLionScalars> {
  using Scalars::Scalars;
};
template <>
struct ToC<ApplyUpdateParams> : Scalars<ApplyUpdateParams, DiondApplyUpdateScalars> {
  using Scalars::Scalars;
};

template <typename T, typename = void>
struct HasOnDevice : std::false_type {};
template <typename T>
struct HasOnDevice<T, std::void_t<decltype(std::declval<const T&>().on_device())>>
    : std::true_type {};
template <typename T>
bool OnDevice(const T& arg) {
  if constexpr (HasOnDevice<T>::value) {
    return arg.on_device();
  } else {
    return false;
  }
}

// ---- FromC<P>: the way back, for a backend behind the C table. kWidth C arguments make one
// Held value, which may outlive the call (a queued entry keeps it: an index list is copied);
// Pass gives the C++ argument, Finish writes an output back to the C argument. ----
template <typename P>
struct FromC;

template <typename P>
struct Kept {  // kept as is
  static constexpr int kWidth = 1;
  using Held = P;
  static Held Take(P v) { return v; }
  static P Pass(const Held& h) { return h; }
  static void Finish(const Held&) {}
};
template <>
struct FromC<float> : Kept<float> {};
template <>
struct FromC<int64_t> : Kept<int64_t> {};
template <>
struct FromC<size_t> : Kept<size_t> {};
template <>
struct FromC<const void*> : Kept<const void*> {};
template <>
struct FromC<void*> : Kept<void*> {};
template <>
struct FromC<uint64_t*> : Kept<uint64_t*> {};

template <typename E>
struct Decode : Kept<E> {
  static E Take(int32_t v) { return static_cast<E>(v); }
};
template <>
struct FromC<Axis> : Decode<Axis> {};
template <>
struct FromC<NormType> : Decode<NormType> {};
template <>
struct FromC<UnaryOp> : Decode<UnaryOp> {};
template <>
struct FromC<BinaryOp> : Decode<BinaryOp> {};
template <>
struct FromC<GramSide> : Kept<GramSide> {
  static GramSide Take(int32_t aat) { return aat ? GramSide::kAAt : GramSide::kAtA; }
};
template <>
struct FromC<bool> : Kept<bool> {
  static bool Take(int32_t v) { return v != 0; }
};
template <>
struct FromC<ConstTensorView> : Kept<ConstTensorView> {
  static ConstTensorView Take(const DiondTensor* t) { return In(t); }
};
template <>
struct FromC<TensorView> : Kept<TensorView> {
  static TensorView Take(const DiondTensor* t) { return Out(t); }
};
template <>
struct FromC<GemmParams> : Kept<GemmParams> {
  static GemmParams Take(const DiondGemmArgs* g) {
    GemmParams p;
    p.trans_a = g->trans_a ? Trans::kYes : Trans::kNo;
    p.trans_b = g->trans_b ? Trans::kYes : Trans::kNo;
    p.alpha = g->alpha;
    p.beta = g->beta;
    return p;
  }
};
template <>
struct FromC<absl::Span<const int64_t>> {
  static constexpr int kWidth = 2;
  using Held = std::vector<int64_t>;
  static Held Take(const int64_t* p, int64_t n) { return Held(p, p + n); }
  static absl::Span<const int64_t> Pass(const Held& h) { return h; }
  static void Finish(const Held&) {}
};
template <>
struct FromC<bool*> {  // a sync point's answer: written back whatever the result
  static constexpr int kWidth = 1;
  struct Held {
    int32_t* out;
    mutable bool v = false;
  };
  static Held Take(int32_t* out) { return Held{out}; }
  static bool* Pass(const Held& h) { return &h.v; }
  static void Finish(const Held& h) { *h.out = h.v ? 1 : 0; }
};

// The Held values of a C++ parameter list P... taken from the C arguments `c` (a tuple).
template <typename... P>
struct Unpack {
  // (A local array, not a static member: clang cannot read a static constexpr array of a class
  // template while that class's own constants are being initialized.)
  static constexpr size_t Offset(size_t i) {
    constexpr int widths[] = {FromC<std::decay_t<P>>::kWidth..., 0};
    size_t o = 0;
    for (size_t j = 0; j < i; ++j) o += widths[j];
    return o;
  }
  static constexpr size_t kCArgs = Offset(sizeof...(P));

  template <typename Tuple, size_t... I>
  static auto Take(const Tuple& c, std::index_sequence<I...>) {
    return std::make_tuple(TakeOne<std::decay_t<P>, Offset(I)>(c)...);
  }
  template <typename Q, size_t kAt, typename Tuple>
  static typename FromC<Q>::Held TakeOne(const Tuple& c) {
    if constexpr (FromC<Q>::kWidth == 2) {
      return FromC<Q>::Take(std::get<kAt>(c), std::get<kAt + 1>(c));
    } else {
      return FromC<Q>::Take(std::get<kAt>(c));
    }
  }
};

}  // namespace diond::kernels::abi

#endif  // DIOND_KERNELS_PLUGIN_ABI_ARGS_H_
