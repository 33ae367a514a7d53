#include "common/bounded.h"

#include "absl/strings/str_cat.h"

namespace diond {
namespace {

// Length of the longest prefix of `s` (at most `limit` bytes) that does not end inside a
// UTF-8 multi-byte character.
size_t Utf8Prefix(absl::string_view s, size_t limit) {
  if (s.size() <= limit) return s.size();
  size_t n = limit;
  // Step back over continuation bytes (10xxxxxx) to the start of the cut character.
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  return n;
}

std::string Sanitized(absl::string_view s) {
  std::string out(s);
  for (char& c : out) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = '?';  // control characters (newlines, NUL, escapes)
  }
  return out;
}

}  // namespace

std::string Bounded(absl::string_view value) {
  if (value.size() <= kMaxEchoBytes) return Sanitized(value);
  return absl::StrCat(Sanitized(value.substr(0, Utf8Prefix(value, kMaxEchoBytes))),
                      "\xe2\x80\xa6 (", value.size(), " bytes)");
}

std::string BoundedList(absl::Span<const int64_t> values, size_t max_items) {
  std::string out;
  for (size_t i = 0; i < values.size() && i < max_items; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ",", values[i]);
  }
  if (values.size() > max_items) {
    absl::StrAppend(&out, ",\xe2\x80\xa6 (", values.size(), " entries)");
  }
  return out;
}

std::string BoundedMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  return absl::StrCat(message.substr(0, Utf8Prefix(message, kMaxStatusMessageBytes)),
                      "\xe2\x80\xa6 (message of ", message.size(), " bytes cut)");
}

}  // namespace diond
