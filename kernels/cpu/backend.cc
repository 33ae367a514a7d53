// The CPU backend's table (kernels/backend.h), its host allocator, its registration for
// DeviceType::kCpu and Context::CpuDefault.
#include "kernels/cpu/backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/context.h"

namespace diond::kernels::cpu {

void* HostAllocate(Device, size_t bytes) {
  const size_t rounded = ((bytes ? bytes : 1) + 63) & ~size_t{63};
  return std::aligned_alloc(64, rounded);
}

void HostDeallocate(Device, void* p, size_t) { std::free(p); }

namespace {

absl::Status CopyFromHost(const Context&, const void* host, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host, bytes);
  return absl::OkStatus();
}

absl::Status CopyToHost(const Context&, const void* src, void* host, size_t bytes) {
  if (bytes > 0) std::memcpy(host, src, bytes);
  return absl::OkStatus();
}

// asynccopy: host memory is the CPU's device memory, so the queued copies are plain copies and
// there is no stream to wait for; the flag forms run the host-bool scans.
absl::Status Synchronize(const Context&) { return absl::OkStatus(); }

absl::Status AllFiniteFlag(const Context& ctx, ConstTensorView x, TensorView nonfinite) {
  bool finite = true;
  if (absl::Status s = cpu::AllFinite(ctx, x, &finite); !s.ok()) return s;
  if (!finite) *static_cast<float*>(nonfinite.data()) = 1.0f;
  return absl::OkStatus();
}

absl::Status WidenScaleCheckFiniteFlag(const Context& ctx, ConstTensorView x, float scale,
                                       TensorView out, TensorView nonfinite) {
  bool finite = true;
  if (absl::Status s = cpu::WidenScaleCheckFinite(ctx, x, scale, out, &finite); !s.ok()) {
    return s;
  }
  if (!finite) *static_cast<float*>(nonfinite.data()) = 1.0f;
  return absl::OkStatus();
}

OpsBackend MakeTable() {
  OpsBackend t;
  t.name = "cpu";
  t.allocate = &HostAllocate;
  t.deallocate = &HostDeallocate;
  t.copy_from_host = &CopyFromHost;
  t.copy_to_host = &CopyToHost;
  t.gemm = &Gemm;
  t.symmetric_product = &SymmetricProduct;
  t.symmetric_product_bf16 = &SymmetricProductBf16;
  t.thin_qr = &ThinQr;
  t.cholesky_qr = &CholeskyQr;
  t.randomized_cholesky_qr = &RandomizedCholeskyQr;
  t.frobenius_norm = &FrobeniusNorm;
  t.axis_norms = &AxisNorms;
  t.top_k_by_l1_norm = &TopKByL1Norm;
  t.is_all_zero = &IsAllZero;
  t.gather = &Gather;
  t.scatter = &Scatter;
  t.copy = &Copy;
  t.fill = &Fill;
  t.axpby = &Axpby;
  t.add_scalar = &AddScalar;
  t.unary = &Unary;
  t.binary = &Binary;
  t.adamw_step = &AdamWStep;
  t.lion_step = &LionStep;
  // ortho
  t.add_to_diagonal = &AddToDiagonal;
  t.bf16_rounded_axpby = &Bf16RoundedAxpby;
  // kops
  t.adamw_step_tracked = &AdamWStepTracked;
  t.lion_step_tracked = &LionStepTracked;
  t.momentum_update = &MomentumUpdate;
  t.apply_update = &ApplyUpdate;
  t.normalize_neurons = &NormalizeNeurons;
  t.copy_with_change = &CopyWithChange;
  t.decay_scatter_with_change = &DecayScatterWithChange;
  // steps
  t.all_finite = &AllFinite;
  t.widen_scale_check_finite = &WidenScaleCheckFinite;
  t.fnv1a_checksum = &Fnv1aChecksum;
  // asynccopy
  t.copy_from_host_async = &CopyFromHost;
  t.copy_to_host_async = &CopyToHost;
  t.synchronize = &Synchronize;
  t.all_finite_flag = &AllFiniteFlag;
  t.widen_scale_check_finite_flag = &WidenScaleCheckFiniteFlag;
  return t;
}

bool RegisterCpu() {
  const absl::Status s = RegisterOpsBackend(DeviceType::kCpu, &CpuBackend());
  if (!s.ok()) {  // a programming error (an incomplete table), found by every test
    std::fprintf(stderr, "diond: cannot register the CPU ops backend: %s\n", s.ToString().c_str());
    std::abort();
  }
  return true;
}

// Registers the table before main(). The diond::ops target links this object file into every
// program that uses the ops API (kernels/cpu/CMakeLists.txt: -u diond_cpu_ops_backend_anchor).
const bool registered = RegisterCpu();

}  // namespace

const OpsBackend& CpuBackend() {
  static const OpsBackend table = MakeTable();
  return table;
}

}  // namespace diond::kernels::cpu

// The symbol the linker is told to resolve, which pulls this file (and its registration) out of
// the static library even though nothing calls into it by name.
extern "C" {
int diond_cpu_ops_backend_anchor = 1;
}

namespace diond::kernels {

std::unique_ptr<Context> Context::CpuDefault(int num_threads) {
  (void)cpu::registered;
  ContextOptions o;
  o.num_threads = num_threads > 1024 ? 1024 : num_threads;
  auto ctx = Create(o);
  if (!ctx.ok()) {  // the CPU backend is registered above, so this cannot happen
    std::fprintf(stderr, "diond: %s\n", ctx.status().ToString().c_str());
    std::abort();
  }
  return *std::move(ctx);
}

}  // namespace diond::kernels
