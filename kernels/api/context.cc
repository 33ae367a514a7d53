// Implementation of kernels/context.h (Context, Buffer) and the backend registry of
// kernels/backend.h. Knows no backend: the table comes from the registry.
#include "kernels/context.h"

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "kernels/device.h"

namespace diond::kernels {

// ---- registry -------------------------------------------------------------------------------

namespace {

constexpr int kDeviceTypes = 3;  // kCpu, kCuda, kTest

struct Registry {
  std::mutex mu;
  const OpsBackend* tables[kDeviceTypes] = {nullptr, nullptr, nullptr};
};
Registry& GetRegistry() {
  static Registry* r = new Registry;  // never destroyed: backends outlive static destructors
  return *r;
}

const char* DeviceTypeName(DeviceType t) {
  switch (t) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda";
    case DeviceType::kTest:
      return "test";
  }
  return "?";
}

// Every entry of the table is set (an op left null would crash at its first call).
bool Complete(const OpsBackend& b) {
  if (b.allocate == nullptr || b.deallocate == nullptr) return false;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) \
  if (b.name == nullptr) return false;
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) \
  if (b.name == nullptr) return false;
#include "kernels/ops.def"
  return b.name != nullptr;
}

int Slot(DeviceType type) { return static_cast<int>(type); }

}  // namespace

absl::Status RegisterOpsBackend(DeviceType type, const OpsBackend* backend) {
  const int slot = Slot(type);
  if (slot < 0 || slot >= kDeviceTypes) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterOpsBackend: unknown device type ", slot));
  }
  if (backend == nullptr) return absl::InvalidArgumentError("RegisterOpsBackend: null table");
  if (backend->version != kOpsBackendVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterOpsBackend: table version ", backend->version, ", want ", kOpsBackendVersion));
  }
  if (!Complete(*backend)) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterOpsBackend: the table for ",
                                                   DeviceTypeName(type), " has a null entry"));
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.tables[slot] != nullptr && r.tables[slot] != backend) {
    return absl::AlreadyExistsError(absl::StrCat("RegisterOpsBackend: ", DeviceTypeName(type),
                                                 " already has backend ", r.tables[slot]->name));
  }
  r.tables[slot] = backend;
  return absl::OkStatus();
}

const OpsBackend* FindOpsBackend(DeviceType type) {
  const int slot = Slot(type);
  if (slot < 0 || slot >= kDeviceTypes) return nullptr;
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.tables[slot];
}

void UnregisterOpsBackendForTest(DeviceType type) {
  const int slot = Slot(type);
  if (slot < 0 || slot >= kDeviceTypes) return;
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.tables[slot] = nullptr;
}

// ---- Buffer ---------------------------------------------------------------------------------

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    backend_ = o.backend_;
    stats_ = std::move(o.stats_);
    device_ = o.device_;
    data_ = o.data_;
    capacity_ = o.capacity_;
    layout_ = o.layout_;
    o.backend_ = nullptr;
    o.data_ = nullptr;
    o.capacity_ = 0;
    o.layout_ = TensorLayout();
  }
  return *this;
}

void Buffer::Reset() {
  if (data_ != nullptr && backend_ != nullptr) {
    backend_->deallocate(device_, data_, capacity_);
    if (stats_) stats_->bytes_in_use.fetch_sub(static_cast<int64_t>(capacity_));
  }
  backend_ = nullptr;
  stats_.reset();
  data_ = nullptr;
  capacity_ = 0;
  layout_ = TensorLayout();
}

// ---- Context --------------------------------------------------------------------------------

namespace {

int ResolveThreads(int n) { return n > 0 ? (n > 1024 ? 1024 : n) : DefaultCpuThreads(); }

}  // namespace

// The scratch arena's blocks go through the backend's allocator and the Context's counters. The
// arena is the last member, so it is destroyed (freeing its blocks here) while the rest of the
// Context is still alive.
void* Context::ArenaAllocate(void* user, size_t bytes) {
  auto* c = static_cast<Context*>(user);
  void* p = c->registered_->allocate(c->options_.device, bytes);
  if (p != nullptr) {
    c->stats_->allocations.fetch_add(1);
    c->stats_->bytes_in_use.fetch_add(static_cast<int64_t>(bytes));
  }
  return p;
}

