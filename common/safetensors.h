// Reader and writer of the safetensors file format (https://github.com/huggingface/safetensors):
//   8 bytes   little-endian uint64 N = length of the JSON header
//   N bytes   UTF-8 JSON object: one entry per tensor
//               {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}
//             plus an optional "__metadata__" object mapping strings to strings
//   rest      the data section; offsets are relative to its start, tensors are C-ordered,
//             little-endian, packed without gaps, and the section ends at the end of the file.
//
// Used for the optimizer conformance vectors (tests/conformance/README.md §1) and, later, the
// daemon's checkpoints. The reader treats its input as untrusted: every malformed file (truncated,
// absurd header length, bad JSON, unknown dtype, offsets out of range / overlapping / leaving
// gaps, byte size that does not match dtype x shape) yields absl::StatusCode::kDataLoss with a
// message naming the source and, where one is involved, the tensor. Nothing aborts or throws.
//
// The header parser accepts the dtypes F32, F64, BF16 and F16; element access converts any of
// them to float (F64 rounds to nearest). Only F32 is written.
//
// Thread-safety: a SafetensorsFile is immutable after construction and may be read from several
// threads. A SafetensorsWriter is not thread-safe.
#ifndef DIOND_COMMON_SAFETENSORS_H_
#define DIOND_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace diond {

enum class SafetensorsDtype { kF32, kF64, kBF16, kF16 };

// "F32", "F64", "BF16", "F16".
absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
// Size of one element in bytes (4, 8, 2, 2).
int64_t SafetensorsDtypeSize(SafetensorsDtype dtype);

struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // empty = scalar (one element)
  uint64_t begin = 0;          // byte offsets into the data section, [begin, end)
  uint64_t end = 0;
  int64_t NumElements() const;
};

// A parsed file held in memory.
class SafetensorsFile {
 public:
  // Largest header accepted; a larger length prefix is treated as corruption.
  static constexpr uint64_t kMaxHeaderBytes = 64ull << 20;

  // Reads and validates `path`. kNotFound if it cannot be opened, kDataLoss if it is malformed.
  static absl::StatusOr<SafetensorsFile> ReadFile(const std::string& path);
  // Validates an in-memory image; `source` names it in error messages.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes, absl::string_view source);

  const std::string& source() const { return source_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Tensors in data-offset order.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  // nullptr if absent.
  const SafetensorsTensorInfo* Find(absl::string_view name) const;
  bool Has(absl::string_view name) const { return Find(name) != nullptr; }

  // The tensor's elements converted to float. kNotFound if absent.
  absl::StatusOr<std::vector<float>> ReadFloat(absl::string_view name) const;
  // Same, and checks the shape: kInvalidArgument if it differs from `expected_shape`.
  absl::StatusOr<std::vector<float>> ReadFloat(absl::string_view name,
                                               absl::Span<const int64_t> expected_shape) const;
  // The tensor's raw little-endian bytes. kNotFound if absent.
  absl::StatusOr<absl::string_view> RawBytes(absl::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string source_;
  std::string bytes_;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensorInfo> tensors_;
};

// Builds a file: tensors are written in the order they were added.
class SafetensorsWriter {
 public:
  void SetMetadata(std::string key, std::string value);
  // kInvalidArgument if `name` is empty, "__metadata__", already added, or if data.size() differs
  // from the product of `shape` (or a dimension is negative).
  absl::Status AddF32(std::string name, std::vector<int64_t> shape, absl::Span<const float> data);
  // The complete file image (header padded with spaces to a multiple of 8 bytes).
  std::string Serialize() const;
  // Writes Serialize() to `path` (kPermissionDenied / kInternal on I/O failure).
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;
  };
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
};

}  // namespace diond

#endif  // DIOND_COMMON_SAFETENSORS_H_
