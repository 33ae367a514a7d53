// Test helper: runs a real program as a child process, captures its stderr to a file, and
// waits for it with a deadline. Used by the integration tests that start the real daemon.
#ifndef DIOND_TESTS_INTEGRATION_SUBPROCESS_H_
#define DIOND_TESTS_INTEGRATION_SUBPROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace diond::testing {

class Subprocess {
 public:
  // Starts argv[0] with the given arguments; stdout and stderr go to `log_path`.
  Subprocess(const std::vector<std::string>& argv, const std::string& log_path);
  ~Subprocess();  // SIGKILLs the child if it is still running

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Exit code, or -signal if killed by a signal; nullopt on timeout.
  std::optional<int> Wait(absl::Duration timeout);
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  bool reaped_ = false;
};

// Runs a shell command, returns (exit code, stdout).
std::pair<int, std::string> RunCommand(const std::string& command);

// Reads a whole file; empty if missing.
std::string ReadFile(const std::string& path);

// Creates a fresh temporary directory.
std::string MakeTempDir(const std::string& prefix);

// Plain HTTP/1.0 GET on 127.0.0.1:port; returns the body, or empty on failure.
std::string HttpGet(int port, const std::string& path);

}  // namespace diond::testing

#endif  // DIOND_TESTS_INTEGRATION_SUBPROCESS_H_
