// The backend table of the ops API (ARCHITECTURE.md §3, docs/KERNELS.md): one function
// pointer per op of kernels/ops.h plus the device-memory entries, filled by each backend and
// selected by the Context's device.
//
// How a call runs: the public free function in ops.h validates its arguments once (ranks,
// shapes, dtypes, strides, scalars, and that every view is on ctx.device(): checks that do not
// depend on the device) and then calls ctx.backend().<op> with the same arguments. A backend
// entry may assume valid arguments; it reports only failures of its own (INTERNAL for a library
// error, FAILED_PRECONDITION for a rank-deficient factorization, RESOURCE_EXHAUSTED for memory).
//
// Backends: kernels/cpu (registered for DeviceType::kCpu by the diond::ops target) and, for
// tests only, kernels/testing (DeviceType::kTest). The CUDA backend lives in libdiond_cuda.so
// behind the plugin's versioned C ABI (kernels/cuda/plugin_api.h, DiondOpsApiV1); the adapter in
// kernels/plugin fills this table from that C table (docs/KERNELS.md §7, docs/GPU.md).
//
// Code above the kernels (kernels/optim, server/) includes ops.h and context.h, never this file's
// implementations: tests/layering_test.sh enforces that no backend header is included there.
#ifndef DIOND_KERNELS_BACKEND_H_
#define DIOND_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/ops.h"

namespace diond::kernels {

// Bumped when an entry is added, removed or changes signature; RegisterOpsBackend refuses a
// table of another version.
inline constexpr uint32_t kOpsBackendVersion = 7;  // 2: ortho; 3: kops; 4: steps; 5: async copies;
                                                 // 6: decay_scatter_with_change; 7: the fused
                                                 // steps' scalars_on_device (kernels/graph.h)

struct OpsBackend {
  uint32_t version = kOpsBackendVersion;
  const char* name = nullptr;  // "cpu", "test-recording", ...

  // ---- device memory (Context::Allocate and the Context's scratch arena) ----
  // `bytes` (> 0) aligned to 64 bytes at least, on `device`; nullptr when out of memory.
  void* (*allocate)(Device device, size_t bytes) = nullptr;
  void (*deallocate)(Device device, void* p, size_t bytes) = nullptr;
  // Host <-> device copies of `bytes` bytes; synchronous for the caller (a stream backend
  // queues on ctx.stream() and waits: each call is a sync point, docs/KERNELS.md).
  absl::Status (*copy_from_host)(const Context& ctx, const void* host, void* device_dst,
                                 size_t bytes) = nullptr;
  absl::Status (*copy_to_host)(const Context& ctx, const void* device_src, void* host,
                               size_t bytes) = nullptr;

  // ---- ops (kernels/ops.h, same arguments; called only after validation) ----
  absl::Status (*gemm)(const Context&, const GemmParams&, ConstTensorView, ConstTensorView,
                       TensorView) = nullptr;
  absl::Status (*symmetric_product)(const Context&, GramSide, float, ConstTensorView, float,
                                    TensorView) = nullptr;
  absl::Status (*symmetric_product_bf16)(const Context&, ConstTensorView, int64_t,
                                         TensorView) = nullptr;
  absl::Status (*thin_qr)(const Context&, ConstTensorView, TensorView, TensorView) = nullptr;
  absl::Status (*cholesky_qr)(const Context&, ConstTensorView, TensorView, TensorView) = nullptr;
  absl::Status (*randomized_cholesky_qr)(const Context&, ConstTensorView, ConstTensorView,
                                         TensorView) = nullptr;
  absl::Status (*frobenius_norm)(const Context&, ConstTensorView, TensorView) = nullptr;
  absl::Status (*axis_norms)(const Context&, ConstTensorView, Axis, NormType,
                             TensorView) = nullptr;
  absl::Status (*top_k_by_l1_norm)(const Context&, ConstTensorView, Axis, int64_t,
                                   absl::Span<int64_t>, TensorView) = nullptr;
  absl::Status (*is_all_zero)(const Context&, ConstTensorView, bool*) = nullptr;
  absl::Status (*gather)(const Context&, ConstTensorView, Axis, absl::Span<const int64_t>,
                         TensorView) = nullptr;
  absl::Status (*scatter)(const Context&, ConstTensorView, Axis, absl::Span<const int64_t>,
                          float, float, TensorView) = nullptr;
  absl::Status (*copy)(const Context&, ConstTensorView, TensorView) = nullptr;
  absl::Status (*fill)(const Context&, float, TensorView) = nullptr;
  absl::Status (*axpby)(const Context&, float, ConstTensorView, float, ConstTensorView,
                        TensorView) = nullptr;
  absl::Status (*add_scalar)(const Context&, float, ConstTensorView, float, TensorView) = nullptr;
  absl::Status (*unary)(const Context&, UnaryOp, ConstTensorView, TensorView) = nullptr;
  absl::Status (*binary)(const Context&, BinaryOp, ConstTensorView, ConstTensorView,
                         TensorView) = nullptr;
  // adamw_step, lion_step, their tracked forms and apply_update: when the params' non-null
  // scalars_on_device is set (kernels/graph.h does, after validation), the op reads its scalars
  // from that device record when it runs, not from the params' fields. A backend without graphs
  // (the CPU) never gets it: the recorder runs only on a device context.
  absl::Status (*adamw_step)(const Context&, const AdamWParams&, ConstTensorView, TensorView,
                             TensorView, TensorView) = nullptr;
  absl::Status (*lion_step)(const Context&, const LionParams&, ConstTensorView, TensorView,
                            TensorView) = nullptr;
  // ---- ortho ----
  absl::Status (*add_to_diagonal)(const Context&, float, TensorView) = nullptr;
  absl::Status (*bf16_rounded_axpby)(const Context&, float, ConstTensorView, float,
                                     ConstTensorView, TensorView) = nullptr;
  // ---- end ortho ----

