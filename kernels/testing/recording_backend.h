// TEST-ONLY backend of the ops API (kernels/backend.h). Never linked into the daemon or a tool.
//
// RecordingBackend registers a table for the fake device DeviceType::kTest whose every entry
// appends its name to a log and then forwards to a target table (typically the CPU backend's,
// found with FindOpsBackend(DeviceType::kCpu)), or returns UNIMPLEMENTED when there is none.
// Its "device memory" is host memory (the C heap), so a kTest Context's buffers and views can be
// handed to the CPU kernels. It exists to prove that the public ops dispatch through the table
// of ctx.device() and that a second backend plugs in without touching kernels/optim or server/.
//
// Thread-safety: one test thread at a time (the log is a process-wide global).
#ifndef DIOND_KERNELS_TESTING_RECORDING_BACKEND_H_
#define DIOND_KERNELS_TESTING_RECORDING_BACKEND_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace diond::kernels::testing {

class RecordingBackend {
 public:
  // Registers the recording table for DeviceType::kTest, forwarding to `target` (may be null).
  // Fails as RegisterOpsBackend does. Only one RecordingBackend may be installed at a time.
  static absl::Status Install(const OpsBackend* target);
  // Unregisters the table and clears the log.
  static void Uninstall();

  // Names of the entries called since Install or ClearLog, in order ("gemm", "allocate", ...).
  static std::vector<std::string> Log();
  static void ClearLog();
  static const OpsBackend& Table();
};

}  // namespace diond::kernels::testing

#endif  // DIOND_KERNELS_TESTING_RECORDING_BACKEND_H_
