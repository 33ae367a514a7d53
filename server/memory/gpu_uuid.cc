#include "server/memory/gpu_uuid.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace diond::memory {

std::string FormatGpuUuid(const GpuUuid& u) {
  std::string s = "GPU-";
  for (size_t i = 0; i < u.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    absl::StrAppendFormat(&s, "%02x", u[i]);
  }
  return s;
}

absl::StatusOr<GpuUuid> ParseGpuUuid(absl::string_view bytes, absl::string_view field) {
  GpuUuid u{};
  if (bytes.size() != u.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field,
                                                   " must be the 16 bytes of the GPU's "
                                                   "UUID (cudaDeviceProp::uuid); got ",
                                                   bytes.size(), " bytes"));
  }
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(bytes[i]);
  return u;
}

absl::StatusOr<int> MapGpuUuid(const GpuUuid& trainer, absl::Span<const GpuDevice> daemon) {
  for (const GpuDevice& d : daemon) {
    if (d.uuid == trainer) return d.index;
  }
  std::vector<std::string> seen;
  for (const GpuDevice& d : daemon) {
    seen.push_back(absl::StrCat("cuda:", d.index, " ", FormatGpuUuid(d.uuid)));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the trainer's GPU ", FormatGpuUuid(trainer), " is not visible to this daemon, which sees ",
      seen.empty() ? std::string("no GPU") : absl::StrJoin(seen, ", "),
      ": give both processes the same GPUs (CUDA_VISIBLE_DEVICES, the container's device list)"));
}

}  // namespace diond::memory