  // ---- kops: fused optimizer phases (ops.h "kops" block) ----
  absl::Status (*adamw_step_tracked)(const Context&, const AdamWParams&, ConstTensorView,
                                     TensorView, TensorView, TensorView, TensorView) = nullptr;
  absl::Status (*lion_step_tracked)(const Context&, const LionParams&, ConstTensorView,
                                    TensorView, TensorView, TensorView) = nullptr;
  absl::Status (*momentum_update)(const Context&, float, bool, ConstTensorView, ConstTensorView,
                                  TensorView, TensorView) = nullptr;
  absl::Status (*apply_update)(const Context&, const ApplyUpdateParams&, ConstTensorView,
                               ConstTensorView, TensorView) = nullptr;
  absl::Status (*normalize_neurons)(const Context&, float, TensorView, TensorView) = nullptr;
  absl::Status (*copy_with_change)(const Context&, ConstTensorView, TensorView,
                                   TensorView) = nullptr;

  // steps
  absl::Status (*all_finite)(const Context&, ConstTensorView, bool*) = nullptr;
  absl::Status (*widen_scale_check_finite)(const Context&, ConstTensorView, float, TensorView,
                                           bool*) = nullptr;
  absl::Status (*fnv1a_checksum)(const Context&, ConstTensorView, uint64_t*) = nullptr;

  // ---- asynccopy (ops.h "asynccopy" block) ----
  // Host <-> device copies of `bytes` bytes queued on ctx.stream() (no wait; the host memory
  // stays untouched by the host until `synchronize`), and the wait for the context's stream.
  absl::Status (*copy_from_host_async)(const Context& ctx, const void* host, void* device_dst,
                                       size_t bytes) = nullptr;
  absl::Status (*copy_to_host_async)(const Context& ctx, const void* device_src, void* host,
                                     size_t bytes) = nullptr;
  absl::Status (*synchronize)(const Context& ctx) = nullptr;
  // The device-flag forms of all_finite / widen_scale_check_finite (last view: the flag).
  absl::Status (*all_finite_flag)(const Context&, ConstTensorView, TensorView) = nullptr;
  absl::Status (*widen_scale_check_finite_flag)(const Context&, ConstTensorView, float, TensorView,
                                                TensorView) = nullptr;
  // ---- end asynccopy ----
  // Dion2's deferred parameter write (ops.h DecayScatterWithChange; version 6).
  absl::Status (*decay_scatter_with_change)(const Context&, float, ConstTensorView, Axis,
                                            absl::Span<const int64_t>, float, TensorView,
                                            TensorView) = nullptr;
};

// Registers `backend` (static storage duration) for every device of `type`. INVALID_ARGUMENT for
// a null table, a table of another version or one with a null entry; ALREADY_EXISTS if a
// different table is registered for `type` (registering the same table again is a no-op).
// Thread-safe.
absl::Status RegisterOpsBackend(DeviceType type, const OpsBackend* backend);

// The table registered for `type`, or nullptr. Thread-safe.
const OpsBackend* FindOpsBackend(DeviceType type);

// The device whose backend runs the ops for the device the daemon selected: the selected device
// itself when this build has an ops backend registered for it, else the CPU. The CUDA backend
// is registered by RegisterCudaOps (kernels/plugin/plugin_backend.h), which the daemon calls for
// --device=cuda:N / auto; it then also requires the update rules to run on a device context
// before it computes there (server/exe/daemon.cc, docs/GPU.md "Device sessions").
Device ComputeDevice(const SelectedDevice& selected);

// Test-only: removes the registration for `type` (so a test can register its own table).
void UnregisterOpsBackendForTest(DeviceType type);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_BACKEND_H_
