#include "common/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.cc copies little-endian data with memcpy; add byte swapping for this host"
#endif

namespace diond {
namespace {

using json = nlohmann::json;

// JSON nesting deeper than this is never valid in a header ({"t": {"shape": [..]}} is depth 3).
constexpr int kMaxJsonDepth = 8;

absl::Status Corrupt(absl::string_view source, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("safetensors '", source, "': ", what));
}

absl::Status CorruptTensor(absl::string_view source, absl::string_view tensor,
                           absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("safetensors '", source, "': tensor '", tensor, "': ", what));
}

bool ParseDtype(const std::string& s, SafetensorsDtype* out) {
  if (s == "F32")
    *out = SafetensorsDtype::kF32;
  else if (s == "F64")
    *out = SafetensorsDtype::kF64;
  else if (s == "BF16")
    *out = SafetensorsDtype::kBF16;
  else if (s == "F16")
    *out = SafetensorsDtype::kF16;
  else
    return false;
  return true;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);  // subnormal or zero
  } else if (exp == 31) {
    mag = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Product of the dimensions, or false on overflow past 2^62.
bool CheckedProduct(const std::vector<int64_t>& shape, int64_t* out) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > (int64_t{1} << 62) / d) return false;
    n *= d;
  }
  *out = n;
  return true;
}

absl::Status ParseTensorEntry(absl::string_view source, const std::string& name, const json& v,
                              uint64_t data_size, SafetensorsTensorInfo* info) {
  if (!v.is_object()) return CorruptTensor(source, name, "entry is not a JSON object");
  info->name = name;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return CorruptTensor(source, name, "missing dtype");
  if (!ParseDtype(dt->get<std::string>(), &info->dtype)) {
    return CorruptTensor(source, name,
                         absl::StrCat("unsupported dtype '", dt->get<std::string>(), "'"));
  }
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return CorruptTensor(source, name, "missing shape");
  for (const json& d : *sh) {
    if (!d.is_number_integer() ||
        (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0)) {
      return CorruptTensor(source, name, "shape has a non-integer or negative dimension");
    }
    if (d.is_number_unsigned() && d.get<uint64_t>() > (uint64_t{1} << 62)) {
      return CorruptTensor(source, name, "shape dimension too large");
    }
    info->shape.push_back(d.get<int64_t>());
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    return CorruptTensor(source, name, "data_offsets must be two non-negative integers");
  }
  info->begin = (*off)[0].get<uint64_t>();
  info->end = (*off)[1].get<uint64_t>();
  if (info->begin > info->end) {
    return CorruptTensor(
        source, name,
        absl::StrCat("data_offsets [", info->begin, ", ", info->end, "] are reversed"));
  }
  if (info->end > data_size) {
    return CorruptTensor(source, name,
                         absl::StrCat("data_offsets [", info->begin, ", ", info->end,
                                      "] exceed the data section of ", data_size, " bytes"));
  }
  int64_t count;
  if (!CheckedProduct(info->shape, &count)) {
    return CorruptTensor(source, name, "element count overflows");
  }
  const uint64_t want =
      static_cast<uint64_t>(count) * static_cast<uint64_t>(SafetensorsDtypeSize(info->dtype));
  if (info->end - info->begin != want) {
    return CorruptTensor(source, name,
                         absl::StrCat("byte size ", info->end - info->begin, " != ", want,
                                      " implied by dtype ", SafetensorsDtypeName(info->dtype),
                                      " and shape [", absl::StrJoin(info->shape, ","), "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kF64:
      return "F64";
    case SafetensorsDtype::kBF16:
      return "BF16";
    case SafetensorsDtype::kF16:
      return "F16";
  }
  return "?";
}

int64_t SafetensorsDtypeSize(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return 4;
    case SafetensorsDtype::kF64:
      return 8;
    case SafetensorsDtype::kBF16:
    case SafetensorsDtype::kF16:
      return 2;
  }
  return 0;
}

int64_t SafetensorsTensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("safetensors '", path, "': cannot open: ", std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Corrupt(path, "read error");
  return Parse(std::move(ss).str(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes,
                                                       absl::string_view source) {
  if (bytes.size() < 8) {
    return Corrupt(source, absl::StrCat("truncated: ", bytes.size(),
                                        " bytes, fewer than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > kMaxHeaderBytes) {
    return Corrupt(source, absl::StrCat("header length ", n, " exceeds the limit of ",
                                        kMaxHeaderBytes, " bytes"));
  }
  if (n > bytes.size() - 8) {
    return Corrupt(source, absl::StrCat("truncated: header length ", n, " but only ",
                                        bytes.size() - 8, " bytes follow"));
  }
  const char* hbegin = bytes.data() + 8;
  bool too_deep = false;
  json::parser_callback_t limit_depth = [&too_deep](int depth, json::parse_event_t, json&) -> bool {
    if (depth > kMaxJsonDepth) too_deep = true;
    return !too_deep;
  };
  json header = json::parse(hbegin, hbegin + n, limit_depth, /*allow_exceptions=*/false);
  if (too_deep) return Corrupt(source, "header JSON nested too deeply");
  if (header.is_discarded()) return Corrupt(source, "header is not valid JSON");
  if (!header.is_object()) return Corrupt(source, "header is not a JSON object");

  SafetensorsFile file;
  file.source_ = std::string(source);
  file.data_start_ = 8 + n;
  const uint64_t data_size = bytes.size() - file.data_start_;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Corrupt(source, "__metadata__ is not a JSON object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Corrupt(source,
                         absl::StrCat("__metadata__ value of '", m.key(), "' is not a string"));
        }
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsTensorInfo info;
    if (absl::Status s = ParseTensorEntry(source, it.key(), *it, data_size, &info); !s.ok()) {
      return s;
    }
    file.tensors_.push_back(std::move(info));
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The format packs tensors back to back: each starts where the previous one ended, and the last
  // one ends at the end of the file.
  uint64_t cursor = 0;
  for (const SafetensorsTensorInfo& t : file.tensors_) {
    if (t.begin < cursor) {
      return CorruptTensor(source, t.name,
                           absl::StrCat("data_offsets [", t.begin, ", ", t.end,
                                        "] overlap the previous tensor ending at ", cursor));
    }
    if (t.begin > cursor) {
      return CorruptTensor(source, t.name,
                           absl::StrCat("gap in the data section before offset ", t.begin,
                                        " (previous tensor ends at ", cursor, ")"));
    }
    cursor = t.end;
  }
  if (cursor != data_size) {
    return Corrupt(source, absl::StrCat("data section has ", data_size,
                                        " bytes but the tensors cover ", cursor));
  }
  file.bytes_ = std::move(bytes);
  return file;
}

const SafetensorsTensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  for (const SafetensorsTensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<absl::string_view> SafetensorsFile::RawBytes(absl::string_view name) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("safetensors '", source_, "': no tensor '", name, "'"));
  }
  return absl::string_view(bytes_.data() + data_start_ + t->begin, t->end - t->begin);
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat(absl::string_view name) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("safetensors '", source_, "': no tensor '", name, "'"));
  }
  const char* p = bytes_.data() + data_start_ + t->begin;
  const int64_t count = t->NumElements();
  std::vector<float> out(static_cast<size_t>(count));
  switch (t->dtype) {
    case SafetensorsDtype::kF32:
      if (count > 0) std::memcpy(out.data(), p, static_cast<size_t>(count) * 4);
      break;
    case SafetensorsDtype::kF64:
      for (int64_t i = 0; i < count; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case SafetensorsDtype::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    case SafetensorsDtype::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
  }
  return out;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat(
    absl::string_view name, absl::Span<const int64_t> expected_shape) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t != nullptr &&
      !std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors '", source_, "': tensor '", name, "' has shape [",
        absl::StrJoin(t->shape, ","), "], expected [", absl::StrJoin(expected_shape, ","), "]"));
  }
  return ReadFloat(name);
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

