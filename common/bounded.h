// Bounded echoes of client input in error messages: a name, a path or a
// list that a client sent may be megabytes long, and a status message that repeats it whole
// makes a default gRPC client fail with "received initial metadata size exceeds limit" instead
// of showing the real error. Every message that echoes a client value goes through these.
#ifndef DIOND_COMMON_BOUNDED_H_
#define DIOND_COMMON_BOUNDED_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace diond {

// The most characters of one echoed value.
inline constexpr size_t kMaxEchoBytes = 200;
// The most bytes of a whole status message once it leaves the daemon (server/rpc caps there).
inline constexpr size_t kMaxStatusMessageBytes = 4096;

// `value` itself when it has at most kMaxEchoBytes bytes; otherwise its first kMaxEchoBytes
// bytes (cut at a UTF-8 character boundary) followed by "… (N bytes)". Control characters
// (newlines, NUL, escapes) are shown as '?', so that a message stays one line whatever the
// client sent.
std::string Bounded(absl::string_view value);

// "a,b,c" for at most `max_items` entries, then ",… (N entries)".
std::string BoundedList(absl::Span<const int64_t> values, size_t max_items = 16);

// A whole message cut to kMaxStatusMessageBytes (last line of defence; see server/rpc).
std::string BoundedMessage(absl::string_view message);

}  // namespace diond

#endif  // DIOND_COMMON_BOUNDED_H_
