// Implementation of kernels/tensor.h: layouts, f16 conversion, the scratch arena and Tensor.
#include "kernels/tensor.h"

#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace diond::kernels {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBf16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

// IEEE binary16 <-> binary32. Written from the format definition: 1 sign, 5 exponent (bias 15),
// 10 mantissa bits; RNE on the bits shifted out, including into the subnormal range.
Float16 FloatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return Float16{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return Float16{static_cast<uint16_t>(sign | 0x7c00u)};  // ≥ 65520: Inf
  if (abs < 0x38800000u) {  // below the smallest normal f16 (2^-14): subnormal or zero
    if (abs < 0x33000000u) return Float16{static_cast<uint16_t>(sign)};  // < 2^-25 rounds to 0
    const int exp = static_cast<int>(abs >> 23);  // biased f32 exponent, 102..112
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exp;  // so that the result is mant >> shift in units of 2^-24
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return Float16{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in place, then shift by 13)
  r += 0xfffu + ((r >> 13) & 1u);
  return Float16{static_cast<uint16_t>(sign | (r >> 13))};
}

float F16ToFloat(Float16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  const uint32_t mant = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: mant · 2^-24
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int64_t TensorLayout::NumElements() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

bool TensorLayout::IsContiguous() const {
  if (NumElements() == 0) return true;
  int64_t expect = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (dims[i] != 1 && strides[i] != expect) return false;
    expect *= dims[i];
  }
  return true;
}

std::string TensorLayout::DebugString() const {
  std::vector<int64_t> d(dims, dims + rank);
  return absl::StrCat("[", absl::StrJoin(d, ", "), "] ", DTypeName(dtype));
}

TensorLayout ContiguousLayout(DType dtype, const std::vector<int64_t>& shape) {
  TensorLayout l;
  l.dtype = dtype;
  l.rank = static_cast<int>(shape.size() > kMaxRank ? kMaxRank : shape.size());
  int64_t s = 1;
  for (int i = l.rank - 1; i >= 0; --i) {
    l.dims[i] = shape[i];
    l.strides[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
  return l;
}

TensorLayout ContiguousLayout(DType dtype, std::initializer_list<int64_t> shape) {
  return ContiguousLayout(dtype, std::vector<int64_t>(shape));
}

// ---- ScratchArena ---------------------------------------------------------------------------

namespace {
void* HeapBlock(void*, size_t bytes) { return std::aligned_alloc(4096, bytes); }
void FreeHeapBlock(void*, void* p, size_t) { std::free(p); }
}  // namespace

ScratchArena::ScratchArena(size_t block_bytes)
    : ScratchArena(block_bytes, BlockAllocator{&HeapBlock, &FreeHeapBlock, nullptr}) {}

ScratchArena::ScratchArena(size_t block_bytes, BlockAllocator allocator)
    : block_bytes_(block_bytes ? block_bytes : 1), allocator_(allocator) {
  if (allocator_.allocate == nullptr || allocator_.deallocate == nullptr) {
    allocator_ = BlockAllocator{&HeapBlock, &FreeHeapBlock, nullptr};
  }
}

ScratchArena::~ScratchArena() {
  for (Block& b : blocks_) allocator_.deallocate(allocator_.user, b.data, b.size);
}

absl::StatusOr<void*> ScratchArena::Allocate(size_t bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("ScratchArena::Allocate: alignment ", alignment,
                                                   " is not a power of two <= 4096"));
  }
  if (bytes == 0) bytes = 1;
  // Try the current block, then later (already reserved) blocks, then a new block.
  while (current_ < blocks_.size()) {
    Block& b = blocks_[current_];
    const size_t aligned = (offset_ + alignment - 1) & ~(alignment - 1);
    if (aligned + bytes <= b.size) {
      offset_ = aligned + bytes;
      return static_cast<void*>(b.data + aligned);
    }
    ++current_;
    offset_ = 0;
  }
  const size_t size = ((bytes > block_bytes_ ? bytes : block_bytes_) + 4095) & ~size_t{4095};
  void* p = allocator_.allocate(allocator_.user, size);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ScratchArena: cannot allocate a block of ", size, " bytes"));
  }
  blocks_.push_back(Block{static_cast<char*>(p), size});
  current_ = blocks_.size() - 1;
  offset_ = bytes;
  return p;
}

void ScratchArena::Rewind(Position p) {
  current_ = p.block;
  offset_ = p.offset;
}

void ScratchArena::ReleaseUnused() {
  size_t keep = current_ + (offset_ > 0 ? 1 : 0);
  if (current_ >= blocks_.size()) keep = blocks_.size();
  while (blocks_.size() > keep) {
    allocator_.deallocate(allocator_.user, blocks_.back().data, blocks_.back().size);
    blocks_.pop_back();
  }
  if (current_ > blocks_.size()) current_ = blocks_.size();
}

size_t ScratchArena::bytes_reserved() const {
  size_t n = 0;
  for (const Block& b : blocks_) n += b.size;
  return n;
}

// ---- Tensor ---------------------------------------------------------------------------------

void Tensor::AlignedFree::operator()(void* p) const { std::free(p); }

absl::StatusOr<Tensor> Tensor::Allocate(DType dtype, const std::vector<int64_t>& shape,
                                        ScratchArena* arena) {
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Tensor::Allocate: rank ", shape.size(), " > ", kMaxRank));
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Tensor::Allocate: negative dim in [", absl::StrJoin(shape, ", "), "]"));
    }
    if (d > 0 && n > (int64_t{1} << 40) / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("Tensor::Allocate: shape [", absl::StrJoin(shape, ", "), "] too large"));
    }
    n *= d;
  }
  Tensor t;
  t.layout_ = ContiguousLayout(dtype, shape);
  const size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
  if (arena != nullptr) {
    auto p = arena->Allocate(bytes, 64);
    if (!p.ok()) return p.status();
    t.data_ = *p;
    return t;
  }
  const size_t rounded = ((bytes ? bytes : 1) + 63) & ~size_t{63};
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Tensor::Allocate: cannot allocate ", bytes, " bytes"));
  }
  t.heap_.reset(p);
  t.data_ = p;
  return t;
}

absl::StatusOr<Tensor> Tensor::Allocate(DType dtype, std::initializer_list<int64_t> shape,
                                        ScratchArena* arena) {
  return Allocate(dtype, std::vector<int64_t>(shape), arena);
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, const std::vector<int64_t>& shape,
                                     ScratchArena* arena) {
  auto t = Allocate(dtype, shape, arena);
  if (t.ok() && t->bytes() > 0) std::memset(t->data(), 0, t->bytes());
  return t;
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, std::initializer_list<int64_t> shape,
                                     ScratchArena* arena) {
  return Zeros(dtype, std::vector<int64_t>(shape), arena);
}

}  // namespace diond::kernels
