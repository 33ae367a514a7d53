#include "kernels/host_blas.h"

#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace diond::kernels {
namespace {

constexpr char kCoreVar[] = "OPENBLAS_CORETYPE";
constexpr char kCoreMarker[] = "DIOND_OPENBLAS_CORE_SET";
constexpr char kTestCoreVar[] = "DIOND_TEST_OPENBLAS_CORENAME";

bool Bit(unsigned v, int b) { return (v >> b) & 1u; }

bool SameCore(const std::string& a, const std::string& b) {
  return !a.empty() && strcasecmp(a.c_str(), b.c_str()) == 0;
}

const char* VendorName(CpuFacts::Vendor v) {
  switch (v) {
    case CpuFacts::Vendor::kIntel:
      return "GenuineIntel";
    case CpuFacts::Vendor::kAmd:
      return "AuthenticAMD";
    case CpuFacts::Vendor::kOther:
      break;
  }
  return "other vendor";
}

}  // namespace

CpuFacts ReadCpuFacts() {
  CpuFacts f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {0};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  if (std::strcmp(vendor, "GenuineIntel") == 0) f.vendor = CpuFacts::Vendor::kIntel;
  // Hygon's Dhyana is a Zen core; OpenBLAS treats it as AMD.
  if (std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0) {
    f.vendor = CpuFacts::Vendor::kAmd;
  }
  __get_cpuid(1, &a, &b, &c, &d);
  const int base_family = static_cast<int>((a >> 8) & 0xf);
  const int base_model = static_cast<int>((a >> 4) & 0xf);
  f.family = base_family == 0xf ? base_family + static_cast<int>((a >> 20) & 0xff) : base_family;
  f.model = (base_family == 0x6 || base_family == 0xf)
                ? (static_cast<int>((a >> 16) & 0xf) << 4) | base_model
                : base_model;
  const bool osxsave = Bit(c, 27), avx = Bit(c, 28), fma = Bit(c, 12);
  unsigned xcr0 = 0;
  if (osxsave) {
    unsigned hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(hi) : "c"(0));
  }
  const bool ymm_state = (xcr0 & 0x6u) == 0x6u;
  const bool zmm_state = ymm_state && (xcr0 & 0xe0u) == 0xe0u;
  const bool tile_state = (xcr0 & 0x60000u) == 0x60000u;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = avx && ymm_state && Bit(b, 5);
    f.fma = fma && ymm_state;
    f.avx512_core = zmm_state && Bit(b, 16) && Bit(b, 17) && Bit(b, 28) && Bit(b, 30) && Bit(b, 31);
    f.amx = tile_state && Bit(d, 24);
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    f.avx512_bf16 = f.avx512_core && Bit(a1, 5);
  }
#endif
  return f;
}

std::string DescribeCpu(const CpuFacts& cpu) {
  std::string s =
      absl::StrCat(VendorName(cpu.vendor), " family ", cpu.family, " model ", cpu.model, ":");
  if (cpu.avx2) absl::StrAppend(&s, " avx2");
  if (cpu.fma) absl::StrAppend(&s, " fma");
  if (cpu.avx512_core) absl::StrAppend(&s, " avx512");
  if (cpu.avx512_bf16) absl::StrAppend(&s, " avx512_bf16");
  if (cpu.amx) absl::StrAppend(&s, " amx");
  if (!cpu.avx2 && !cpu.avx512_core) absl::StrAppend(&s, " no avx2");
  return s;
}

std::string LoadedOpenBlasCore() {
  const char* name = openblas_get_corename();
  return name != nullptr ? std::string(name) : std::string("Unknown");
}

std::string CoreForFeatures(const CpuFacts& cpu) {
  if (cpu.avx512_core) return cpu.avx512_bf16 ? "Cooperlake" : "SkylakeX";
  if (cpu.avx2 && cpu.fma) return cpu.vendor == CpuFacts::Vendor::kAmd ? "Zen" : "Haswell";
  return "";
}

bool IsGenericOpenBlasCore(const std::string& core) {
  // The x86-64 cores with AVX2 kernels in 0.3.21, and the AVX-512 ones; newer releases add
  // SapphireRapids. Anything else (SSE or AVX1 kernels, "Unknown") is generic here.
  for (const char* fast : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (SameCore(core, fast)) return false;
  }
  return true;
}

