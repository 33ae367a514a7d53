#include "diond/internal/chunking.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace diond::client::internal {

absl::Status ChunkTensors(const std::string& session_id, const std::vector<ConstTensorRef>& tensors,
                          int64_t chunk_bytes,
                          const std::function<bool(const v1::TensorChunk&)>& write) {
  if (chunk_bytes < 1 || chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", chunk_bytes, " not in [1, ", kMaxChunkBytes, "]"));
  }
  std::set<std::string> names;
  for (const ConstTensorRef& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("tensor with an empty name");
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' given twice"));
    }
  }
  bool first_of_stream = true;
  v1::TensorChunk chunk;
  for (const ConstTensorRef& t : tensors) {
    const int64_t total = static_cast<int64_t>(t.bytes.size());
    int64_t offset = 0;
    do {
      const int64_t n = std::min(chunk_bytes, total - offset);
      chunk.Clear();
      if (first_of_stream) chunk.set_session_id(session_id);
      first_of_stream = false;
      chunk.set_name(t.name);
      chunk.set_offset_bytes(offset);
      if (offset == 0) {
        chunk.set_total_bytes(total);
        if (t.dtype.has_value()) chunk.set_dtype(static_cast<v1::DType>(*t.dtype));
      }
      chunk.set_data(reinterpret_cast<const char*>(t.bytes.data()) + offset,
                     static_cast<size_t>(n));
      if (!write(chunk)) {
        return absl::UnavailableError(
            absl::StrCat("stream closed while sending '", t.name, "' at byte ", offset));
      }
      offset += n;
    } while (offset < total);
  }
  return absl::OkStatus();
}

Reassembler::Reassembler(std::vector<MutableTensorRef> destinations) : map_mode_(false) {
  for (MutableTensorRef& d : destinations) {
    Progress& p = progress_[d.name];
    p.data = d.bytes.data();
    destinations_.emplace(d.name, std::move(d));
  }
}

Reassembler::Reassembler() : map_mode_(true) {}

absl::Status Reassembler::Add(const v1::TensorChunk& chunk) {
  const std::string& name = chunk.name();
  const int64_t offset = chunk.offset_bytes();
  const int64_t size = static_cast<int64_t>(chunk.data().size());
  auto it = progress_.find(name);
  if (it == progress_.end()) {
    if (!map_mode_) {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon sent tensor '", name, "', which was not asked for"));
    }
    if (name.empty()) return absl::InvalidArgumentError("daemon sent a chunk without a name");
  }
  const bool known = it != progress_.end() && it->second.total_bytes >= 0;
  if (!known) {
    if (offset != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk at offset ",
                                                     offset, " before the chunk at offset 0"));
    }
    const int64_t total = chunk.total_bytes();
    if (total < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': total_bytes ", total, " < 0"));
    }
    if (!map_mode_ && total != static_cast<int64_t>(destinations_.at(name).bytes.size())) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': daemon sends ", total,
                                                     " bytes, the buffer holds ",
                                                     destinations_.at(name).bytes.size()));
    }
    if (size > total) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk of ", size,
                                                     " bytes passes total_bytes ", total));
    }
    // Checks passed: only now does the state change.
    Progress& p = progress_[name];
    p.total_bytes = total;
    if (map_mode_) {
      Tensor& t = tensors_[name];
      t.shape.assign(chunk.shape().begin(), chunk.shape().end());
      t.dtype = static_cast<DType>(chunk.dtype());
      t.bytes.assign(static_cast<size_t>(total), '\0');
      p.data = reinterpret_cast<uint8_t*>(t.bytes.data());
    }
    it = progress_.find(name);
  } else {
    Progress& p = it->second;
    if (offset < 0 || size > p.total_bytes || offset > p.total_bytes - size) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk [", offset, ", ",
                                                     offset + size, ") passes total_bytes ",
                                                     p.total_bytes));
    }
    // Overlap with the received range that starts at or before `offset`, or the next one.
    auto next = p.ranges.upper_bound(offset);
    bool overlaps = next != p.ranges.end() && next->first < offset + size;
    if (next != p.ranges.begin() && std::prev(next)->second > offset) overlaps = true;
    if (overlaps && size > 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': chunk [", offset, ", ",
                                                     offset + size,
                                                     ") overlaps bytes already received"));
    }
  }
  Progress& p = it->second;
  if (size > 0) {
    std::memcpy(p.data + offset, chunk.data().data(), static_cast<size_t>(size));
    p.ranges.emplace(offset, offset + size);
    p.received += size;
  }
  ++chunks_;
  return absl::OkStatus();
}

absl::Status Reassembler::Finish() {
  for (const auto& [name, p] : progress_) {
    if (p.total_bytes < 0) {
      return absl::DataLossError(absl::StrCat("tensor '", name, "' was not received"));
    }
    if (p.received != p.total_bytes) {
      return absl::DataLossError(absl::StrCat("tensor '", name, "': received ", p.received, " of ",
                                              p.total_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace diond::client::internal
