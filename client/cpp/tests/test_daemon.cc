#include "client/cpp/tests/test_daemon.h"

#include <signal.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace diond::client::testing {

using ::diond::testing::MakeTempDir;
using ::diond::testing::ReadFile;
using ::diond::testing::RunCommand;
using ::diond::testing::Subprocess;

std::optional<int> TestDaemon::Stop() {
  proc->Signal(SIGTERM);
  return proc->Wait(absl::Seconds(30));
}

absl::StatusOr<std::unique_ptr<TestDaemon>> StartTestDaemon(const std::string& binary,
                                                            const std::vector<std::string>& extra) {
  auto d = std::make_unique<TestDaemon>();
  d->dir = MakeTempDir("diond_client");
  d->target = "unix:" + d->dir + "/d.sock";
  d->log_path = d->dir + "/log.txt";
  const std::string ready = d->dir + "/ready.json";
  std::vector<std::string> argv = {binary, "--listen=" + d->target,
                                   "--metrics_address=", "--device=cpu", "--ready_file=" + ready};
  // Checkpoint tests need a state directory; the flag arrives with the session engine, so it is
  // only passed to a binary that has it (an unknown flag would stop the daemon from starting).
  auto [rc, help] = RunCommand(binary + " --helpfull 2>&1");
  if (absl::StrContains(help, "--state_dir")) argv.push_back("--state_dir=" + d->dir + "/state");
  argv.insert(argv.end(), extra.begin(), extra.end());
  d->proc = std::make_unique<Subprocess>(argv, d->log_path);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    if (!ReadFile(ready).empty()) return d;
    if (d->proc->Wait(absl::ZeroDuration()).has_value()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::UnavailableError(absl::StrCat("diond did not become ready; log:\n", d->proc->Log()));
}

}  // namespace diond::client::testing
