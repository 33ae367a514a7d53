// Implementation of kernels/context.h (Context, Buffer) and the registries of kernels/backend.h
// and kernels/device_runtime.h. Knows no backend: the tables come from the registry.
#include "kernels/context.h"

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/device_runtime.h"

namespace diond::kernels {

// ---- registry -------------------------------------------------------------------------------

namespace {

constexpr int kDeviceTypes = 3;  // kCpu, kCuda, kTest

struct Registry {
  std::mutex mu;
  const OpsBackend* tables[kDeviceTypes] = {nullptr, nullptr, nullptr};
  const DeviceRuntime* runtimes[kDeviceTypes] = {nullptr, nullptr, nullptr};
};
Registry& GetRegistry() {
  static Registry* r = new Registry;  // never destroyed: backends outlive static destructors
  return *r;
}

const char* DeviceTypeName(DeviceType t) {
  static constexpr const char* kNames[kDeviceTypes] = {"cpu", "cuda", "test"};
  const int i = static_cast<int>(t);
  return i >= 0 && i < kDeviceTypes ? kNames[i] : "?";
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
  r.runtimes[slot] = nullptr;
}

// ---- device runtimes ------------------------------------------------------------------------

namespace {

bool Complete(const DeviceRuntime& r) {
  return r.name != nullptr && r.create_stream && r.destroy_stream && r.synchronize_stream &&
         r.begin_capture && r.end_capture && r.launch_graph && r.destroy_graph && r.host_register &&
         r.host_unregister && r.device_uuids && r.open_ipc_mem_handle && r.close_ipc_mem_handle &&
         r.import_vmm_fd && r.unmap_vmm && r.open_ipc_event && r.destroy_event &&
         r.stream_wait_event && r.record_event && r.memory_stats && r.health &&
         r.last_allocation_error;
}

// The runtime of a type with none registered: every entry fails, naming the type.
template <int kSlot>
struct Missing {
  static absl::Status Error() {
    return absl::FailedPreconditionError(absl::StrCat(
        "no device runtime for ", DeviceTypeName(static_cast<DeviceType>(kSlot)), " devices"));
  }
  static DeviceRuntime Make() {
    DeviceRuntime r;
    r.name = "none";
    r.create_stream = [](Device) -> absl::StatusOr<StreamHandle> { return Error(); };
    r.destroy_stream = [](Device, StreamHandle) {};
    r.synchronize_stream = [](Device, StreamHandle) { return Error(); };
    r.begin_capture = [](Device, StreamHandle) { return Error(); };
    r.end_capture = [](Device, StreamHandle) -> absl::StatusOr<void*> { return Error(); };
    r.launch_graph = [](Device, StreamHandle, void*) { return Error(); };
    r.destroy_graph = [](Device, void*) {};
    r.host_register = [](Device, void*, size_t) { return Error(); };
    r.host_unregister = [](Device, void*) { return Error(); };
    r.device_uuids = []() -> absl::StatusOr<std::vector<GpuUuid>> { return Error(); };
    r.open_ipc_mem_handle = [](Device, absl::Span<const uint8_t>) -> absl::StatusOr<IpcMapping> {
      return Error();
    };
    r.close_ipc_mem_handle = [](Device, void*) { return Error(); };
    r.import_vmm_fd = [](Device, int, uint64_t, uint64_t) -> absl::StatusOr<VmmMapping> {
      return Error();
    };
    r.unmap_vmm = [](Device, const VmmMapping&) { return Error(); };
    r.open_ipc_event = [](Device, absl::Span<const uint8_t>) -> absl::StatusOr<void*> {
      return Error();
    };
    r.destroy_event = [](Device, void*) { return Error(); };
    r.stream_wait_event = [](Device, StreamHandle, void*) { return Error(); };
    r.record_event = [](Device, StreamHandle, void*) { return Error(); };
    r.memory_stats = [](Device) -> absl::StatusOr<DeviceMemoryStats> { return Error(); };
    r.health = [](Device) { return Error(); };
    r.last_allocation_error = [] { return std::string(); };
    return r;
  }
};

}  // namespace

absl::Status RegisterDeviceRuntime(DeviceType type, const DeviceRuntime* runtime) {
  const int slot = Slot(type);
  if (type == DeviceType::kCpu || slot < 0 || slot >= kDeviceTypes) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterDeviceRuntime: no runtime for device type ", DeviceTypeName(type)));
  }
  if (runtime == nullptr || !Complete(*runtime)) {
    return absl::InvalidArgumentError("RegisterDeviceRuntime: a null runtime or a null entry");
  }
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.runtimes[slot] != nullptr && r.runtimes[slot] != runtime) {
    return absl::AlreadyExistsError(absl::StrCat("RegisterDeviceRuntime: ", DeviceTypeName(type),
                                                 " already has runtime ", r.runtimes[slot]->name));
  }
  r.runtimes[slot] = runtime;
  return absl::OkStatus();
}

const DeviceRuntime* FindDeviceRuntime(DeviceType type) {
  const int slot = Slot(type);
  if (slot < 0 || slot >= kDeviceTypes) return nullptr;
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.runtimes[slot];
}

const DeviceRuntime& DeviceRuntimeFor(DeviceType type) {
  if (const DeviceRuntime* r = FindDeviceRuntime(type); r != nullptr) return *r;
  static_assert(kDeviceTypes == 3, "one missing runtime per device type");
  static const DeviceRuntime missing[kDeviceTypes] = {Missing<0>::Make(), Missing<1>::Make(),
                                                      Missing<2>::Make()};
  const int slot = Slot(type);
  return missing[slot >= 0 && slot < kDeviceTypes ? slot : 0];
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
