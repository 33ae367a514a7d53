// Implementation of kernels/graph.h: the recording table interposed on a Context, and the graphs
// kept by signature.
#include "kernels/graph.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace diond::kernels {

namespace {

// ---- the phase's signature: one 64-bit hash per op ------------------------------------------

inline uint64_t Mix(uint64_t h, uint64_t v) {
  // splitmix64's finalizer over h ^ v: every bit of v reaches every bit of the result.
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename P>
void HashArg(uint64_t& h, const BasicTensorView<P>& v) {
  h = Mix(h, reinterpret_cast<uintptr_t>(v.data()));
  h = Mix(h,
          (static_cast<uint64_t>(v.device().type) << 32) ^ static_cast<uint32_t>(v.device().index));
  const TensorLayout& l = v.layout();
  h = Mix(h, (static_cast<uint64_t>(l.dtype) << 8) ^ static_cast<uint64_t>(l.rank));
  for (int i = 0; i < kMaxRank; ++i) {
    h = Mix(h, static_cast<uint64_t>(l.dims[i]));
    h = Mix(h, static_cast<uint64_t>(l.strides[i]));
  }
}
inline void HashArg(uint64_t& h, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  h = Mix(h, bits);
}
inline void HashArg(uint64_t& h, bool v) { h = Mix(h, v ? 1 : 2); }
// The host and device addresses of the queued copies (Options::host_copies), and their size.
inline void HashArg(uint64_t& h, const void* p) { h = Mix(h, reinterpret_cast<uintptr_t>(p)); }
inline void HashArg(uint64_t& h, size_t v) { h = Mix(h, static_cast<uint64_t>(v)); }
inline void HashArg(uint64_t& h, int64_t v) { h = Mix(h, static_cast<uint64_t>(v)); }
template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>>
void HashArg(uint64_t& h, E v) {
  h = Mix(h, static_cast<uint64_t>(v));
}
inline void HashArg(uint64_t& h, const GemmParams& p) {
  HashArg(h, p.trans_a);
  HashArg(h, p.trans_b);
  HashArg(h, p.alpha);
  HashArg(h, p.beta);
  HashArg(h, p.engine);
}
// The fused steps' scalars are data (the record), not part of the signature.
inline void HashArg(uint64_t&, const AdamWParams&) {}
inline void HashArg(uint64_t&, const LionParams&) {}
inline void HashArg(uint64_t&, const ApplyUpdateParams&) {}

// ---- a pass of the phase --------------------------------------------------------------------

struct Pass {
  bool capture = false;      // false: record only (execute nothing)
  bool host_copies = false;  // StepGraph::Options::host_copies
  const OpsBackend* inner = nullptr;
  std::vector<uint64_t> signature;
  std::vector<unsigned char> records;  // host block of records, in op order
  unsigned char* block = nullptr;      // capture: the device block the records are uploaded to
  std::string refused;                 // the first op that cannot be in a graph, and why
  int64_t record_count = 0;
};
thread_local Pass* active = nullptr;

constexpr size_t kRecordAlign = 16;

// Appends `rec` to the pass's records; returns its device address (capture) or null (record).
template <typename R>
const R* AddRecord(Pass& p, const R& rec) {
  ++p.record_count;
  const size_t at = (p.records.size() + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
  p.records.resize(at + sizeof(R));
  std::memcpy(p.records.data() + at, &rec, sizeof(R));
  return p.block != nullptr ? reinterpret_cast<const R*>(p.block + at) : nullptr;
}

// What an entry hands its backend: the argument itself, or (a fused step's params) a copy
// whose scalars are the record just added.
template <typename T>
const T& Forward(Pass&, const T& v) {
  return v;
}
AdamWParams Forward(Pass& p, const AdamWParams& a) {
  AdamWParams b = a;
  b.scalars_on_device = AddRecord(p, ScalarRecordOf(a));
  return b;
}
LionParams Forward(Pass& p, const LionParams& a) {
  LionParams b = a;
  b.scalars_on_device = AddRecord(p, ScalarRecordOf(a));
  return b;
}
ApplyUpdateParams Forward(Pass& p, const ApplyUpdateParams& a) {
  ApplyUpdateParams b = a;
  b.scalars_on_device = AddRecord(p, ScalarRecordOf(a));
  return b;
}

// The `kind` of every op of kernels/ops.def, whether it can be in a graph: kGraph
// (queued device work), kWaits (hands a value to the host: a sync point), kHostMemory (reads or
// writes host memory when it runs, which a replay would repeat on stale or freed memory),
// kHostCopy (a queued copy between pinned host memory and the device: in a graph only with
// Options::host_copies, the caller vouching for the host memory), kNoCapture (its library does
// not document stream capture: cuSOLVER's geqrf/orgqr behind thin_qr).
enum class Kind { kGraph, kWaits, kHostMemory, kHostCopy, kNoCapture };
// The ops of kernels/ops.def (its OpsBackend rows, in its order), with their kinds.
enum Op : int {
#define DIOND_OP(name, Name, kind, cpp_params, c_params) kOp_##name,
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) kOp_##name,
#include "kernels/ops.def"
};
constexpr const char* kOpNames[] = {
#define DIOND_OP(name, Name, kind, cpp_params, c_params) #name,
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) #name,
#include "kernels/ops.def"
};
constexpr Kind kOpKinds[] = {
#define DIOND_OP(name, Name, kind, cpp_params, c_params) Kind::kind,
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) Kind::kind,
#include "kernels/ops.def"
};