void Context::ArenaDeallocate(void* user, void* p, size_t bytes) {
  auto* c = static_cast<Context*>(user);
  c->registered_->deallocate(c->options_.device, p, bytes);
  c->stats_->bytes_in_use.fetch_sub(static_cast<int64_t>(bytes));
}

Context::Context(const ContextOptions& options, const OpsBackend* backend)
    : options_(options),
      backend_(backend),
      registered_(backend),
      num_threads_(ResolveThreads(options.num_threads)),
      stats_(std::make_shared<AllocationStats>()),
      scratch_(std::make_unique<ScratchArena>(
          options.scratch_block_bytes,
          ScratchArena::BlockAllocator{&Context::ArenaAllocate, &Context::ArenaDeallocate, this})) {
}

Context::~Context() = default;

void Context::InterposeBackend(const OpsBackend* table) {
  backend_ = table != nullptr ? table : registered_;
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(const ContextOptions& options) {
  const OpsBackend* backend = FindOpsBackend(options.device.type);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Context: device ", DeviceTypeName(options.device.type), ":",
                     options.device.index, " has no ops backend in this build; use the CPU"));
  }
  if (options.device.index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Context: device index ", options.device.index, " < 0"));
  }
  if (options.device.type == DeviceType::kCpu && options.stream != nullptr) {
    return absl::InvalidArgumentError("Context: a stream handle must be null on the CPU");
  }
  if (options.num_threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("Context: num_threads ", options.num_threads, " > 1024"));
  }
  return std::unique_ptr<Context>(new Context(options, backend));
}

Allocator Context::allocator() const {
  Allocator a;
  a.backend_ = registered_;  // memory never goes through an interposed table
  a.device_ = options_.device;
  a.stats_ = stats_;
  return a;
}

absl::StatusOr<Buffer> Context::Allocate(DType dtype, const std::vector<int64_t>& shape) const {
  return allocator().Allocate(dtype, shape);
}

absl::StatusOr<Buffer> Allocator::Allocate(DType dtype, const std::vector<int64_t>& shape) const {
  if (backend_ == nullptr) {
    return absl::FailedPreconditionError("Allocator: not made by a Context");
  }
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Allocate: rank ", shape.size(), " > ", kMaxRank));
  }
  if (dtype != DType::kF32 && dtype != DType::kBf16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError("Allocate: unknown dtype");
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > (int64_t{1} << 40) / d)) {
      return absl::InvalidArgumentError(absl::StrCat("Allocate: shape [",
                                                     absl::StrJoin(shape, ", "), "] is ",
                                                     d < 0 ? "negative" : "too large"));
    }
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
  const size_t capacity = ((bytes ? bytes : 1) + 63) & ~size_t{63};
  void* p = backend_->allocate(device_, capacity);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Allocate: ", backend_->name, " cannot allocate ", bytes, " bytes"));
  }
  stats_->allocations.fetch_add(1);
  stats_->bytes_in_use.fetch_add(static_cast<int64_t>(capacity));
  Buffer b;
  b.backend_ = backend_;
  b.stats_ = stats_;
  b.device_ = device_;
  b.data_ = p;
  b.capacity_ = capacity;
  b.layout_ = ContiguousLayout(dtype, shape);
  return b;
}

absl::StatusOr<Buffer> Context::Zeros(DType dtype, const std::vector<int64_t>& shape) const {
  absl::StatusOr<Buffer> b = Allocate(dtype, shape);
  if (b.ok() && b->NumElements() > 0) {
    absl::Status s = backend_->fill(*this, 0.0f, b->view());
    if (!s.ok()) return s;
  }
  return b;
}

Device ComputeDevice(const SelectedDevice& selected) {
  if (FindOpsBackend(selected.type) != nullptr) return Device{selected.type, selected.index};
  return Device{DeviceType::kCpu, 0};
}

void Context::SetNumThreads(int num_threads) { num_threads_ = ResolveThreads(num_threads); }

namespace {
std::atomic<int> g_cpu_parallel_callers{0};
}  // namespace

int CpuParallelCallerThreads() { return g_cpu_parallel_callers.load(std::memory_order_relaxed); }

void NoteCpuParallelCaller() {
  thread_local bool counted = false;
  if (counted) return;
  counted = true;
  g_cpu_parallel_callers.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace diond::kernels
