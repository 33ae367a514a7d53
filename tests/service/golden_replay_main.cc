// diond-golden-replay: the in-process (C++) replay of one conformance vector, written to a file,
// so that clients in other languages can require their run through the daemon to equal the C++
// in-process result bit for bit (client/rust/tests/conformance.rs does).
//
//   diond-golden-replay fp32|bf16_reference VECTOR.safetensors OUT.safetensors
//
// The session is golden_case.cc's mapping of the vector's metadata (the one the C++ service
// suite uses); the replay is service_harness.h's Replay, i.e. the GroupOptimizer path the daemon
// runs, on all cores. OUT holds F32 tensors "param.<t>" (the parameters after step t, t = 1..T)
// and "state.<name>" (the final optimizer state). Exit status 0 on success, 1 on any error (the
// reason on stderr), 2 on bad usage.
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "kernels/context.h"
#include "tests/service/golden_case.h"
#include "tests/service/service_harness.h"

namespace {

int Run(const std::string& mode, const std::string& in, const std::string& out) {
  namespace optim = diond::optim;
  namespace service_testing = diond::service_testing;
  optim::Precision precision;
  if (mode == "fp32") {
    precision = optim::Precision::kFp32;
  } else if (mode == "bf16_reference") {
    precision = optim::Precision::kBf16Reference;
  } else {
    std::cerr << "unknown mode '" << mode << "' (fp32 or bf16_reference)\n";
    return 2;
  }
  auto c = service_testing::LoadGoldenCase(in);
  if (!c.ok()) {
    std::cerr << in << ": " << c.status() << "\n";
    return 1;
  }
  auto r = service_testing::Replay::Create(c->Session(precision));
  if (!r.ok()) {
    std::cerr << in << ": " << r.status() << "\n";
    return 1;
  }
  for (const auto& [name, v] : c->state_init) {
    if (absl::Status s = (*r)->SetState(0, name, v); !s.ok()) {
      std::cerr << in << ": state " << name << ": " << s << "\n";
      return 1;
    }
  }
  (*r)->params()[0] = c->param_init;
  auto ctx = diond::kernels::Context::CpuDefault();
  diond::SafetensorsWriter w;
  w.SetMetadata("source", c->file);
  w.SetMetadata("precision", mode);
  for (int64_t t = 1; t <= c->steps; ++t) {
    if (absl::Status s = (*r)->Step(*ctx, {c->grads[t - 1]}); !s.ok()) {
      std::cerr << in << ": step " << t << ": " << s << "\n";
      return 1;
    }
    if (absl::Status s = w.AddF32(absl::StrCat("param.", t), c->shape, (*r)->params()[0]);
        !s.ok()) {
      std::cerr << s << "\n";
      return 1;
    }
  }
  for (const std::string& n : (*r)->StateNames(0)) {
    auto v = (*r)->GetState(0, n);
    if (!v.ok()) {
      std::cerr << in << ": state " << n << ": " << v.status() << "\n";
      return 1;
    }
    const std::vector<int64_t> flat = {static_cast<int64_t>(v->size())};
    if (absl::Status s = w.AddF32(absl::StrCat("state.", n), flat, *v); !s.ok()) {
      std::cerr << s << "\n";
      return 1;
    }
  }
  if (absl::Status s = w.WriteFile(out); !s.ok()) {
    std::cerr << out << ": " << s << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: diond-golden-replay fp32|bf16_reference VECTOR.safetensors "
                 "OUT.safetensors\n";
    return 2;
  }
  return Run(argv[1], argv[2], argv[3]);
}