absl::Status SafetensorsWriter::AddF32(std::string name, std::vector<int64_t> shape,
                                       absl::Span<const float> data) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: invalid tensor name '", name, "'"));
  }
  for (const Entry& e : entries_) {
    if (e.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor '", name, "' added twice"));
    }
  }
  int64_t count;
  if (!CheckedProduct(shape, &count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: tensor '", name, "': invalid shape [", absl::StrJoin(shape, ","), "]"));
  }
  if (static_cast<int64_t>(data.size()) != count) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", name,
                                                   "': ", data.size(), " values for shape [",
                                                   absl::StrJoin(shape, ","), "]"));
  }
  entries_.push_back(
      Entry{std::move(name), std::move(shape), std::vector<float>(data.begin(), data.end())});
  return absl::OkStatus();
}

std::string SafetensorsWriter::Serialize() const {
  // nlohmann's ordered_json keeps insertion order, so the header lists tensors as added.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) md[k] = v;
    header["__metadata__"] = std::move(md);
  }
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    const uint64_t bytes = 4 * e.data.size();
    header[e.name] = {
        {"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string out;
  out.reserve(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += text;
  for (const Entry& e : entries_) {
    out.append(reinterpret_cast<const char*>(e.data.data()), 4 * e.data.size());
  }
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  const std::string image = Serialize();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::PermissionDeniedError(
        absl::StrCat("safetensors '", path, "': cannot create: ", std::strerror(errno)));
  }
  out.write(image.data(), static_cast<std::streamsize>(image.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("safetensors '", path, "': write failed"));
  return absl::OkStatus();
}

}  // namespace diond
