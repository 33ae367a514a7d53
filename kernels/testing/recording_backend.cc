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
      return absl::UnimplementedError(
          absl::StrCat("test-recording backend: ", name, " has no target backend"));
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
#define DIOND_OP(name, Name, kind, cpp_params, c_params) Set<&OpsBackend::name>(t, #name);
#define DIOND_HOST_OP(name, Name, kind, cpp_params, c_entry) Set<&OpsBackend::name>(t, #name);
#include "kernels/ops.def"
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
