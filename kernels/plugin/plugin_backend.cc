// The adapter of the plugin C ABI (plugin_backend.h): the OpsBackend and the DeviceRuntime.
#include "kernels/plugin/plugin_backend.h"

#include <atomic>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "kernels/device_runtime.h"
#include "kernels/elementwise_math.h"
#include "kernels/ops.h"
#include "kernels/plugin/abi_args.h"

namespace diond::kernels {
namespace {

static_assert(DIOND_DT_F32 == static_cast<int>(DType::kF32) &&
                  DIOND_DT_BF16 == static_cast<int>(DType::kBf16) &&
                  DIOND_DT_F16 == static_cast<int>(DType::kF16),
              "C ABI dtype codes follow kernels::DType");
static_assert(math::kUnarySign == static_cast<int>(UnaryOp::kSign) &&
                  math::kUnaryAbs == static_cast<int>(UnaryOp::kAbs) &&
                  math::kUnarySqrt == static_cast<int>(UnaryOp::kSqrt) &&
                  math::kUnarySquare == static_cast<int>(UnaryOp::kSquare) &&
                  math::kUnaryNeg == static_cast<int>(UnaryOp::kNeg) &&
                  math::kUnaryNanToNum == static_cast<int>(UnaryOp::kNanToNum),
              "unary op codes follow kernels::UnaryOp");
static_assert(math::kBinaryAdd == static_cast<int>(BinaryOp::kAdd) &&
                  math::kBinarySub == static_cast<int>(BinaryOp::kSub) &&
                  math::kBinaryMul == static_cast<int>(BinaryOp::kMul) &&
                  math::kBinaryDiv == static_cast<int>(BinaryOp::kDiv) &&
                  math::kBinaryMax == static_cast<int>(BinaryOp::kMax) &&
                  math::kBinaryMin == static_cast<int>(BinaryOp::kMin),
              "binary op codes follow kernels::BinaryOp");
static_assert(static_cast<int>(Axis::kRows) == 0 && static_cast<int>(Axis::kCols) == 1, "axis");
static_assert(static_cast<int>(NormType::kL1) == 0 && static_cast<int>(NormType::kL2) == 1 &&
                  static_cast<int>(NormType::kSumOfSquares) == 2,
              "norm codes");

// Slot 0: kCuda, slot 1: kTest.
std::atomic<const DiondOpsApiV1*> g_ops[2];

int SlotOf(DeviceType t) { return t == DeviceType::kCuda ? 0 : (t == DeviceType::kTest ? 1 : -1); }

template <int S>
const DiondOpsApiV1& Api() {
  return *g_ops[S].load(std::memory_order_acquire);
}

// One call's record and error buffer.
struct Call {
  explicit Call(const Context& ctx) : c{ctx.device().index, ctx.stream(), err, sizeof(err)} {}
  Call(int device, void* stream) : c{device, stream, err, sizeof(err)} {}
  absl::Status Done(const char* op, int rc, const char* backend) const {
    if (rc == DIOND_OPS_OK) return absl::OkStatus();
    std::string msg = absl::StrCat(op, " on ", backend, ": ", err[0] ? err : "failed");
    switch (rc) {
      case DIOND_OPS_FAILED_PRECONDITION:
        return absl::FailedPreconditionError(msg);
      case DIOND_OPS_RESOURCE_EXHAUSTED:
        return absl::ResourceExhaustedError(msg);
      default:
        return absl::InternalError(msg);
    }
  }
  char err[512] = {0};
  DiondOpsCall c;
};

thread_local std::string t_last_allocation_error;

template <int S>
void* Allocate(Device device, size_t bytes) {
  Call call(device.index, nullptr);
  void* p = nullptr;
  if (Api<S>().allocate(&call.c, bytes, &p) == DIOND_OPS_OK) return p;
  t_last_allocation_error = call.err;
  return nullptr;
}
template <int S>
void Deallocate(Device device, void* p, size_t bytes) {
  Api<S>().deallocate(device.index, nullptr, p, bytes);
}

// The device-scalar form of a C entry (an ops.def DIOND_OP_DEV row), or nullptr.
template <auto CEntry>
struct DevFormOf {
  static constexpr std::nullptr_t kEntry = nullptr;
};
#define DIOND_OP_DEV(name, Name, host_op, c_params)                                                \
  template <>                                                                                      \
  struct DevFormOf<&DiondOpsApiV1::host_op> {                                                      \
    static_assert(std::is_same_v<decltype(DiondOpsApiV1::name), decltype(DiondOpsApiV1::host_op)>, \
                  #name " takes " #host_op "'s arguments");                                        \
    static constexpr auto kEntry = &DiondOpsApiV1::name;                                           \
  };
#include "kernels/ops.def"

template <typename Fn>
struct CParams;
template <typename... C>
struct CParams<int (*)(C...)> {
  using Tuple = std::tuple<C...>;
};

// The forwarding of one op: each C++ argument in its C form (abi::ToC), the C entry called with
// the context's device and stream, outputs written back, the code turned into a status.
template <int S, auto CEntry, typename Sig>
struct Forward;
template <int S, auto CEntry, typename... P>
struct Forward<S, CEntry, absl::Status (*)(const Context&, P...)> {
  using Args = std::tuple<abi::ToC<std::decay_t<P>>...>;
  using CEntryType = std::remove_reference_t<decltype(std::declval<DiondOpsApiV1>().*CEntry)>;
  static_assert(
      std::is_same_v<typename CParams<CEntryType>::Tuple,
                     decltype(std::tuple_cat(std::tuple<const DiondOpsCall*>(),
                                             std::declval<abi::ToC<std::decay_t<P>>&>().c()...))>,
      "an op's C parameters in kernels/ops.def are not the C form of its C++ ones");

