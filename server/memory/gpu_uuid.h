// The device check of the GPU data plane (docs/DATA_PLANE.md "The device check"): a trainer
// names its GPU by UUID (cudaDeviceProp::uuid, 16 bytes), because device indices differ between
// processes (CUDA_VISIBLE_DEVICES, containers); the daemon maps the UUID to its own device index
// and never guesses.
#ifndef DIOND_SERVER_MEMORY_GPU_UUID_H_
#define DIOND_SERVER_MEMORY_GPU_UUID_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace diond::memory {

using GpuUuid = std::array<uint8_t, 16>;

// A GPU the daemon can use: its index in the daemon's process and its UUID.
struct GpuDevice {
  int index = 0;
  GpuUuid uuid{};
};

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
std::string FormatGpuUuid(const GpuUuid& uuid);

// INVALID_ARGUMENT (naming `field`) unless `bytes` is exactly 16 bytes.
absl::StatusOr<GpuUuid> ParseGpuUuid(absl::string_view bytes, absl::string_view field);

// The daemon's index of the trainer's GPU. FAILED_PRECONDITION naming the trainer's UUID and
// every UUID the daemon sees (or saying it sees none) when no device matches.
absl::StatusOr<int> MapGpuUuid(const GpuUuid& trainer, absl::Span<const GpuDevice> daemon);

}  // namespace diond::memory

#endif  // DIOND_SERVER_MEMORY_GPU_UUID_H_
