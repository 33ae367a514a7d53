// Which OpenBLAS kernel set ("core") this process runs, and the one it should run.
//
// Debian's OpenBLAS (a DYNAMIC_ARCH build) picks its core from the CPU's vendor, family and
// model when it is loaded. A model it does not know (e.g. Intel family 6 model 207, Emerald
// Rapids, with 0.3.21) gets the generic `Prescott` SSE3 kernels, 5-6x slower than the AVX-512
// ones, with no error. OpenBLAS documents one way to choose: OPENBLAS_CORETYPE in the
// environment before the library initialises (at load time, so a process must re-execute
// itself). This header holds the decision and the report; the re-execution is the caller's
// (server/exe/main.cc for the daemon, ReexecWithOpenBlasCore for the tools).
#ifndef DIOND_KERNELS_HOST_BLAS_H_
#define DIOND_KERNELS_HOST_BLAS_H_

#include <string>

namespace diond::kernels {

// What CPUID and XGETBV say. An ISA flag is true only when the OS also saves its register
// state (XCR0), as OpenBLAS's own support_avx2()/support_avx512() require.
struct CpuFacts {
  enum class Vendor { kIntel, kAmd, kOther };
  Vendor vendor = Vendor::kOther;
  int family = 0;  // display family (base + extended)
  int model = 0;   // display model (extended << 4 | base)
  bool avx2 = false;
  bool fma = false;
  // AVX-512 F, BW, VL, DQ and CD together: what OpenBLAS's SkylakeX kernels use.
  bool avx512_core = false;
  bool avx512_bf16 = false;
  bool amx = false;  // AMX-TILE with the OS's tile state (reported only: no 0.3.21 core uses it)
};

// This CPU's facts (all false on a non-x86 build).
CpuFacts ReadCpuFacts();
// "GenuineIntel family 6 model 207: avx2 fma avx512 avx512_bf16" (for logs).
std::string DescribeCpu(const CpuFacts& cpu);

// The core the loaded OpenBLAS runs (openblas_get_corename()), e.g. "Zen", "SkylakeX".
std::string LoadedOpenBlasCore();

// The core the CPU's features call for among those Debian's OpenBLAS 0.3.21 knows: AVX-512
// core with avx512_bf16 "Cooperlake", without "SkylakeX"; AVX2 + FMA "Zen" on AMD, "Haswell"
// elsewhere; "" when the CPU has neither (the generic kernels are then the right ones).
std::string CoreForFeatures(const CpuFacts& cpu);

// True for OpenBLAS's cores without AVX2 kernels (Prescott, Nehalem, Sandybridge, ...,
// "Unknown"), compared case-insensitively as OpenBLAS compares OPENBLAS_CORETYPE.
bool IsGenericOpenBlasCore(const std::string& core);

struct OpenBlasCoreDecision {
  std::string set;           // the OPENBLAS_CORETYPE value to set before re-executing; "" = none
  std::string autodetected;  // the core OpenBLAS chose on its own
  std::string reason;        // why (for the log)
};

// The rule: when the operator has not set OPENBLAS_CORETYPE (operator_value null) and OpenBLAS
// autodetected a generic core on a CPU with AVX2 + FMA (or AVX-512), set CoreForFeatures(cpu).
// An operator's value (even an empty or unknown one) is never replaced.
OpenBlasCoreDecision DecideOpenBlasCore(const CpuFacts& cpu, const std::string& loaded_core,
                                        const char* operator_value);

// The decision for this process: ReadCpuFacts, LoadedOpenBlasCore and getenv
// ("OPENBLAS_CORETYPE"). DIOND_TEST_OPENBLAS_CORENAME (tests only) stands in for the
// autodetected core, so a test can make any CPU look like one OpenBLAS does not know.
OpenBlasCoreDecision PlanOpenBlasCore();

// Sets OPENBLAS_CORETYPE=decision.set and the marker DIOND_OPENBLAS_CORE_SET (the autodetected
// core) for the re-executed process; the caller then re-executes. No-op when set is empty.
void ApplyOpenBlasCoreDecision(const OpenBlasCoreDecision& decision);
// Undoes ApplyOpenBlasCoreDecision (the re-execution failed).
void RevertOpenBlasCoreDecision();

// The state after start-up, for the log and diond_build_info.
struct OpenBlasCoreReport {
  std::string core;    // LoadedOpenBlasCore()
  std::string source;  // "autodetected", "operator" (OPENBLAS_CORETYPE was set) or "diond"
  bool ok = true;      // false: the core runs generic kernels on an AVX2 CPU, or a value set
                       // by diond did not load
  std::string line;    // "OpenBLAS core Zen (autodetected; CPU AuthenticAMD family 25 ...)"
};
// Reads (and removes from the environment) the marker of ApplyOpenBlasCoreDecision, so call it
// once, after the re-execution.
OpenBlasCoreReport ReportOpenBlasCore();

// For tools without their own re-execution (diond_bench, diond-conformance): applies
// PlanOpenBlasCore and re-executes the binary with the same argv (marker
// DIOND_OPENBLAS_CORE_SET), so it returns only when nothing was to be set, after the re-exec,
// or when execv failed. Returns ReportOpenBlasCore of the final process.
OpenBlasCoreReport ReexecWithOpenBlasCore(char** argv);

// Re-executes this binary with argv: its real path, so that ps and pgrep keep its name (the
// kernel names a process after the file it executes), else /proc/self/exe. Returns only if both
// execv calls failed (errno says why).
void ExecSelf(char** argv);

}  // namespace diond::kernels

#endif  // DIOND_KERNELS_HOST_BLAS_H_
