#include "kernels/api/validate.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/status_macros.h"

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

absl::Status CheckSameShapeContiguous(const Context& ctx, const char* op, ConstTensorView x,
                                      const char* xname, TensorView out) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, xname, x));
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, "out", out));
  if (!SameShape(x.layout(), out.layout())) {
    return Invalid(op, "out is ", out.DebugString(), ", want the shape of ", xname, " ",
                   x.DebugString());
  }
  return absl::OkStatus();
}

// Thin-QR family: a f32 m×n with m >= n, q like a, r (if given) n×n f32, same batch.
absl::Status CheckQrArgs(const Context& ctx, const char* op, ConstTensorView a, TensorView q,
                         TensorView r) {
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, op, "a", a));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, op, "q", q));
  DIOND_RETURN_IF_ERROR(CheckDType(op, "a", a.layout(), DType::kF32));
  DIOND_RETURN_IF_ERROR(CheckDType(op, "q", q.layout(), DType::kF32));
  if (a.Rows() < a.Cols()) {
    return Invalid(op, "a is ", a.DebugString(), ", want rows >= cols (thin QR of a tall matrix)");
  }
  if (!SameShape(a.layout(), q.layout())) {
    return Invalid(op, "q is ", q.DebugString(), ", want the shape of a ", a.DebugString());
  }
  if (!r.empty()) {
    DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, op, "r", r));
    DIOND_RETURN_IF_ERROR(CheckDType(op, "r", r.layout(), DType::kF32));
    if (r.Rows() != a.Cols() || r.Cols() != a.Cols() || r.Batch() != a.Batch()) {
      return Invalid(op, "r is ", r.DebugString(), ", want ",
                     a.Batch() > 1 || a.rank() == 3 ? "[batch, n, n]" : "[n, n]",
                     " with n = ", a.Cols());
    }
  }
  return absl::OkStatus();
}

absl::Status CheckF32Out(const Context& ctx, const char* op, TensorView out, int64_t want) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, "out", out));
  DIOND_RETURN_IF_ERROR(CheckDType(op, "out", out.layout(), DType::kF32));
  if (out.NumElements() != want) {
    return Invalid(op, "out ", out.DebugString(), " has ", out.NumElements(), " elements, want ",
                   want);
  }
  return absl::OkStatus();
}

absl::Status CheckAxis(const char* op, Axis axis) {
  if (axis != Axis::kRows && axis != Axis::kCols) {
    return Invalid(op, "unknown axis ", static_cast<int>(axis));
  }
  return absl::OkStatus();
}

absl::Status CheckTopKCount(const char* op, int64_t n, int64_t k, size_t indices) {
  if (k < 1 || k > n) return Invalid(op, "k is ", k, ", want 1..", n);
  if (static_cast<int64_t>(indices) != k) {
    return Invalid(op, "indices has ", indices, " entries, want k = ", k);
  }
  return absl::OkStatus();
}

// The shape the gathered block must have: k×cols (rows) or rows×k (cols), same batch.
absl::Status CheckSlices(const Context& ctx, const char* op, ConstTensorView full,
                         const char* full_name, ConstTensorView part, const char* part_name,
                         Axis axis, absl::Span<const int64_t> indices, bool distinct) {
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, op, full_name, full));
  DIOND_RETURN_IF_ERROR(CheckMatrix(ctx, op, part_name, part));
  DIOND_RETURN_IF_ERROR(CheckAxis(op, axis));
  const int64_t k = static_cast<int64_t>(indices.size());
  const int64_t limit = axis == Axis::kRows ? full.Rows() : full.Cols();
  const int64_t want_r = axis == Axis::kRows ? k : full.Rows();
  const int64_t want_c = axis == Axis::kRows ? full.Cols() : k;
  if (part.Rows() != want_r || part.Cols() != want_c || part.Batch() != full.Batch() ||
      part.rank() != full.rank()) {
    return Invalid(op, part_name, " is ", part.DebugString(), ", want ", want_r, "x", want_c,
                   " matrices, batch ", full.Batch(), " (", full_name, " ", full.DebugString(),
                   ", ", k, " indices)");
  }
  for (int64_t i = 0; i < k; ++i) {
    if (indices[i] < 0 || indices[i] >= limit) {
      return Invalid(op, "indices[", i, "] = ", indices[i], " is outside [0, ", limit, ")");
    }
  }
  if (distinct) {
    std::vector<int64_t> sorted(indices.begin(), indices.end());
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) return Invalid(op, "index ", *dup, " appears more than once");
  }
  return absl::OkStatus();
}

// All views contiguous f32 of x's shape (direction/grad may be any float dtype when allowed).
absl::Status CheckF32Like(const Context& ctx, const char* op, const char* name, ConstTensorView v,
                          ConstTensorView x, bool any_dtype) {
  DIOND_RETURN_IF_ERROR(CheckContiguous(ctx, op, name, v));
  if (!any_dtype) DIOND_RETURN_IF_ERROR(CheckDType(op, name, v.layout(), DType::kF32));
  if (!SameShape(v.layout(), x.layout())) {
    return Invalid(op, name, " is ", v.DebugString(), ", want the shape of x ", x.DebugString());
  }
  return absl::OkStatus();
}

}  // namespace diond::kernels::api
