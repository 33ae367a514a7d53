// Tensor views and owning tensor buffers for the ops API (ARCHITECTURE.md §3, kernels/ops.h).
//
// A view is a non-owning (pointer, device, dtype, shape, strides) record of a tensor of rank 0..3.
// Matrices are rank 2 [rows, cols]; a rank-3 view [batch, rows, cols] is a stack of same-shape
// matrices (a "megabatch"). Strides are in elements, not bytes. Ops state what layout they accept:
// most want row-major matrices with unit column stride (stride[-1] == 1) and any row / batch
// stride; elementwise ops want contiguous views (IsContiguous()).
//
// Storage dtypes: f32, bf16 and f16. bf16/f16 values are stored as their 16-bit patterns; all
// arithmetic of the ops is done in f32 (see ops.h for where results are rounded).
//
// `Tensor` owns a 64-byte-aligned buffer, either on the heap or inside a ScratchArena (then the
// arena owns the bytes and the Tensor only borrows them until the arena is rewound).
//
// Thread-safety: views are plain values. A Tensor is not synchronized; a ScratchArena must be
// used by one thread at a time (each Context has its own, see context.h).
#ifndef DIOND_KERNELS_TENSOR_H_
#define DIOND_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/device.h"

namespace diond::kernels {

// ---- dtypes ---------------------------------------------------------------------------------

enum class DType : uint8_t { kF32, kBf16, kF16 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
absl::string_view DTypeName(DType t);  // "f32", "bf16", "f16"

// 16-bit storage types. They are plain bit patterns; use the conversion functions below.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2 && sizeof(Float16) == 2, "16-bit storage types");

// f32 -> bf16 with round-to-nearest-even. NaN stays NaN (quiet, sign kept); ±Inf stays ±Inf;
// finite values that round past the largest bf16 become ±Inf (IEEE overflow under RNE).
inline BFloat16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // RNE: add half an ulp minus one, plus the lsb of the result. Written as a select (no early
  // return) so that loops over arrays vectorize.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return BFloat16{static_cast<uint16_t>(is_nan ? quiet_nan : rounded)};
}
// bf16 -> f32 is exact.
inline float Bf16ToFloat(BFloat16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Rounds an f32 value to the nearest bf16 value and widens it back (the "bf(x)" of ALGORITHMS.md).
inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// f32 <-> IEEE binary16, round-to-nearest-even, subnormals and NaN/Inf handled (tensor.cc).
Float16 FloatToF16(float f);
float F16ToFloat(Float16 h);

// ---- devices --------------------------------------------------------------------------------

// Where a view's bytes live. Only kCpu has a backend today; ops reject other devices with
// INVALID_ARGUMENT until the CUDA backend lands.
struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// ---- views ----------------------------------------------------------------------------------

inline constexpr int kMaxRank = 3;

// Shared layout record of TensorView and ConstTensorView.
struct TensorLayout {
  DType dtype = DType::kF32;
  int rank = 0;
  int64_t dims[kMaxRank] = {0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0};  // elements

  int64_t NumElements() const;
  // Row-major, no gaps: strides[rank-1] == 1 and strides[i] == strides[i+1] * dims[i+1]
  // (size-1 dims are not checked). An empty tensor is contiguous.
  bool IsContiguous() const;
  // Matrix interpretation used by the matrix ops: rank 1 [n] is a 1×n matrix, rank 2 is one
  // matrix, rank 3 is dims[0] matrices. Batch() of rank 0/1/2 is 1.
  int64_t Batch() const { return rank == 3 ? dims[0] : 1; }
  int64_t Rows() const { return rank >= 2 ? dims[rank - 2] : 1; }
  int64_t Cols() const { return rank >= 1 ? dims[rank - 1] : 1; }
  int64_t RowStride() const { return rank >= 2 ? strides[rank - 2] : Cols(); }
  int64_t ColStride() const { return rank >= 1 ? strides[rank - 1] : 1; }
  int64_t BatchStride() const { return rank == 3 ? strides[0] : 0; }
  // "[4, 1024, 768] bf16" for error messages.
  std::string DebugString() const;
};

// Row-major contiguous layout for `shape` (0 to 3 dims; negative sizes are a caller bug that the
// ops reject with INVALID_ARGUMENT through Validate* helpers).
TensorLayout ContiguousLayout(DType dtype, std::initializer_list<int64_t> shape);
TensorLayout ContiguousLayout(DType dtype, const std::vector<int64_t>& shape);

template <typename Ptr>
class BasicTensorView {
 public:
  BasicTensorView() = default;
  BasicTensorView(Ptr data, const TensorLayout& layout, Device device = Device{})
      : data_(data), layout_(layout), device_(device) {}
  // TensorView converts to ConstTensorView.
  template <typename Other, typename = std::enable_if_t<std::is_convertible_v<Other, Ptr> &&
                                                        !std::is_same_v<Other, Ptr>>>
  BasicTensorView(const BasicTensorView<Other>& o)  // NOLINT(google-explicit-constructor)
      : data_(o.data()), layout_(o.layout()), device_(o.device()) {}

  Ptr data() const { return data_; }
  const TensorLayout& layout() const { return layout_; }
  Device device() const { return device_; }
  DType dtype() const { return layout_.dtype; }
  int rank() const { return layout_.rank; }
  int64_t dim(int i) const { return layout_.dims[i]; }
  int64_t stride(int i) const { return layout_.strides[i]; }
  int64_t NumElements() const { return layout_.NumElements(); }
  bool IsContiguous() const { return layout_.IsContiguous(); }
  bool empty() const { return data_ == nullptr && layout_.rank == 0; }
  int64_t Batch() const { return layout_.Batch(); }
  int64_t Rows() const { return layout_.Rows(); }
  int64_t Cols() const { return layout_.Cols(); }
  std::string DebugString() const { return layout_.DebugString(); }

  // Typed pointer to element 0 (caller asserts the dtype).
  template <typename T>
  auto As() const {
    using R = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const T*, T*>;
    return static_cast<R>(data_);
  }

  // Matrix `b` of a rank-3 view as a rank-2 view (rank-2 views: b must be 0, returns *this).
  // No bounds check beyond a debug assert: ops validate indices before calling this.
  BasicTensorView Matrix(int64_t b) const {
    if (layout_.rank != 3) return *this;
    TensorLayout l;
    l.dtype = layout_.dtype;
    l.rank = 2;
    l.dims[0] = layout_.dims[1];
    l.dims[1] = layout_.dims[2];
    l.strides[0] = layout_.strides[1];
    l.strides[1] = layout_.strides[2];
    return BasicTensorView(Offset(b * layout_.strides[0]), l, device_);
  }
  // Rows [begin, begin+count) of a rank-2 view (or of every matrix of a rank-3 view).
  BasicTensorView RowRange(int64_t begin, int64_t count) const {
    TensorLayout l = layout_;
    l.dims[l.rank - 2] = count;
    return BasicTensorView(Offset(begin * layout_.strides[l.rank - 2]), l, device_);
  }
  // Columns [begin, begin+count).
  BasicTensorView ColRange(int64_t begin, int64_t count) const {
    TensorLayout l = layout_;
    l.dims[l.rank - 1] = count;
    return BasicTensorView(Offset(begin * layout_.strides[l.rank - 1]), l, device_);
  }
  // The last two dims swapped (no copy; the result has unit row stride, not unit column
  // stride, so only ops that accept arbitrary strides, e.g. Copy, take it directly).
  BasicTensorView Transposed() const {
    TensorLayout l = layout_;
    if (l.rank >= 2) {
      std::swap(l.dims[l.rank - 1], l.dims[l.rank - 2]);
      std::swap(l.strides[l.rank - 1], l.strides[l.rank - 2]);
    }
    return BasicTensorView(data_, l, device_);
  }
  // Same data, new contiguous shape; only valid on a contiguous view with the same element
  // count (checked by the caller; Reshape of a non-contiguous view is a programming error).
  BasicTensorView Reshaped(std::initializer_list<int64_t> shape) const {
    return BasicTensorView(data_, ContiguousLayout(layout_.dtype, shape), device_);
  }

 private:
  Ptr Offset(int64_t elements) const {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
    return static_cast<Ptr>(static_cast<Byte*>(data_) +
                            elements * static_cast<int64_t>(DTypeSize(layout_.dtype)));
  }

  Ptr data_ = nullptr;
  TensorLayout layout_;
  Device device_;
};

using TensorView = BasicTensorView<void*>;
using ConstTensorView = BasicTensorView<const void*>;

// Contiguous views over caller memory (CPU device).
inline TensorView MakeView(float* p, std::initializer_list<int64_t> shape) {
  return TensorView(p, ContiguousLayout(DType::kF32, shape));
}
inline ConstTensorView MakeView(const float* p, std::initializer_list<int64_t> shape) {
  return ConstTensorView(p, ContiguousLayout(DType::kF32, shape));
}
inline TensorView MakeView(BFloat16* p, std::initializer_list<int64_t> shape) {
  return TensorView(p, ContiguousLayout(DType::kBf16, shape));
}
inline ConstTensorView MakeView(const BFloat16* p, std::initializer_list<int64_t> shape) {
  return ConstTensorView(p, ContiguousLayout(DType::kBf16, shape));
}
inline TensorView MakeView(Float16* p, std::initializer_list<int64_t> shape) {
  return TensorView(p, ContiguousLayout(DType::kF16, shape));
}
inline ConstTensorView MakeView(const Float16* p, std::initializer_list<int64_t> shape) {
  return ConstTensorView(p, ContiguousLayout(DType::kF16, shape));
}

// ---- scratch arena --------------------------------------------------------------------------

// A growable bump allocator for temporaries inside ops (and for callers that want the same).
// Memory comes in blocks that are never moved, so pointers stay valid until Rewind() passes
// below them. Typical use:
//   ScratchArena::Scope scope(arena);          // rewinds when it goes out of scope
//   DIOND_ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(DType::kF32, {m, n}, &arena));
// Not thread-safe. Contents are uninitialized.
class ScratchArena {
 public:
  // Where blocks come from (a Context routes them through its backend's allocator); the default
  // is the C heap, 4096-byte aligned. allocate returns nullptr when out of memory.
  struct BlockAllocator {
    void* (*allocate)(void* user, size_t bytes) = nullptr;
    void (*deallocate)(void* user, void* p, size_t bytes) = nullptr;
    void* user = nullptr;
  };
  explicit ScratchArena(size_t block_bytes = size_t{64} << 20);
  ScratchArena(size_t block_bytes, BlockAllocator allocator);
  ~ScratchArena();
  ScratchArena(const ScratchArena&) = delete;
  ScratchArena& operator=(const ScratchArena&) = delete;

  // `bytes` aligned to `alignment` (a power of two, at most 4096). RESOURCE_EXHAUSTED if the
  // system allocator fails, INVALID_ARGUMENT for a bad alignment.
  absl::StatusOr<void*> Allocate(size_t bytes, size_t alignment = 64);

  // Position to rewind to; Rewind(m) frees (for reuse) everything allocated after Mark() == m.
  // Blocks are kept for reuse; ReleaseUnused() returns blocks above the current position.
  struct Position {
    size_t block = 0;
    size_t offset = 0;
  };
  Position Mark() const { return {current_, offset_}; }
  void Rewind(Position p);
  void ReleaseUnused();
  size_t bytes_reserved() const;

  class Scope {
   public:
    explicit Scope(ScratchArena& a) : arena_(a), mark_(a.Mark()) {}
    ~Scope() { arena_.Rewind(mark_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ScratchArena& arena_;
    Position mark_;
  };

 private:
  struct Block {
    char* data;
    size_t size;
  };
  std::vector<Block> blocks_;
  size_t current_ = 0;  // index into blocks_ (== blocks_.size() when none yet)
  size_t offset_ = 0;
  size_t block_bytes_;
  BlockAllocator allocator_;
};

// ---- owning tensor --------------------------------------------------------------------------

// An owning (or arena-borrowing) contiguous CPU tensor. Move-only.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  // Uninitialized contiguous tensor of `shape` (0..3 dims, each >= 0). With `arena` the bytes
  // come from the arena and are valid until the arena is rewound below them; otherwise from the
  // heap. INVALID_ARGUMENT for a bad shape, RESOURCE_EXHAUSTED if allocation fails.
  static absl::StatusOr<Tensor> Allocate(DType dtype, std::initializer_list<int64_t> shape,
                                         ScratchArena* arena = nullptr);
  static absl::StatusOr<Tensor> Allocate(DType dtype, const std::vector<int64_t>& shape,
                                         ScratchArena* arena = nullptr);
  // As Allocate, then every byte zero (0.0 in every dtype).
  static absl::StatusOr<Tensor> Zeros(DType dtype, std::initializer_list<int64_t> shape,
                                      ScratchArena* arena = nullptr);
  static absl::StatusOr<Tensor> Zeros(DType dtype, const std::vector<int64_t>& shape,
                                      ScratchArena* arena = nullptr);

  TensorView view() { return TensorView(data_, layout_); }
  ConstTensorView view() const { return ConstTensorView(data_, layout_); }
  ConstTensorView cview() const { return ConstTensorView(data_, layout_); }
  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* As() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* As() const {
    return static_cast<const T*>(data_);
  }
  const TensorLayout& layout() const { return layout_; }
  DType dtype() const { return layout_.dtype; }
  int64_t NumElements() const { return layout_.NumElements(); }
  size_t bytes() const { return static_cast<size_t>(NumElements()) * DTypeSize(layout_.dtype); }

 private:
  struct AlignedFree {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, AlignedFree> heap_;  // null when arena-backed
  void* data_ = nullptr;
  TensorLayout layout_;
};

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_TENSOR_H_
