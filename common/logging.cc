#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace diond {
namespace {

std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
thread_local std::string t_session;
thread_local int64_t t_step = -1;
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
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
    case LogLevel::kFatal:
      return "FATAL";
  }
  return "?";
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text) {
  std::string t = absl::AsciiStrToLower(text);
  if (t == "text") return LogFormat::kText;
  if (t == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log format '", text.substr(0, 40), "' is not one of text, json"));
}

void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format)); }
LogFormat GetLogFormat() { return static_cast<LogFormat>(g_format.load()); }

LogContextSnapshot CurrentLogContext() { return {t_session, t_step}; }

ScopedLogContext::ScopedLogContext(absl::string_view session, int64_t step)
    : prev_session_(t_session), prev_step_(t_step) {
  // Without a step, a nested context of the same session keeps the enclosing step.
  if (step < 0 && session == t_session) return;
  t_session = std::string(session);
  t_step = step;
}

ScopedLogContext::~ScopedLogContext() {
  t_session = std::move(prev_session_);
  t_step = prev_step_;
}

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }
LogLevel MinLogLevel() {
  return static_cast<LogLevel>(g_min_level.load(std::memory_order_relaxed));
}
void SetLogSinkForTest(LogSink sink) { g_sink.store(sink); }

namespace logging_internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line) {
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  if (GetLogFormat() == LogFormat::kText) {
    stream_ << ' ' << LogLevelName(level) << ' ' << Basename(file) << ':' << line << "] ";
  } else {
    stream_ << '\n';  // the time, then the message; the destructor builds the JSON object
  }
}

LogMessage::~LogMessage() {
  std::string text = stream_.str();
  if (GetLogFormat() == LogFormat::kJson) {
    size_t nl = text.find('\n');
    nlohmann::ordered_json j;
    j["time"] = text.substr(0, nl);
    j["level"] = LogLevelName(level_);
    j["source"] = absl::StrCat(Basename(file_), ":", line_);
    j["session"] = t_session.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(t_session);
    j["step"] = t_step < 0 ? nlohmann::ordered_json() : nlohmann::ordered_json(t_step);
    j["message"] = text.substr(nl + 1);
    // Invalid UTF-8 in a message (a client's name, say) is replaced, never thrown.
    text = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  }
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