  static absl::Status Entry(const Context& ctx, P... a) {
    Call call(ctx);
    Args args{abi::ToC<std::decay_t<P>>(a)...};
    CEntryType entry = Api<S>().*CEntry;
    if constexpr (!std::is_null_pointer_v<decltype(DevFormOf<CEntry>::kEntry)>) {
      if (std::apply([](const auto&... c) { return (abi::OnDevice(c) || ...); }, args)) {
        entry = Api<S>().*DevFormOf<CEntry>::kEntry;
      }
    }
    const int rc = std::apply(
        [&](auto&... c) {
          return std::apply(entry, std::tuple_cat(std::make_tuple(&call.c), c.c()...));
        },
        args);
    std::apply([rc](auto&... c) { (c.Finish(rc), ...); }, args);
    return call.Done(name, rc, Api<S>().name);
  }
  inline static const char* name = "op";
};

template <typename T>
struct MemberOf;
template <typename T>
struct MemberOf<T OpsBackend::*> {
  using Type = T;
};

template <int S, auto CppMember, auto CEntry>
void Set(OpsBackend& b, const char* name) {
  using F = Forward<S, CEntry, typename MemberOf<decltype(CppMember)>::Type>;
  F::name = name;
  b.*CppMember = &F::Entry;
}

template <int S>
OpsBackend MakeTable(const char* name) {
  OpsBackend b;
  b.name = name;
  b.allocate = &Allocate<S>;
  b.deallocate = &Deallocate<S>;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) \
  Set<S, &OpsBackend::name, &DiondOpsApiV1::name>(b, #Name);
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) \
  Set<S, &OpsBackend::name, &DiondOpsApiV1::c_entry>(b, #Name);
#include "kernels/ops.def"
  return b;
}

bool HasNullEntry(const DiondOpsApiV1& o) {
#define DIOND_ENTRY(name, Name, ret, c_params) \
  if (o.name == nullptr) return true;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) \
  if (o.name == nullptr) return true;
#define DIOND_OP_DEV(name, Name, host_op, c_params) \
  if (o.name == nullptr) return true;
#include "kernels/ops.def"
  return o.name == nullptr;
}

const DiondOpsApiV1* OpsFor(Device device) {
  const int slot = SlotOf(device.type);
  return slot < 0 ? nullptr : g_ops[slot].load(std::memory_order_acquire);
}

// ---- the runtime entries (device_runtime.h), through the same table ----

absl::StatusOr<StreamHandle> CreateDeviceStream(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  void* stream = nullptr;
  absl::Status s = call.Done("stream_create", ops->stream_create(&call.c, &stream), ops->name);
  if (!s.ok()) return s;
  return stream;
}

void DestroyDeviceStream(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops != nullptr && stream != nullptr) ops->stream_destroy(device.index, stream);
}

absl::Status SynchronizeDeviceStream(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("stream_synchronize", ops->stream_synchronize(&call.c), ops->name);
}

absl::StatusOr<DeviceMemoryStats> GetDeviceMemoryStats(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  DeviceMemoryStats st;
  absl::Status s =
      call.Done("memory_stats", ops->memory_stats(&call.c, &st.in_use, &st.peak), ops->name);
  if (!s.ok()) return s;
  return st;
}

absl::Status DeviceHealth(Device device) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("device_health", ops->device_health(&call.c), ops->name);
}

