// TEST-ONLY: see recording_backend.h.
#include "kernels/testing/recording_backend.h"

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace diond::kernels::testing {
namespace {

struct State {
  std::mutex mu;
  std::vector<std::string> log;
  const OpsBackend* target = nullptr;
};
State& S() {
  static State* s = new State;
  return *s;
}

void Record(const char* name) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().log.emplace_back(name);
}

// One forwarding function per table entry: F<&OpsBackend::gemm>::Call logs "gemm" and calls the
// target's gemm with the same arguments.
template <auto Member>
struct F;
template <typename... A, absl::Status (*OpsBackend::*Member)(const Context&, A...)>
struct F<Member> {
  inline static const char* name = nullptr;
  static absl::Status Call(const Context& ctx, A... args) {
    Record(name);
    const OpsBackend* t = S().target;
    if (t == nullptr) {
      return absl::UnimplementedError(absl::StrCat("test-recording backend: ", name,
                                                   " has no target backend"));
    }
    return (t->*Member)(ctx, args...);
  }
};

template <auto Member>
void Set(OpsBackend& table, const char* name) {
  F<Member>::name = name;
  table.*Member = &F<Member>::Call;
}

void* Allocate(Device, size_t bytes) {
  Record("allocate");
  return std::aligned_alloc(64, ((bytes ? bytes : 1) + 63) & ~size_t{63});
}
void Deallocate(Device, void* p, size_t) {
  Record("deallocate");
  std::free(p);
}

OpsBackend MakeTable() {
  OpsBackend t;
  t.name = "test-recording";
  t.allocate = &Allocate;
  t.deallocate = &Deallocate;
  Set<&OpsBackend::copy_from_host>(t, "copy_from_host");
  Set<&OpsBackend::copy_to_host>(t, "copy_to_host");
  Set<&OpsBackend::gemm>(t, "gemm");
  Set<&OpsBackend::symmetric_product>(t, "symmetric_product");
  Set<&OpsBackend::symmetric_product_bf16>(t, "symmetric_product_bf16");
  Set<&OpsBackend::thin_qr>(t, "thin_qr");
  Set<&OpsBackend::cholesky_qr>(t, "cholesky_qr");
  Set<&OpsBackend::randomized_cholesky_qr>(t, "randomized_cholesky_qr");
  Set<&OpsBackend::frobenius_norm>(t, "frobenius_norm");
  Set<&OpsBackend::axis_norms>(t, "axis_norms");
  Set<&OpsBackend::top_k_by_l1_norm>(t, "top_k_by_l1_norm");
  Set<&OpsBackend::is_all_zero>(t, "is_all_zero");
  Set<&OpsBackend::gather>(t, "gather");
  Set<&OpsBackend::scatter>(t, "scatter");
  Set<&OpsBackend::copy>(t, "copy");
  Set<&OpsBackend::fill>(t, "fill");
  Set<&OpsBackend::axpby>(t, "axpby");
  Set<&OpsBackend::add_scalar>(t, "add_scalar");
  Set<&OpsBackend::unary>(t, "unary");
  Set<&OpsBackend::binary>(t, "binary");
  Set<&OpsBackend::adamw_step>(t, "adamw_step");
  Set<&OpsBackend::lion_step>(t, "lion_step");
  // ortho
  Set<&OpsBackend::add_to_diagonal>(t, "add_to_diagonal");
  Set<&OpsBackend::bf16_rounded_axpby>(t, "bf16_rounded_axpby");
  // kops
  Set<&OpsBackend::adamw_step_tracked>(t, "adamw_step_tracked");
  Set<&OpsBackend::lion_step_tracked>(t, "lion_step_tracked");
  Set<&OpsBackend::momentum_update>(t, "momentum_update");
  Set<&OpsBackend::apply_update>(t, "apply_update");
  Set<&OpsBackend::normalize_neurons>(t, "normalize_neurons");
  Set<&OpsBackend::copy_with_change>(t, "copy_with_change");
  // steps
  Set<&OpsBackend::all_finite>(t, "all_finite");
  Set<&OpsBackend::widen_scale_check_finite>(t, "widen_scale_check_finite");
  Set<&OpsBackend::fnv1a_checksum>(t, "fnv1a_checksum");
  // asynccopy
  Set<&OpsBackend::copy_from_host_async>(t, "copy_from_host_async");
  Set<&OpsBackend::copy_to_host_async>(t, "copy_to_host_async");
  Set<&OpsBackend::synchronize>(t, "synchronize");
  Set<&OpsBackend::all_finite_flag>(t, "all_finite_flag");
  Set<&OpsBackend::widen_scale_check_finite_flag>(t, "widen_scale_check_finite_flag");
  Set<&OpsBackend::decay_scatter_with_change>(t, "decay_scatter_with_change");
  return t;
}

}  // namespace

const OpsBackend& RecordingBackend::Table() {
  static const OpsBackend table = MakeTable();
  return table;
}

absl::Status RecordingBackend::Install(const OpsBackend* target) {
  {
    std::lock_guard<std::mutex> lock(S().mu);
    S().target = target;
    S().log.clear();
  }
  return RegisterOpsBackend(DeviceType::kTest, &Table());
}

void RecordingBackend::Uninstall() {
  UnregisterOpsBackendForTest(DeviceType::kTest);
  std::lock_guard<std::mutex> lock(S().mu);
  S().target = nullptr;
  S().log.clear();
}

std::vector<std::string> RecordingBackend::Log() {
  std::lock_guard<std::mutex> lock(S().mu);
  return S().log;
}

void RecordingBackend::ClearLog() {
  std::lock_guard<std::mutex> lock(S().mu);
  S().log.clear();
}

}  // namespace diond::kernels::testing
