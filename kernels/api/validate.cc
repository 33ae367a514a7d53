#include "kernels/api/validate.h"

#include <cmath>

namespace diond::kernels::api {

absl::Status CheckView(const Context& ctx, const char* op, const char* name, const TensorLayout& l,
                       const void* data, Device device, int min_rank) {
  if (l.rank < min_rank || l.rank > kMaxRank) {
    return Invalid(op, name, " has rank ", l.rank, ", want ", min_rank, "..", kMaxRank);
  }
  if (l.dtype != DType::kF32 && l.dtype != DType::kBf16 && l.dtype != DType::kF16) {
    return Invalid(op, name, " has an unknown dtype");
  }
  for (int i = 0; i < l.rank; ++i) {
    if (l.dims[i] < 0) return Invalid(op, name, " has a negative dim: ", l.DebugString());
  }
  if (device != ctx.device()) {
    return Invalid(op, name, " is on device ", static_cast<int>(device.type), ":", device.index,
                   ", not on the context's device");
  }
  if (data == nullptr && l.NumElements() > 0) {
    return Invalid(op, name, " ", l.DebugString(), " has a null data pointer");
  }
  return absl::OkStatus();
}

absl::Status CheckMatrix(const Context& ctx, const char* op, const char* name,
                         const TensorLayout& l, const void* data, Device device,
                         bool allow_vector) {
  const int min_rank = allow_vector ? 1 : 2;
  if (absl::Status s = CheckView(ctx, op, name, l, data, device, min_rank); !s.ok()) return s;
  if (l.Cols() > 1 && l.ColStride() != 1) {
    return Invalid(op, name, " ", l.DebugString(), " has column stride ", l.ColStride(),
                   ", want 1 (row-major matrices)");
  }
  if (l.Rows() > 1 && l.RowStride() < l.Cols()) {
    return Invalid(op, name, " ", l.DebugString(), " has row stride ", l.RowStride(), " < cols ",
                   l.Cols());
  }
  if (l.BatchStride() < 0) {
    return Invalid(op, name, " ", l.DebugString(), " has a negative batch stride");
  }
  return absl::OkStatus();
}

absl::Status CheckContiguous(const Context& ctx, const char* op, const char* name,
                             const TensorLayout& l, const void* data, Device device) {
  if (absl::Status s = CheckView(ctx, op, name, l, data, device); !s.ok()) return s;
  if (!l.IsContiguous()) return Invalid(op, name, " ", l.DebugString(), " is not contiguous");
  return absl::OkStatus();
}

bool SameShape(const TensorLayout& a, const TensorLayout& b) {
  if (a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i) {
    if (a.dims[i] != b.dims[i]) return false;
  }
  return true;
}

absl::Status CheckDType(const char* op, const char* name, const TensorLayout& l, DType want) {
  if (l.dtype != want) {
    return Invalid(op, name, " ", l.DebugString(), " has dtype ", DTypeName(l.dtype), ", want ",
                   DTypeName(want));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const char* op, const char* name, float v) {
  if (!std::isfinite(v)) return Invalid(op, name, " is ", v, ", want a finite value");
  return absl::OkStatus();
}

}  // namespace diond::kernels::api