absl::Status CheckHandle(const char* what, absl::Span<const uint8_t> handle) {
  if (handle.size() != DIOND_CUDA_IPC_HANDLE_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be ", DIOND_CUDA_IPC_HANDLE_BYTES,
                                                   " bytes, got ", handle.size()));
  }
  return absl::OkStatus();
}

template <int S>
absl::StatusOr<std::vector<GpuUuid>> ListDeviceUuids() {
  const DiondOpsApiV1* ops = g_ops[S].load(std::memory_order_acquire);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this type");
  Call call(0, nullptr);
  int32_t count = 0;
  DIOND_RETURN_IF_ERROR(
      call.Done("device_uuids", ops->device_uuids(&call.c, nullptr, 0, &count), ops->name));
  if (count < 0 || count > 1024) {
    return absl::InternalError(absl::StrCat("device_uuids: ", count, " devices"));
  }
  std::vector<GpuUuid> out(static_cast<size_t>(count));
  int32_t again = 0;
  DIOND_RETURN_IF_ERROR(call.Done(
      "device_uuids",
      ops->device_uuids(&call.c, count == 0 ? nullptr : out[0].data(), count, &again), ops->name));
  if (again != count) {
    return absl::InternalError(absl::StrCat("device_uuids: ", count, " devices, then ", again));
  }
  return out;
}

absl::StatusOr<IpcMapping> OpenIpcMemHandle(Device device, absl::Span<const uint8_t> handle) {
  DIOND_RETURN_IF_ERROR(CheckHandle("a CUDA IPC memory handle", handle));
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  IpcMapping m;
  DIOND_RETURN_IF_ERROR(
      call.Done("ipc_open_mem_handle",
                ops->ipc_open_mem_handle(&call.c, handle.data(), &m.ptr, &m.bytes), ops->name));
  return m;
}

absl::Status CloseIpcMemHandle(Device device, void* ptr) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("ipc_close_mem_handle", ops->ipc_close_mem_handle(&call.c, ptr), ops->name);
}

absl::StatusOr<VmmMapping> ImportVmmFd(Device device, int fd, uint64_t bytes,
                                       uint64_t granularity) {
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("VMM fd ", fd, " is not an fd"));
  if (bytes == 0 || granularity == 0 || bytes % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("VMM mapping of ", bytes,
                                                   " bytes must be a non-zero multiple of its "
                                                   "granularity ",
                                                   granularity));
  }
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  VmmMapping m;
  m.bytes = bytes;
  DIOND_RETURN_IF_ERROR(
      call.Done("vmm_import_fd",
                ops->vmm_import_fd(&call.c, fd, bytes, granularity, &m.ptr, &m.handle), ops->name));
  return m;
}

absl::Status UnmapVmm(Device device, const VmmMapping& mapping) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("vmm_unmap", ops->vmm_unmap(&call.c, mapping.ptr, mapping.bytes, mapping.handle),
                   ops->name);
}

absl::StatusOr<void*> OpenIpcEvent(Device device, absl::Span<const uint8_t> handle) {
  DIOND_RETURN_IF_ERROR(CheckHandle("a CUDA IPC event handle", handle));
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  void* event = nullptr;
  DIOND_RETURN_IF_ERROR(
      call.Done("ipc_open_event", ops->ipc_open_event(&call.c, handle.data(), &event), ops->name));
  return event;
}

absl::Status DestroyEvent(Device device, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("event_destroy", ops->event_destroy(&call.c, event), ops->name);
}

absl::Status StreamWaitEvent(Device device, StreamHandle stream, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("stream_wait_event", ops->stream_wait_event(&call.c, event), ops->name);
}

absl::Status RecordEvent(Device device, StreamHandle stream, void* event) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("event_record", ops->event_record(&call.c, event), ops->name);
}

absl::Status HostRegister(Device device, void* ptr, size_t bytes) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("host_register", ops->host_register(&call.c, ptr, bytes), ops->name);
}

absl::Status HostUnregister(Device device, void* ptr) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, nullptr);
  return call.Done("host_unregister", ops->host_unregister(&call.c, ptr), ops->name);
}
absl::Status BeginStreamCapture(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("graph_begin_capture", ops->graph_begin_capture(&call.c), ops->name);
}

absl::StatusOr<void*> EndStreamCapture(Device device, StreamHandle stream) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  void* graph = nullptr;
  absl::Status s =
      call.Done("graph_end_capture", ops->graph_end_capture(&call.c, &graph), ops->name);
  if (!s.ok()) return s;
  return graph;
}

