// The raw-byte host <-> device copies of kernels/ops.h: the copy entries of the context's backend,
// after the one check a byte range allows.
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace diond::kernels {
namespace {

absl::Status CheckBytes(const char* op, const void* from, const void* to, size_t bytes) {
  if (bytes > 0 && (from == nullptr || to == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": a null pointer for ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyBytesFromHost(const Context& ctx, const void* host, void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (absl::Status s = CheckBytes("CopyBytesFromHost", host, device, bytes); !s.ok()) return s;
  return ctx.backend().copy_from_host(ctx, host, device, bytes);
}

absl::Status CopyBytesToHost(const Context& ctx, const void* device, void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (absl::Status s = CheckBytes("CopyBytesToHost", device, host, bytes); !s.ok()) return s;
  return ctx.backend().copy_to_host(ctx, device, host, bytes);
}

absl::Status CopyBytesFromHostAsync(const Context& ctx, const void* host, void* device,
                                    size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (absl::Status s = CheckBytes("CopyBytesFromHostAsync", host, device, bytes); !s.ok()) {
    return s;
  }
  return ctx.backend().copy_from_host_async(ctx, host, device, bytes);
}

absl::Status CopyBytesToHostAsync(const Context& ctx, const void* device, void* host,
                                  size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (absl::Status s = CheckBytes("CopyBytesToHostAsync", device, host, bytes); !s.ok()) return s;
  return ctx.backend().copy_to_host_async(ctx, device, host, bytes);
}

}  // namespace diond::kernels