// An op that cannot be in the pass's graph: the first one is noted, and the phase sees an error.
absl::Status Refuse(Pass& p, int op, Kind kind) {
  if (p.refused.empty()) {
    p.refused = absl::StrCat(
        kOpNames[op],
        kind == Kind::kWaits       ? " (it waits for the device to hand a value to the host)"
        : kind == Kind::kNoCapture ? " (its library, cuSOLVER, does not document stream capture)"
                                   : " (it reads or writes host memory)");
  }
  return absl::FailedPreconditionError(
      absl::StrCat(kOpNames[op], " cannot be part of a captured graph"));
}

template <typename Sig>
struct Wrap;
template <typename... A>
struct Wrap<absl::Status (*)(const Context&, A...)> {
  template <absl::Status (*OpsBackend::*M)(const Context&, A...), int kOp>
  static absl::Status Entry(const Context& ctx, A... a) {
    Pass& p = *active;
    constexpr Kind kind = kOpKinds[kOp];
    if constexpr (kind == Kind::kGraph || kind == Kind::kHostCopy) {
      if (kind == Kind::kHostCopy && !p.host_copies) return Refuse(p, kOp, kind);
      uint64_t h = Mix(0, static_cast<uint64_t>(kOp) + 1);
      (HashArg(h, a), ...);
      p.signature.push_back(h);
      if (!p.capture) {
        // Recording: the records are still formed, so that a replay uploads this step's.
        ((void)Forward(p, a), ...);
        return absl::OkStatus();
      }
      return (p.inner->*M)(ctx, Forward(p, a)...);
    } else {
      return Refuse(p, kOp, kind);
    }
  }
};

void* ForwardAllocate(Device device, size_t bytes) {
  return FindOpsBackend(device.type)->allocate(device, bytes);
}
void ForwardDeallocate(Device device, void* p, size_t bytes) {
  FindOpsBackend(device.type)->deallocate(device, p, bytes);
}

const OpsBackend& RecordingTable() {
  static const OpsBackend* table = [] {
    auto* t = new OpsBackend;
    t->name = "graph-recorder";
    t->allocate = &ForwardAllocate;
    t->deallocate = &ForwardDeallocate;
#define DIOND_X(member) \
  t->member =           \
      &Wrap<decltype(OpsBackend::member)>::template Entry<&OpsBackend::member, kOp_##member>;
#define DIOND_OP(name, Name, kind, cpp_params, c_params) DIOND_X(name)
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) DIOND_X(name)
#include "kernels/ops.def"
#undef DIOND_X
    return t;
  }();
  return *table;
}

// Runs `phase` with `pass` active on `ctx`, the recording table interposed.
absl::Status RunPass(Context* ctx, Pass& pass, const std::function<absl::Status()>& phase) {
  pass.inner = &ctx->backend();
  active = &pass;
  ctx->InterposeBackend(&RecordingTable());
  absl::Status s = phase();
  ctx->InterposeBackend(nullptr);
  active = nullptr;
  return s;
}

}  // namespace

struct StepGraph::Graph {
  std::vector<uint64_t> signature;
  void* exec = nullptr;
  Buffer block;                        // the records on the device
  std::vector<unsigned char> records;  // their host copy, uploaded before each launch
};

StepGraph::StepGraph(Context* ctx, GraphHooks hooks, Options options)
    : ctx_(ctx),
      hooks_(std::move(hooks)),
      capacity_(std::max<size_t>(options.capacity, 1)),
      host_copies_(options.host_copies) {}

StepGraph::~StepGraph() { Clear(); }

void StepGraph::Clear() {
  for (auto& g : graphs_) {
    if (g->exec != nullptr && hooks_.destroy) hooks_.destroy(ctx_->device(), g->exec);
  }
  graphs_.clear();
}

