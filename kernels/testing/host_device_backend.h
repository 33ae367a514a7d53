// TEST BACKEND — NOT A PRODUCT FEATURE. A "device" whose memory is host memory, behind the same
// plugin C ABI as the CUDA backend (kernels/cuda/plugin_api.h, DiondOpsApiV1), for DeviceType::kTest.
//
// It lets CI run, without a GPU, everything of the device path that is not CUDA itself: the
// adapter (kernels/plugin/plugin_backend.h) and its TensorView ↔ DiondTensor conversion, the
// explicit host ↔ device copies, a stream object per session (ops must name a stream this
// backend created), and a pool with accounting and a budget, whose exhaustion is
// RESOURCE_EXHAUSTED naming the numbers. The ops run on the CPU backend (the arithmetic is the
// CPU's, bit for bit), or, for AdamW / Lion / cautious decay, through the per-element functions
// of kernels/elementwise_math.h with the scalars the adapter sent (so the scalar transport is
// checked too).
//
// Counters make the device traffic observable to tests (copies, bytes, syncs, streams).
#ifndef DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_
#define DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_

#include <cstdint>

#include "kernels/cuda/plugin_api.h"

namespace diond::kernels::testing {

const DiondOpsApiV1* HostTestDeviceOps();

struct HostTestDeviceCounters {
  int64_t copies_to_device = 0, copies_to_host = 0;
  int64_t bytes_to_device = 0, bytes_to_host = 0;
  int64_t syncs = 0;  // stream_synchronize calls + sync-point entries (top_k, is_all_zero, copies)
  int64_t streams_created = 0, streams_live = 0;
  int64_t ops = 0;  // op entries run
  int64_t ops_on_default_stream = 0;  // op entries called with a null stream
  // devsession: host_register / host_unregister calls, the ranges registered now, and the
  // pairing errors (an unregister of a pointer not registered, a register of one already
  // registered, or a range overlapping a registered one), each also refused with INTERNAL.
  int64_t host_registers = 0, host_unregisters = 0, host_registered_live = 0;
  int64_t host_register_errors = 0;
};
HostTestDeviceCounters GetHostTestDeviceCounters();
// Resets the counters (not the pool) and sets the pool budget (0: unlimited).
// (host_registered_live and streams_live are kept: they describe what exists.)
void ResetHostTestDevice(uint64_t budget_bytes);

}  // namespace diond::kernels::testing

#endif  // DIOND_KERNELS_TESTING_HOST_DEVICE_BACKEND_H_
