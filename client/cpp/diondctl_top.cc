// diondctl's `top`: live steps/s, latency and errors from the daemon's /metrics, scraped with
// libcurl and read as Prometheus's text format.
#include "client/cpp/diondctl_top.h"

#include <curl/curl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, metrics_url);
ABSL_DECLARE_FLAG(absl::Duration, interval);
ABSL_DECLARE_FLAG(int, iterations);
ABSL_DECLARE_FLAG(absl::Duration, timeout);

namespace diondctl {

std::string Bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

namespace {

// ---- top: /metrics -----------------------------------------------------------------------------

// One sample of the Prometheus text format: name, labels, value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

size_t AppendBody(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

bool Fetch(const std::string& url, std::string* body, std::string* error) {
  CURL* curl = curl_easy_init();
  if (curl == nullptr) {
    *error = "curl_easy_init failed";
    return false;
  }
  char err[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &AppendBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, body);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, err);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_FAILONERROR, 1L);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS,
                   static_cast<long>(absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_timeout))));
  CURLcode rc = curl_easy_perform(curl);
  curl_easy_cleanup(curl);
  if (rc != CURLE_OK) *error = err[0] != '\0' ? err : curl_easy_strerror(rc);
  return rc == CURLE_OK;
}

// The text exposition format (as prometheus-cpp writes it): `name{k="v",...} value [ts]`.
std::vector<Sample> ParseExposition(const std::string& text) {
  std::vector<Sample> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t i = line.find_first_of("{ ");
    if (i == absl::string_view::npos) continue;
    s.name = std::string(line.substr(0, i));
    if (line[i] == '{') {
      size_t j = i + 1;
      while (j < line.size() && line[j] != '}') {
        size_t eq = line.find('=', j);
        if (eq == absl::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') break;
        std::string key(absl::StripAsciiWhitespace(line.substr(j, eq - j)));
        std::string value;
        size_t k = eq + 2;
        for (; k < line.size() && line[k] != '"'; ++k) {
          if (line[k] == '\\' && k + 1 < line.size()) {
            ++k;
            value.push_back(line[k] == 'n' ? '\n' : line[k]);
          } else {
            value.push_back(line[k]);
          }
        }
        s.labels[key] = value;
        j = k + 1;
        if (j < line.size() && line[j] == ',') ++j;
      }
      i = line.find('}', i);
      if (i == absl::string_view::npos) continue;
      ++i;
    }
    std::vector<absl::string_view> rest =
        absl::StrSplit(line.substr(i), ' ', absl::SkipWhitespace());
    if (rest.empty()) continue;
    std::string v(rest[0]);
    if (v == "+Inf") {
      s.value = std::numeric_limits<double>::infinity();
    } else if (v == "-Inf") {
      s.value = -std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(v, &s.value)) {
      continue;
    }
    out.push_back(std::move(s));
  }
  return out;
}

struct Scrape {
  absl::Time at;
  std::vector<Sample> samples;

  double Sum(
      absl::string_view name,
      const std::function<bool(const std::map<std::string, std::string>&)>& keep = nullptr) const {
    double total = 0;
    for (const Sample& s : samples) {
      if (s.name == name && (!keep || keep(s.labels))) total += s.value;
    }
    return total;
  }
  // Cumulative bucket counts by upper bound.
  std::map<double, double> Buckets(absl::string_view histogram) const {
    std::map<double, double> b;
    const std::string name = absl::StrCat(histogram, "_bucket");
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      auto le = s.labels.find("le");
      if (le == s.labels.end()) continue;
      double bound = le->second == "+Inf" ? INFINITY : std::strtod(le->second.c_str(), nullptr);
      b[bound] += s.value;
    }
    return b;
  }
};

// The q-quantile of the observations between two scrapes, interpolated inside its bucket as
// Prometheus's histogram_quantile does; nullopt when nothing was observed.
std::optional<double> Quantile(const std::map<double, double>& before,
                               const std::map<double, double>& after, double q) {
  std::vector<std::pair<double, double>> delta;
  for (const auto& [bound, count] : after) {
    auto it = before.find(bound);
    delta.push_back({bound, count - (it == before.end() ? 0 : it->second)});
  }
  if (delta.empty() || delta.back().second <= 0) return std::nullopt;
  const double rank = q * delta.back().second;
  double lower = 0, below = 0;
  for (const auto& [bound, count] : delta) {
    if (count >= rank) {
      if (std::isinf(bound)) return lower;  // above the last finite bucket
      const double in_bucket = count - below;
      return in_bucket <= 0 ? bound : lower + (bound - lower) * (rank - below) / in_bucket;
    }
    lower = bound;
    below = count;
  }
  return lower;
}

bool TakeScrape(const std::string& url, Scrape* s) {
  std::string body, error;
  if (!Fetch(url, &body, &error)) {
    std::fprintf(stderr, "diondctl: %s: %s\n", url.c_str(), error.c_str());
    return false;
  }
  s->at = absl::Now();
  s->samples = ParseExposition(body);
  return true;
}

}  // namespace

