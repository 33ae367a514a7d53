// Test helper shared by the kernels/optim tests that run rules on a device Context
// (device_step_test, group_optimizer_parts_test, step_graph_test): the host-memory TEST backend
// registered in strict mode for the helper's life (host access of device memory faults), and a
// stream context on it. Header-only; for test binaries that link diond::host_device_for_test.
#ifndef DIOND_KERNELS_OPTIM_TESTING_STRICT_DEVICE_H_
#define DIOND_KERNELS_OPTIM_TESTING_STRICT_DEVICE_H_

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "kernels/context.h"
#include "kernels/tensor.h"
#include "kernels/testing/host_device_backend.h"

namespace diond::optim::testing {

// A fixture member; destroyed stream context first, then the registration.
class StrictTestDevice {
 public:
  // The registration's result, then a stream context on `device` (SetUp asserts it is OK).
  absl::Status Open(kernels::Device device) {
    if (!device_.status().ok()) return device_.status();
    auto sc = kernels::testing::HostTestStreamContext::Create(device);
    if (!sc.ok()) return sc.status();
    sc_ = std::move(*sc);
    return absl::OkStatus();
  }
  kernels::Context& ctx() const { return sc_->ctx(); }
  kernels::StreamHandle stream() const { return sc_->stream(); }
  // Destroys the stream context (TearDown); Open makes a new one.
  void Close() { sc_.reset(); }

 private:
  kernels::testing::ScopedHostTestDevice device_{/*strict=*/true};
  std::unique_ptr<kernels::testing::HostTestStreamContext> sc_;
};

}  // namespace diond::optim::testing

#endif  // DIOND_KERNELS_OPTIM_TESTING_STRICT_DEVICE_H_
