// What the fuzz targets share: the property check, the bounded-message property, the record
// reader of the inputs (one byte of kind, two of little-endian length, the payload) and quiet
// logs. Header-only: both ways of building tests/fuzz (CMakeLists.txt) compile only the targets'
// own .cc files against it.
#ifndef DIOND_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define DIOND_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"

namespace diond::fuzz {

// Aborts (a finding) with `what` when a property does not hold.
inline void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "property violated: %s\n", what);
    std::abort();
  }
}

// An error message is at most `max_bytes` long and one line. DIOND_FUZZ_VERBOSE=1 prints
// every status checked.
inline void RequireBoundedMessage(const absl::Status& s, size_t max_bytes) {
  if (std::getenv("DIOND_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr, "status: %s\n", s.ToString().c_str());
  }
  Require(s.message().size() <= max_bytes, max_bytes == 1024 ? "error message longer than 1 KiB"
                                                             : "error message longer than 2 KiB");
  for (char c : s.message()) Require(c != '\n' && c != '\0', "error message is not one line");
}

// The records of an input: one byte (the kind), two bytes of length (little-endian), that many
// bytes of payload (cut short at the end of the input).
class Records {
 public:
  Records(const char* data, size_t size) : p_(data), end_(data + size) {}
  bool Next(int* kind, std::string* bytes) {
    if (end_ - p_ < 3) return false;
    *kind = static_cast<unsigned char>(p_[0]);
    size_t len = static_cast<unsigned char>(p_[1]) |
                 (static_cast<size_t>(static_cast<unsigned char>(p_[2])) << 8);
    p_ += 3;
    len = std::min<size_t>(len, static_cast<size_t>(end_ - p_));
    bytes->assign(p_, len);
    p_ += len;
    return true;
  }

 private:
  const char* p_;
  const char* end_;
};

// protobuf logs every string field that is not UTF-8 (the gRPC server refuses those too).
inline void SilenceProtobufLogs() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

// The daemon's own logs down to errors, and no protobuf logs.
inline void QuietLogs() {
  diond::SetMinLogLevel(diond::LogLevel::kError);
  SilenceProtobufLogs();
}

}  // namespace diond::fuzz

#endif  // DIOND_TESTS_FUZZ_FUZZ_SUPPORT_H_
