// TEST BACKEND (host_device_backend.h): the fixtures. The backend itself is split by concern
// (host_device_internal.h lists the files).
#include "kernels/testing/host_device_backend.h"

#include <memory>
#include <utility>

#include "kernels/backend.h"
#include "kernels/device_runtime.h"
#include "kernels/plugin/plugin_backend.h"

namespace diond::kernels::testing {

ScopedHostTestDevice::ScopedHostTestDevice(bool strict) {
  UnregisterOpsBackendForTest(DeviceType::kTest);
  status_ = RegisterPluginOps(DeviceType::kTest, HostTestDeviceOps());
  SetHostTestDeviceStrict(strict);
}

ScopedHostTestDevice::~ScopedHostTestDevice() {
  SetHostTestDeviceStrict(false);
  UnregisterOpsBackendForTest(DeviceType::kTest);
}

absl::StatusOr<std::unique_ptr<HostTestStreamContext>> HostTestStreamContext::Create(
    Device device, int num_threads) {
  std::unique_ptr<HostTestStreamContext> s(new HostTestStreamContext);
  s->device_ = device;
  absl::StatusOr<StreamHandle> stream = DeviceRuntimeFor(device.type).create_stream(device);
  if (!stream.ok()) return stream.status();
  s->stream_ = *stream;
  ContextOptions o;
  o.device = device;
  o.stream = s->stream_;
  o.num_threads = num_threads;
  absl::StatusOr<std::unique_ptr<Context>> ctx = Context::Create(o);
  if (!ctx.ok()) return ctx.status();  // the destructor destroys the stream
  s->ctx_ = std::move(*ctx);
  return s;
}

HostTestStreamContext::~HostTestStreamContext() {
  ctx_.reset();
  if (stream_ != nullptr) DeviceRuntimeFor(device_.type).destroy_stream(device_, stream_);
}

}  // namespace diond::kernels::testing