OpenBlasCoreDecision DecideOpenBlasCore(const CpuFacts& cpu, const std::string& loaded_core,
                                        const char* operator_value) {
  OpenBlasCoreDecision d;
  d.autodetected = loaded_core;
  if (operator_value != nullptr) {
    d.reason = absl::StrCat(kCoreVar, "=", operator_value, " is the operator's; kept");
    return d;
  }
  const std::string want = CoreForFeatures(cpu);
  if (!IsGenericOpenBlasCore(loaded_core)) {
    d.reason = "OpenBLAS autodetected a core with AVX2 or AVX-512 kernels";
    return d;
  }
  if (want.empty()) {
    d.reason = "the CPU has neither AVX2 + FMA nor AVX-512, so the generic kernels are right";
    return d;
  }
  d.set = want;
  d.reason =
      absl::StrCat("OpenBLAS autodetected ", loaded_core, ", a generic core, on a CPU with ",
                   cpu.avx512_core ? "AVX-512" : "AVX2 + FMA", " (it does not know this model)");
  return d;
}

OpenBlasCoreDecision PlanOpenBlasCore() {
  const char* simulated = std::getenv(kTestCoreVar);
  const std::string loaded =
      simulated != nullptr && *simulated != '\0' ? std::string(simulated) : LoadedOpenBlasCore();
  return DecideOpenBlasCore(ReadCpuFacts(), loaded, std::getenv(kCoreVar));
}

void ApplyOpenBlasCoreDecision(const OpenBlasCoreDecision& decision) {
  if (decision.set.empty()) return;
  setenv(kCoreVar, decision.set.c_str(), 1);
  setenv(kCoreMarker, decision.autodetected.empty() ? "Unknown" : decision.autodetected.c_str(), 1);
}

void RevertOpenBlasCoreDecision() {
  if (std::getenv(kCoreMarker) == nullptr) return;
  unsetenv(kCoreVar);
  unsetenv(kCoreMarker);
}

OpenBlasCoreReport ReportOpenBlasCore() {
  OpenBlasCoreReport r;
  const CpuFacts cpu = ReadCpuFacts();
  r.core = LoadedOpenBlasCore();
  const char* marker = std::getenv(kCoreMarker);
  const char* value = std::getenv(kCoreVar);
  const std::string cpu_text = DescribeCpu(cpu);
  const bool generic_on_fast_cpu = IsGenericOpenBlasCore(r.core) && !CoreForFeatures(cpu).empty();
  if (marker != nullptr) {
    const std::string autodetected = marker;
    unsetenv(kCoreMarker);
    r.source = "diond";
    const std::string wanted = value != nullptr ? value : "";
    r.ok = SameCore(r.core, wanted);
    r.line = absl::StrCat("OpenBLAS core ", r.core, " (set by diond: OpenBLAS autodetected ",
                          autodetected, ", a generic core, on ", cpu_text, "; ", kCoreVar, "=",
                          wanted, ")");
    if (!r.ok) {
      absl::StrAppend(&r.line, "; WARNING: ", wanted, " did not load, OpenBLAS runs ", r.core,
                      ": set ", kCoreVar, " to a core this OpenBLAS knows");
    }
    return r;
  }
  r.source = value != nullptr ? "operator" : "autodetected";
  r.ok = !generic_on_fast_cpu;
  r.line = absl::StrCat("OpenBLAS core ", r.core, " (",
                        value != nullptr ? absl::StrCat(kCoreVar, "=", value, ", the operator's")
                                         : std::string("autodetected"),
                        "; CPU ", cpu_text, ")");
  if (!r.ok) {
    absl::StrAppend(&r.line, "; WARNING: generic kernels on a CPU with ",
                    cpu.avx512_core ? "AVX-512" : "AVX2",
                    ", GEMMs and LAPACK run several times "
                    "slower; ",
                    CoreForFeatures(cpu), " is the core for this CPU");
  }
  return r;
}

void ExecSelf(char** argv) {
  // The binary's real path keeps the process's name (ps, pgrep); /proc/self/exe as fallback.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);
  }
  execv("/proc/self/exe", argv);
}

OpenBlasCoreReport ReexecWithOpenBlasCore(char** argv) {
  if (std::getenv(kCoreMarker) == nullptr) {
    const OpenBlasCoreDecision d = PlanOpenBlasCore();
    if (!d.set.empty()) {
      ApplyOpenBlasCoreDecision(d);
      ExecSelf(argv);
      std::fprintf(stderr, "warning: could not re-execute with %s=%s (%s)\n", kCoreVar,
                   d.set.c_str(), std::strerror(errno));
      RevertOpenBlasCoreDecision();
    }
  }
  return ReportOpenBlasCore();
}

}  // namespace diond::kernels
