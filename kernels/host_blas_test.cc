#include "kernels/host_blas.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace diond::kernels {
namespace {

CpuFacts Cpu(CpuFacts::Vendor vendor, int family, int model, bool avx2, bool avx512, bool bf16) {
  CpuFacts f;
  f.vendor = vendor;
  f.family = family;
  f.model = model;
  f.avx2 = f.fma = avx2;
  f.avx512_core = avx512;
  f.avx512_bf16 = bf16;
  return f;
}

const CpuFacts kEmeraldRapids = Cpu(CpuFacts::Vendor::kIntel, 6, 207, true, true, true);
const CpuFacts kSkylakeServer = Cpu(CpuFacts::Vendor::kIntel, 6, 85, true, true, false);
const CpuFacts kZen3 = Cpu(CpuFacts::Vendor::kAmd, 25, 1, true, false, false);
const CpuFacts kZen4 = Cpu(CpuFacts::Vendor::kAmd, 25, 17, true, true, true);
const CpuFacts kHaswell = Cpu(CpuFacts::Vendor::kIntel, 6, 63, true, false, false);
const CpuFacts kOld = Cpu(CpuFacts::Vendor::kIntel, 6, 26, false, false, false);

struct Row {
  const char* name;
  CpuFacts cpu;
  const char* loaded;
  const char* operator_value;  // nullptr: unset
  const char* want;            // the value to set; "" = none
};

TEST(DecideOpenBlasCore, Table) {
  const Row rows[] = {
      // The machine of the report: 0.3.21 does not know model 207 and falls back to Prescott.
      {"emerald rapids, prescott", kEmeraldRapids, "Prescott", nullptr, "Cooperlake"},
      {"emerald rapids, case differs", kEmeraldRapids, "PRESCOTT", nullptr, "Cooperlake"},
      {"emerald rapids, unknown core", kEmeraldRapids, "Unknown", nullptr, "Cooperlake"},
      {"emerald rapids, operator haswell", kEmeraldRapids, "Haswell", "Haswell", ""},
      // An operator's value is kept even when it is what made OpenBLAS fall back.
      {"emerald rapids, operator prescott", kEmeraldRapids, "Prescott", "Prescott", ""},
      {"emerald rapids, operator empty", kEmeraldRapids, "Prescott", "", ""},
      {"emerald rapids, operator bogus", kEmeraldRapids, "Prescott", "NoSuchCore", ""},
      {"skylake-sp, nehalem", kSkylakeServer, "Nehalem", nullptr, "SkylakeX"},
      {"skylake-sp, sandybridge", kSkylakeServer, "Sandybridge", nullptr, "SkylakeX"},
      // OpenBLAS's own choice of AVX2 kernels on an AVX-512 CPU (e.g. no OS support it saw) is
      // not a fallback to the generic kernels: kept.
      {"skylake-sp, haswell", kSkylakeServer, "Haswell", nullptr, ""},
      {"skylake-sp, skylakex", kSkylakeServer, "SkylakeX", nullptr, ""},
      {"zen 3, zen", kZen3, "Zen", nullptr, ""},
      {"zen 3, prescott", kZen3, "Prescott", nullptr, "Zen"},
      {"zen 3, barcelona", kZen3, "Barcelona", nullptr, "Zen"},
      {"zen 4, cooperlake", kZen4, "Cooperlake", nullptr, ""},
      {"zen 4, prescott", kZen4, "Prescott", nullptr, "Cooperlake"},
      {"haswell, prescott", kHaswell, "Prescott", nullptr, "Haswell"},
      {"haswell, haswell", kHaswell, "Haswell", nullptr, ""},
      // No AVX2: the generic kernels are the right ones.
      {"nehalem cpu, nehalem", kOld, "Nehalem", nullptr, ""},
      {"nehalem cpu, prescott", kOld, "Prescott", nullptr, ""},
  };
  for (const Row& r : rows) {
    const OpenBlasCoreDecision d = DecideOpenBlasCore(r.cpu, r.loaded, r.operator_value);
    EXPECT_EQ(d.set, r.want) << r.name << ": " << d.reason;
    EXPECT_EQ(d.autodetected, r.loaded) << r.name;
    EXPECT_FALSE(d.reason.empty()) << r.name;
    if (r.operator_value != nullptr) {
      EXPECT_NE(d.reason.find(std::string("OPENBLAS_CORETYPE=") + r.operator_value),
                std::string::npos)
          << r.name << ": " << d.reason;
    }
  }
}

TEST(DecideOpenBlasCore, GenericCores) {
  for (const char* generic : {"Prescott", "Nehalem", "Core2", "Sandybridge", "Barcelona",
                              "Bulldozer", "Excavator", "Atom", "Unknown", ""}) {
    EXPECT_TRUE(IsGenericOpenBlasCore(generic)) << generic;
  }
  for (const char* fast :
       {"Haswell", "haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"}) {
    EXPECT_FALSE(IsGenericOpenBlasCore(fast)) << fast;
  }
}

TEST(DecideOpenBlasCore, CoreForFeatures) {
  EXPECT_EQ(CoreForFeatures(kEmeraldRapids), "Cooperlake");
  EXPECT_EQ(CoreForFeatures(kSkylakeServer), "SkylakeX");
  EXPECT_EQ(CoreForFeatures(kZen3), "Zen");
  EXPECT_EQ(CoreForFeatures(kHaswell), "Haswell");
  EXPECT_EQ(CoreForFeatures(kOld), "");
  CpuFacts avx2_no_fma = kHaswell;
  avx2_no_fma.fma = false;
  EXPECT_EQ(CoreForFeatures(avx2_no_fma), "");
}

TEST(ReadCpuFacts, AgreesWithTheCompiler) {
  const CpuFacts f = ReadCpuFacts();
#if defined(__x86_64__)
  EXPECT_EQ(f.avx2, __builtin_cpu_supports("avx2") != 0);
  EXPECT_EQ(f.fma, __builtin_cpu_supports("fma") != 0);
  EXPECT_EQ(f.avx512_core,
            __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512cd"));
  EXPECT_GT(f.family, 0);
#endif
  EXPECT_FALSE(DescribeCpu(f).empty());
}

// The core the decision would set on this CPU, and the fallbacks, load when OPENBLAS_CORETYPE
// names them: each in a fresh process (OpenBLAS reads the variable when it is loaded), which
// a threadsafe death test is (it re-executes this binary).
TEST(OpenBlasCoreLoads, EveryCoreTheDaemonMaySetHere) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CpuFacts cpu = ReadCpuFacts();
  std::vector<std::string> cores = {"Prescott"};
  if (!CoreForFeatures(cpu).empty()) cores.push_back(CoreForFeatures(cpu));
  if (cpu.avx2 && cpu.fma) cores.push_back("Haswell");
  for (const std::string& core : cores) {
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    EXPECT_EXIT(
        {
          const std::string loaded = LoadedOpenBlasCore();
          if (loaded != core) {
            std::fprintf(stderr, "loaded %s\n", loaded.c_str());
            std::exit(1);
          }
          std::exit(0);
        },
        ::testing::ExitedWithCode(0), "")
        << core;
    unsetenv("OPENBLAS_CORETYPE");
  }
}

// ReportOpenBlasCore after a (simulated) re-execution: the marker says diond set the value.
TEST(ReportOpenBlasCore, SaysWhoChose) {
  const std::string loaded = LoadedOpenBlasCore();
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv("DIOND_OPENBLAS_CORE_SET");
  OpenBlasCoreReport r = ReportOpenBlasCore();
  EXPECT_EQ(r.core, loaded);
  EXPECT_EQ(r.source, "autodetected");
  EXPECT_NE(r.line.find("OpenBLAS core " + loaded + " (autodetected"), std::string::npos) << r.line;

  OpenBlasCoreDecision d;
  d.set = loaded;  // what this process already runs, so the "loaded" check holds
  d.autodetected = "Prescott";
  ApplyOpenBlasCoreDecision(d);
  EXPECT_STREQ(std::getenv("OPENBLAS_CORETYPE"), loaded.c_str());
  r = ReportOpenBlasCore();
  EXPECT_EQ(r.source, "diond");
  EXPECT_TRUE(r.ok) << r.line;
  EXPECT_NE(r.line.find("set by diond: OpenBLAS autodetected Prescott"), std::string::npos)
      << r.line;
  EXPECT_EQ(std::getenv("DIOND_OPENBLAS_CORE_SET"), nullptr);  // consumed

  // A value diond set that did not load is reported, not hidden.
  d.set = "NoSuchCore";
  ApplyOpenBlasCoreDecision(d);
  r = ReportOpenBlasCore();
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.line.find("WARNING: NoSuchCore did not load"), std::string::npos) << r.line;

  // The operator's value.
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  r = ReportOpenBlasCore();
  EXPECT_EQ(r.source, "operator");
  EXPECT_NE(r.line.find("OPENBLAS_CORETYPE=Haswell, the operator's"), std::string::npos) << r.line;
  unsetenv("OPENBLAS_CORETYPE");
}

TEST(PlanOpenBlasCore, SimulatedFallbackOnThisCpu) {
  const CpuFacts cpu = ReadCpuFacts();
  unsetenv("OPENBLAS_CORETYPE");
  setenv("DIOND_TEST_OPENBLAS_CORENAME", "Prescott", 1);
  OpenBlasCoreDecision d = PlanOpenBlasCore();
  EXPECT_EQ(d.autodetected, "Prescott");
  EXPECT_EQ(d.set, CoreForFeatures(cpu)) << d.reason;
  // The operator's value wins over the simulation too.
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  d = PlanOpenBlasCore();
  EXPECT_EQ(d.set, "");
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv("DIOND_TEST_OPENBLAS_CORENAME");
}

}  // namespace
}  // namespace diond::kernels
