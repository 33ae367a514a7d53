#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace diond {
namespace {

std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<LogSink> g_sink{nullptr};
absl::Mutex g_write_mu;

absl::string_view Basename(absl::string_view path) {
  size_t pos = path.find_last_of('/');
  return pos == absl::string_view::npos ? path : path.substr(pos + 1);
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text) {
  std::string t = absl::AsciiStrToLower(text);
  if (t == "debug") return LogLevel::kDebug;
  if (t == "info") return LogLevel::kInfo;
  if (t == "warning" || t == "warn") return LogLevel::kWarning;
  if (t == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("log level '", text, "' is not one of debug, info, warning, error"));
}

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
    case LogLevel::kFatal: return "FATAL";
  }
  return "?";
}

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load(std::memory_order_relaxed)); }
void SetLogSinkForTest(LogSink sink) { g_sink.store(sink); }

namespace logging_internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << ' '
          << LogLevelName(level) << ' ' << Basename(file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  std::string text = stream_.str();
  if (LogSink sink = g_sink.load()) {
    sink(level_, text);
  } else {
    absl::MutexLock lock(&g_write_mu);
    std::fprintf(stderr, "%s\n", text.c_str());
    std::fflush(stderr);
  }
  if (level_ == LogLevel::kFatal) std::abort();
}

}  // namespace logging_internal
}  // namespace diond
