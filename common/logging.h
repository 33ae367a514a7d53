// Logging facade (STYLE.md O6). Abseil 20220623 has no absl/log, so diond logs through this one
// header: leveled, thread-safe, one line per message to stderr with a UTC timestamp, level and
// source location. Set the threshold once at start-up with SetMinLogLevel (flag --log_level).
//
//   DIOND_LOG(INFO) << "listening on " << addr;
//   DIOND_CHECK(ptr != nullptr) << "broken invariant";   // internal invariants only (STYLE.md E7)
//
// Never log per element or per step at INFO on hot paths.
#ifndef DIOND_COMMON_LOGGING_H_
#define DIOND_COMMON_LOGGING_H_

#include <cstdint>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace diond {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

// Parses "debug", "info", "warning", "error" (case-insensitive).
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text);
absl::string_view LogLevelName(LogLevel level);

void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
inline bool LogEnabled(LogLevel level) { return level >= MinLogLevel(); }

// Line format (flag --log_format): kText is "<time> <LEVEL> <file>:<line>] <message>"; kJson is
// one JSON object per line for log shippers:
//   {"time":"2026-12-01T09:00:00.123Z","level":"INFO","source":"daemon.cc:42",
//    "session":"s-1a2b","step":7,"message":"..."}
// `session` and `step` come from the calling thread's ScopedLogContext (null outside one).
enum class LogFormat : int { kText = 0, kJson = 1 };
// "text" or "json" (case-insensitive).
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text);
void SetLogFormat(LogFormat format);
LogFormat GetLogFormat();

// The calling thread's log context (what ScopedLogContext set), to carry work to another thread.
struct LogContextSnapshot {
  std::string session;
  int64_t step = -1;
};
LogContextSnapshot CurrentLogContext();

// While alive, log lines of this thread carry `session` (and `step` when >= 0). Nests: the
// innermost wins, except that a context without a step inside one of the same session keeps
// that step; the previous context comes back on destruction. The strings are copied.
class ScopedLogContext {
 public:
  explicit ScopedLogContext(absl::string_view session, int64_t step = -1);
  ~ScopedLogContext();
  ScopedLogContext(const ScopedLogContext&) = delete;
  ScopedLogContext& operator=(const ScopedLogContext&) = delete;

 private:
  std::string prev_session_;
  int64_t prev_step_;
};

// Redirects log lines to `sink` instead of stderr (tests); nullptr restores stderr.
using LogSink = void (*)(LogLevel level, const std::string& line);
void SetLogSinkForTest(LogSink sink);

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  ~LogMessage();  // emits the line; aborts after emitting for kFatal
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Swallows the stream in the disabled branch of DIOND_LOG.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace diond

#define DIOND_LOG_LEVEL_DEBUG ::diond::LogLevel::kDebug
#define DIOND_LOG_LEVEL_INFO ::diond::LogLevel::kInfo
#define DIOND_LOG_LEVEL_WARNING ::diond::LogLevel::kWarning
#define DIOND_LOG_LEVEL_ERROR ::diond::LogLevel::kError
#define DIOND_LOG_LEVEL_FATAL ::diond::LogLevel::kFatal

// NOLINTBEGIN(bugprone-macro-parentheses): `<<` must bind to the message after the expansion.
#define DIOND_LOG(severity)                                                                       \
  !::diond::LogEnabled(DIOND_LOG_LEVEL_##severity)                                                \
      ? (void)0                                                                                   \
      : ::diond::logging_internal::Voidify() &                                                    \
            ::diond::logging_internal::LogMessage(DIOND_LOG_LEVEL_##severity, __FILE__, __LINE__) \
                .stream()

// Fatal check for broken internal invariants only; never for request-derived values.
#define DIOND_CHECK(cond)                                                                        \
  (cond)                                                                                         \
      ? (void)0                                                                                  \
      : ::diond::logging_internal::Voidify() &                                                   \
            ::diond::logging_internal::LogMessage(::diond::LogLevel::kFatal, __FILE__, __LINE__) \
                    .stream()                                                                    \
                << "Check failed: " #cond " "
// NOLINTEND(bugprone-macro-parentheses)

#endif  // DIOND_COMMON_LOGGING_H_