absl::Status LaunchGraph(Device device, StreamHandle stream, void* graph) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops == nullptr) return absl::FailedPreconditionError("no device backend for this device");
  Call call(device.index, stream);
  return call.Done("graph_launch", ops->graph_launch(&call.c, graph), ops->name);
}

void DestroyGraph(Device device, void* graph) {
  const DiondOpsApiV1* ops = OpsFor(device);
  if (ops != nullptr && graph != nullptr) ops->graph_destroy(device.index, graph);
}

std::string LastDeviceAllocationError() { return t_last_allocation_error; }

template <int S>
DeviceRuntime MakeRuntime(const char* name) {
  DeviceRuntime r;
  r.name = name;
  // What the start-up probe measured on a host-memory device until now: every rule reaches
  // device memory only through the ops and explicit copies (docs/KERNELS.md §4.4).
  r.rules_on_device = true;
  r.create_stream = &CreateDeviceStream;
  r.destroy_stream = &DestroyDeviceStream;
  r.synchronize_stream = &SynchronizeDeviceStream;
  r.begin_capture = &BeginStreamCapture;
  r.end_capture = &EndStreamCapture;
  r.launch_graph = &LaunchGraph;
  r.destroy_graph = &DestroyGraph;
  r.host_register = &HostRegister;
  r.host_unregister = &HostUnregister;
  r.device_uuids = &ListDeviceUuids<S>;
  r.open_ipc_mem_handle = &OpenIpcMemHandle;
  r.close_ipc_mem_handle = &CloseIpcMemHandle;
  r.import_vmm_fd = &ImportVmmFd;
  r.unmap_vmm = &UnmapVmm;
  r.open_ipc_event = &OpenIpcEvent;
  r.destroy_event = &DestroyEvent;
  r.stream_wait_event = &StreamWaitEvent;
  r.record_event = &RecordEvent;
  r.memory_stats = &GetDeviceMemoryStats;
  r.health = &DeviceHealth;
  r.last_allocation_error = &LastDeviceAllocationError;
  return r;
}

const DeviceRuntime* RuntimeOf(int slot) {
  static const DeviceRuntime cuda = MakeRuntime<0>("cuda (plugin)");
  static const DeviceRuntime test = MakeRuntime<1>("host-test device (TEST BACKEND)");
  return slot == 0 ? &cuda : &test;
}

}  // namespace

absl::StatusOr<const OpsBackend*> AdaptPluginOps(DeviceType type, const DiondOpsApiV1* ops) {
  const int slot = SlotOf(type);
  if (slot < 0) return absl::InvalidArgumentError("AdaptPluginOps: type must be kCuda or kTest");
  if (ops == nullptr) return absl::InvalidArgumentError("AdaptPluginOps: null ops table");
  if (ops->version != DIOND_OPS_API_VERSION) {
    return absl::InvalidArgumentError(absl::StrCat("AdaptPluginOps: ops table version ",
                                                   ops->version, " != ", DIOND_OPS_API_VERSION));
  }
  if (HasNullEntry(*ops)) return absl::InvalidArgumentError("AdaptPluginOps: null entry");
  const DiondOpsApiV1* expected = nullptr;
  if (!g_ops[slot].compare_exchange_strong(expected, ops) && expected != ops) {
    if (FindOpsBackend(type) != nullptr) {
      return absl::AlreadyExistsError("AdaptPluginOps: another table is registered");
    }
    g_ops[slot].store(ops, std::memory_order_release);
  }
  static const OpsBackend cuda = MakeTable<0>("cuda (plugin)");
  static const OpsBackend test = MakeTable<1>("host-test device (TEST BACKEND)");
  return slot == 0 ? &cuda : &test;
}

absl::Status RegisterPluginOps(DeviceType type, const DiondOpsApiV1* ops) {
  auto table = AdaptPluginOps(type, ops);
  if (!table.ok()) return table.status();
  DIOND_RETURN_IF_ERROR(RegisterOpsBackend(type, *table));
  return RegisterDeviceRuntime(type, RuntimeOf(SlotOf(type)));
}

absl::Status RegisterCudaOps(const std::string& plugin_path) {
  auto plugin = LoadCudaPlugin(plugin_path);
  if (!plugin.ok()) return plugin.status();
  if ((*plugin)->ops == nullptr) {
    return absl::FailedPreconditionError("the CUDA plugin has no ops table");
  }
  char err[256] = {0};
  const int count = (*plugin)->device_count(err, sizeof(err));
  if (count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no GPU: ", count < 0 ? err : "no CUDA device present"));
  }
  return RegisterPluginOps(DeviceType::kCuda, (*plugin)->ops);
}

}  // namespace diond::kernels
