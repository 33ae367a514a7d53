// Does ThreadSanitizer see absl::Mutex on this machine? Two threads increment a counter under
// an absl::Mutex. With an Abseil built with -fsanitize=thread the mutex's annotations tell TSan
// about the lock and nothing is reported; Debian's libabsl is built without them, so TSan sees
// no synchronisation and reports a data race on every absl::Mutex-guarded access.
// scripts/sanitize.sh thread runs this first and refuses to run the suite when it reports,
// since every report of the suite would then be noise.
#include <thread>

#include "absl/synchronization/mutex.h"

namespace {
absl::Mutex mu;
int counter = 0;  // guarded by mu
}  // namespace

int main() {
  auto add = [] {
    for (int i = 0; i < 1000; ++i) {
      absl::MutexLock lock(&mu);
      ++counter;
    }
  };
  std::thread a(add), b(add);
  a.join();
  b.join();
  return counter == 2000 ? 0 : 1;
}
