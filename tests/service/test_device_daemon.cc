// diond_testdevice: the daemon (server/exe/main.cc) with the host-memory TEST backend
// (kernels/testing/host_device_backend.h) as its compute device, registered the way a plugin is
// (RegisterPluginOps) and named in DaemonOptions::registered_device. TEST ONLY, never
// installed: it lets the service suites run device sessions (their stream, device staging,
// host <-> device copies, host registration of shm regions, the pool's budget) over real
// processes, sockets and shared memory without a GPU.
//
// Test hooks (this binary only):
//   * after every step and every change of the session count it logs one line
//     "test device counters: copies_to_device=N copies_to_host=N ... pool_peak=N";
//   * DIOND_TEST_DEVICE_BUDGET_BYTES=B limits the TEST pool to B bytes (0 or unset: unlimited);
//   * DIOND_TEST_DEVICE_LOSE_CONTEXT_FILE=PATH: once PATH exists, the next op entry of the TEST
//     backend loses the device context, as an illegal address in a kernel would on a GPU
//     (host_device_backend.h "a lost context"): every device entry fails from then on.
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/plugin/plugin_backend.h"
#include "kernels/testing/host_device_backend.h"
#include "server/exe/daemon.h"

namespace diond::server {

void ConfigureTestDevice(DaemonOptions* options) {
  DIOND_LOG(WARNING) << "TEST DEVICE BACKEND: host memory behind the plugin ABI; not a product "
                        "feature (diond_testdevice, a test-only binary)";
  absl::Status s =
      kernels::RegisterPluginOps(kernels::DeviceType::kTest, kernels::testing::HostTestDeviceOps());
  if (!s.ok()) {
    DIOND_LOG(ERROR) << "cannot register the TEST backend: " << s.message();
    std::exit(1);
  }
  uint64_t budget = 0;
  if (const char* b = std::getenv("DIOND_TEST_DEVICE_BUDGET_BYTES"); b != nullptr) {
    if (!absl::SimpleAtoi(b, &budget)) {
      DIOND_LOG(ERROR) << "DIOND_TEST_DEVICE_BUDGET_BYTES='" << b << "' is not a byte count";
      std::exit(2);
    }
  }
  kernels::testing::ResetHostTestDevice(budget);
  if (const char* f = std::getenv("DIOND_TEST_DEVICE_LOSE_CONTEXT_FILE"); f != nullptr && *f) {
    const std::string path = f;
    kernels::testing::SetHostTestDeviceLossTrigger(
        [path] { return access(path.c_str(), F_OK) == 0; });
  }
  // Strict: the "device" memory is PROT_NONE outside the backend's own entries, so any host
  // access of it by the daemon (a session reading state or staging directly) faults at once.
  kernels::testing::SetHostTestDeviceStrict(true);
  options->registered_device = kernels::Device{kernels::DeviceType::kTest, 0};
  options->device_report = [] {
    const kernels::testing::HostTestDeviceCounters c =
        kernels::testing::GetHostTestDeviceCounters();
    std::string pool;
    if (auto m = kernels::DeviceRuntimeFor(kernels::DeviceType::kTest)
                     .memory_stats({kernels::DeviceType::kTest, 0});
        m.ok()) {
      pool = absl::StrCat(" pool_in_use=", m->in_use, " pool_peak=", m->peak);
    }
    return absl::StrCat(
        "test device counters: copies_to_device=", c.copies_to_device,
        " copies_to_host=", c.copies_to_host, " bytes_to_device=", c.bytes_to_device,
        " bytes_to_host=", c.bytes_to_host, " streams_created=", c.streams_created,
        " streams_live=", c.streams_live, " host_registers=", c.host_registers,
        " host_unregisters=", c.host_unregisters, " host_registered_live=", c.host_registered_live,
        " host_register_errors=", c.host_register_errors, " ops=", c.ops,
        " ops_on_default_stream=", c.ops_on_default_stream, " syncs=", c.syncs,
        " async_copies_to_device=", c.async_copies_to_device,
        " async_copies_to_host=", c.async_copies_to_host, " deferred=", c.deferred,
        " graph_captures=", c.graph_captures, " graphs_made=", c.graphs_made,
        " captures_invalidated=", c.captures_invalidated, " graph_launches=", c.graph_launches,
        " device_scalar_ops=", c.device_scalar_ops, pool);
  };
}

}  // namespace diond::server
