// Test helper: starts the real diond binary on a Unix socket in a fresh temporary directory
// (CPU device, no metrics listener) and waits for its ready file. Shared by the client's daemon
// tests and the examples' tests.
#ifndef DIOND_CLIENT_CPP_TESTS_TEST_DAEMON_H_
#define DIOND_CLIENT_CPP_TESTS_TEST_DAEMON_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/integration/subprocess.h"

namespace diond::client::testing {

struct TestDaemon {
  std::unique_ptr<diond::testing::Subprocess> proc;
  std::string dir;     // temporary directory of this daemon (socket, log, state)
  std::string target;  // "unix:<dir>/d.sock"
  std::string log_path;

  // SIGTERM and wait; returns the exit code (nullopt on timeout).
  std::optional<int> Stop();
};

// Starts `binary` with --listen=unix:<tmp>/d.sock --metrics_address= --device=cpu
// --ready_file=<tmp>/ready.json, plus --state_dir=<tmp>/state when the binary knows that flag,
// plus `extra`. UNAVAILABLE with the daemon's log if it is not ready within 60 s.
absl::StatusOr<std::unique_ptr<TestDaemon>> StartTestDaemon(
    const std::string& binary, const std::vector<std::string>& extra = {});

}  // namespace diond::client::testing

#endif  // DIOND_CLIENT_CPP_TESTS_TEST_DAEMON_H_