int Top() {
  const std::string url = absl::GetFlag(FLAGS_metrics_url);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  const bool json = absl::GetFlag(FLAGS_json);
  const bool tty = !json && isatty(STDOUT_FILENO);
  curl_global_init(CURL_GLOBAL_DEFAULT);
  Scrape prev;
  if (!TakeScrape(url, &prev)) return 1;
  auto is_step = [](const std::map<std::string, std::string>& l) {
    auto m = l.find("method");
    return m != l.end() && m->second == "/diond.v1.Optimizer/Step";
  };
  for (int n = 1; iterations == 0 || n <= iterations; ++n) {
    absl::SleepFor(interval);
    Scrape cur;
    if (!TakeScrape(url, &cur)) return 1;
    const double dt = absl::ToDoubleSeconds(cur.at - prev.at);
    auto rate = [&](absl::string_view name,
                    const std::function<bool(const std::map<std::string, std::string>&)>& keep =
                        nullptr) {
      return dt > 0 ? std::max(0.0, cur.Sum(name, keep) - prev.Sum(name, keep)) / dt : 0.0;
    };
    auto outcome = [](const char* o) {
      return [o](const std::map<std::string, std::string>& l) {
        auto it = l.find("outcome");
        return it != l.end() && it->second == o;
      };
    };
    const double applied = rate("diond_steps_total", outcome("applied"));
    const double skipped = rate("diond_steps_total", outcome("skipped"));
    const double replayed = rate("diond_steps_total", outcome("replayed"));
    const double step_errors = rate("diond_rpcs_total", [&](const auto& l) {
      auto c = l.find("code");
      return is_step(l) && c != l.end() && c->second != "OK";
    });
    const double rpc_errors = rate("diond_rpcs_total", [](const auto& l) {
      auto c = l.find("code");
      return c != l.end() && c->second != "OK";
    });
    const auto total_before = prev.Buckets("diond_step_duration_seconds");
    const auto total_after = cur.Buckets("diond_step_duration_seconds");
    const auto compute_before = prev.Buckets("diond_step_compute_seconds");
    const auto compute_after = cur.Buckets("diond_step_compute_seconds");
    const double steps_in_window = cur.Sum("diond_step_duration_seconds_count") -
                                   prev.Sum("diond_step_duration_seconds_count");
    const double mean_ms = steps_in_window > 0 ? 1e3 *
                                                     (cur.Sum("diond_step_duration_seconds_sum") -
                                                      prev.Sum("diond_step_duration_seconds_sum")) /
                                                     steps_in_window
                                               : NAN;
    auto ms = [](std::optional<double> v) { return v ? *v * 1e3 : NAN; };
    const double p50 = ms(Quantile(total_before, total_after, 0.5));
    const double p99 = ms(Quantile(total_before, total_after, 0.99));
    const double c50 = ms(Quantile(compute_before, compute_after, 0.5));
    const double c99 = ms(Quantile(compute_before, compute_after, 0.99));
    const double sessions = cur.Sum("diond_sessions");
    const double state_bytes = cur.Sum("diond_state_bytes");
    const double budget = cur.Sum("diond_memory_budget_bytes");
    const double world_size = cur.Sum("diond_world_size");
    const double peers = cur.Sum("diond_world_peers");
    const double collective_bps = rate("diond_collective_bytes_total");
    if (json) {
      auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
      nlohmann::json j = {
          {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", cur.at, absl::UTCTimeZone())},
          {"iteration", n},
          {"interval_seconds", dt},
          {"steps_per_second",
           {{"applied", applied}, {"skipped", skipped}, {"replayed", replayed}}},
          {"step_errors_per_second", step_errors},
          {"rpc_errors_per_second", rpc_errors},
          {"step_ms", {{"mean", num(mean_ms)}, {"p50", num(p50)}, {"p99", num(p99)}}},
          {"compute_ms", {{"p50", num(c50)}, {"p99", num(c99)}}},
          {"sessions", sessions},
          {"state_bytes", state_bytes},
          {"memory_budget_bytes", budget},
          {"world", {{"size", world_size}, {"peers", peers}}},
          {"collective_bytes_per_second", collective_bps}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      if (tty) std::printf("\033[H\033[2J");
      auto f = [](double v) {
        return std::isnan(v) ? std::string("-") : absl::StrFormat("%.2f", v);
      };
      std::printf("diond top  %s  (%s, every %s)\n",
                  absl::FormatTime("%H:%M:%S", cur.at, absl::UTCTimeZone()).c_str(), url.c_str(),
                  absl::FormatDuration(interval).c_str());
      std::printf("steps/s     applied %.1f  skipped %.1f  replayed %.1f  errors %.1f\n", applied,
                  skipped, replayed, step_errors);
      std::printf("step ms     mean %s  p50 %s  p99 %s   compute p50 %s  p99 %s\n",
                  f(mean_ms).c_str(), f(p50).c_str(), f(p99).c_str(), f(c50).c_str(),
                  f(c99).c_str());
      std::printf("sessions    %.0f   state %s%s\n", sessions,
                  Bytes(static_cast<int64_t>(state_bytes)).c_str(),
                  budget > 0
                      ? absl::StrCat(" of ", Bytes(static_cast<int64_t>(budget)), " budget").c_str()
                      : "");
      if (world_size > 1) {
        std::printf("world       %.0f of %.0f ranks live   collectives %s/s\n", peers, world_size,
                    Bytes(static_cast<int64_t>(collective_bps)).c_str());
      }
      std::printf("rpc errors  %.1f/s\n", rpc_errors);
    }
    std::fflush(stdout);
    prev = std::move(cur);
  }
  return 0;
}

}  // namespace diondctl