absl::StatusOr<StepGraph::Outcome> StepGraph::Run(const std::function<absl::Status()>& phase) {
  Outcome out;
  auto eager = [&](const char* reason, std::string detail) {
    out.mode = Mode::kEager;
    out.reason = reason;
    out.detail = std::move(detail);
    return out;
  };
  if (ctx_->backend().version != kOpsBackendVersion || active != nullptr) {
    return eager("unsupported", "a graph pass is already running on this thread");
  }
  Pass rec;
  rec.host_copies = host_copies_;
  absl::Status recorded = RunPass(ctx_, rec, phase);
  out.ops = static_cast<int64_t>(rec.signature.size());
  if (!rec.refused.empty()) {
    return eager("sync_point", absl::StrCat("the step calls ", rec.refused,
                                            ", which a captured graph cannot hold"));
  }
  if (!recorded.ok()) {
    return eager("phase_failed", std::string(recorded.message()));
  }
  Graph* g = nullptr;
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
    if ((*it)->signature == rec.signature) {
      graphs_.splice(graphs_.begin(), graphs_, it);  // most recently used first
      g = graphs_.front().get();
      break;
    }
  }
  if (g != nullptr) {
    // This step's records (the same layout: the same ops) replace the last launch's, whose
    // upload has completed (the caller waited for the stream since).
    if (!rec.records.empty()) {
      std::memcpy(g->records.data(), rec.records.data(), rec.records.size());
    }
    out.mode = Mode::kReplayed;
    ++replays_;
  } else {
    if (!hooks_.begin_capture || !hooks_.end_capture || !hooks_.launch) {
      return eager("unsupported", "the device backend has no stream capture");
    }
    auto fresh = std::make_unique<Graph>();
    fresh->records = rec.records;
    if (!rec.records.empty()) {
      auto block =
          ctx_->Allocate(DType::kF32, {static_cast<int64_t>((rec.records.size() + 3) / 4)});
      if (!block.ok()) {
        return eager("capture_failed",
                     absl::StrCat("the graph's scalar block: ", block.status().message()));
      }
      fresh->block = *std::move(block);
    }
    if (absl::Status s = hooks_.begin_capture(ctx_->device(), ctx_->stream()); !s.ok()) {
      return eager("unsupported", std::string(s.message()));
    }
    Pass cap;
    cap.capture = true;
    cap.host_copies = host_copies_;
    cap.block = static_cast<unsigned char*>(fresh->block.data());
    absl::Status captured = RunPass(ctx_, cap, phase);
    absl::StatusOr<void*> exec = hooks_.end_capture(ctx_->device(), ctx_->stream());
    auto drop = [&] {
      if (exec.ok() && *exec != nullptr && hooks_.destroy) hooks_.destroy(ctx_->device(), *exec);
    };
    if (!captured.ok() || !exec.ok() || *exec == nullptr) {
      drop();
      const absl::Status& why = !captured.ok() ? captured : exec.status();
      return eager("capture_failed",
                   why.ok() ? "the capture produced no graph" : std::string(why.message()));
    }
    if (cap.signature != rec.signature || cap.records.size() != rec.records.size()) {
      drop();
      return eager("capture_failed",
                   "the step issued other ops under capture than when recorded (it allocates "
                   "or depends on state the recording changed)");
    }
    fresh->exec = *exec;
    fresh->signature = std::move(rec.signature);
    graphs_.push_front(std::move(fresh));
    while (graphs_.size() > capacity_) {
      Graph& old = *graphs_.back();
      if (old.exec != nullptr && hooks_.destroy) hooks_.destroy(ctx_->device(), old.exec);
      graphs_.pop_back();
    }
    g = graphs_.front().get();
    out.mode = Mode::kCaptured;
    ++captures_;
  }
  out.records = rec.record_count;
  if (!g->records.empty()) {
    // The block holds whole f32 words: the host copy is padded to them (zeros).
    const int64_t words = static_cast<int64_t>((g->records.size() + 3) / 4);
    g->records.resize(static_cast<size_t>(words) * 4, 0);
    DIOND_RETURN_IF_ERROR(CopyFromHostAsync(
        *ctx_, ConstTensorView(g->records.data(), ContiguousLayout(DType::kF32, {words})),
        TensorView(g->block.data(), ContiguousLayout(DType::kF32, {words}), ctx_->device())));
  }
  DIOND_RETURN_IF_ERROR(hooks_.launch(ctx_->device(), ctx_->stream(), g->exec));
  return out;
}

}  // namespace diond::kernels
