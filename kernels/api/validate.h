// Device-independent argument checks of the ops dispatcher (kernels/api/ops.cc). Each returns
// INVALID_ARGUMENT with a message of the form
// "<Op>: <argument> is <layout>, <what was wanted>" (STYLE.md E2).
#ifndef DIOND_KERNELS_API_VALIDATE_H_
#define DIOND_KERNELS_API_VALIDATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/context.h"
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

}  // namespace diond::kernels::api

#endif  // DIOND_KERNELS_API_VALIDATE_H_
