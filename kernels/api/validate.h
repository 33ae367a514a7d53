// Device-independent argument checks of the ops dispatcher (kernels/api/ops.cc). Each returns
// INVALID_ARGUMENT with a message of the form
// "<Op>: <argument> is <layout>, <what was wanted>" (STYLE.md E2).
#ifndef DIOND_KERNELS_API_VALIDATE_H_
#define DIOND_KERNELS_API_VALIDATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/context.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace diond::kernels::api {

template <typename... Args>
absl::Status Invalid(const char* op, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", args...));
}

// rank in [min_rank, 3], dims >= 0, non-null data when non-empty, on ctx's device.
absl::Status CheckView(const Context& ctx, const char* op, const char* name, const TensorLayout& l,
                       const void* data, Device device, int min_rank = 0);

// CheckView plus: rank 2 or 3 (rank 1 accepted if allow_vector), unit column stride (when
// cols > 1), row stride >= cols, batch stride >= 0.
absl::Status CheckMatrix(const Context& ctx, const char* op, const char* name,
                         const TensorLayout& l, const void* data, Device device,
                         bool allow_vector = false);

// CheckView plus contiguity.
absl::Status CheckContiguous(const Context& ctx, const char* op, const char* name,
                             const TensorLayout& l, const void* data, Device device);

// Same dims (ranks equal and each dim equal).
bool SameShape(const TensorLayout& a, const TensorLayout& b);

absl::Status CheckDType(const char* op, const char* name, const TensorLayout& l, DType want);

absl::Status CheckFinite(const char* op, const char* name, float v);

template <typename V>
absl::Status CheckView(const Context& ctx, const char* op, const char* name, const V& v,
                       int min_rank = 0) {
  return CheckView(ctx, op, name, v.layout(), v.data(), v.device(), min_rank);
}
template <typename V>
absl::Status CheckMatrix(const Context& ctx, const char* op, const char* name, const V& v,
                         bool allow_vector = false) {
  return CheckMatrix(ctx, op, name, v.layout(), v.data(), v.device(), allow_vector);
}
template <typename V>
absl::Status CheckContiguous(const Context& ctx, const char* op, const char* name, const V& v) {
  return CheckContiguous(ctx, op, name, v.layout(), v.data(), v.device());
}

// ---- checks shared by several op families (the ops dispatcher, kernels/api/ops*.cc) ----

absl::Status CheckSameShapeContiguous(const Context& ctx, const char* op, ConstTensorView x,
                                      const char* xname, TensorView out);
// Thin-QR family: a f32 m×n with m >= n, q like a, r (if given) n×n f32, same batch.
absl::Status CheckQrArgs(const Context& ctx, const char* op, ConstTensorView a, TensorView q,
                         TensorView r);
absl::Status CheckF32Out(const Context& ctx, const char* op, TensorView out, int64_t want);
absl::Status CheckAxis(const char* op, Axis axis);
absl::Status CheckTopKCount(const char* op, int64_t n, int64_t k, size_t indices);
// The shape the gathered block must have: k×cols (rows) or rows×k (cols), same batch.
absl::Status CheckSlices(const Context& ctx, const char* op, ConstTensorView full,
                         const char* full_name, ConstTensorView part, const char* part_name,
                         Axis axis, absl::Span<const int64_t> indices, bool distinct);
// All views contiguous f32 of x's shape (direction/grad may be any float dtype when allowed).
absl::Status CheckF32Like(const Context& ctx, const char* op, const char* name, ConstTensorView v,
                          ConstTensorView x, bool any_dtype = false);

}  // namespace diond::kernels::api

// The dispatcher's files (ops.cc, ops_steps.cc) call these checks unqualified; the one list of
// them is here so that a new check is named once.
namespace diond::kernels {

using api::CheckAxis;
using api::CheckContiguous;
using api::CheckDType;
using api::CheckF32Like;
using api::CheckF32Out;
using api::CheckFinite;
using api::CheckMatrix;
using api::CheckQrArgs;
using api::CheckSameShapeContiguous;
using api::CheckSlices;
using api::CheckTopKCount;
using api::CheckView;
using api::Invalid;
using api::SameShape;

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_API_VALIDATE_H_
