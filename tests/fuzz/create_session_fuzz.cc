// libFuzzer target: a CreateSessionRequest from arbitrary bytes through the daemon's request
// conversion (server/rpc/convert.cc), the layout computation (server/session/layout.cc) and every
// group's validation (kernels/optim/validation.cc), i.e. everything CreateSession does before it
// allocates. Properties beyond "no crash, no sanitizer report": every error message is bounded
// (it may echo client input), and an accepted layout is aligned, in order and non-overlapping.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "diond/v1/optimizer.pb.h"
#include "kernels/optim/validation.h"
#include "server/rpc/convert.h"
#include "server/session/layout.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::fuzz::Require;

void RequireBounded(const absl::Status& s) {
  Require(s.message().size() < 2048, "error message longer than 2 KiB");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  diond::v1::CreateSessionRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto spec = diond::rpc::SpecFromProto(req);
  if (!spec.ok()) {
    RequireBounded(spec.status());
    return 0;
  }
  auto layout = diond::session::ComputeLayout(spec->params);
  if (!layout.ok()) {
    RequireBounded(layout.status());
    return 0;
  }
  int64_t end = 0;
  for (const diond::session::TensorPlacement& t : layout->tensors) {
    Require(t.param_offset % diond::session::kArenaAlignment == 0, "unaligned offset");
    Require(t.param_offset >= end, "overlapping tensors");
    Require(t.size_bytes == t.numel * static_cast<int64_t>(diond::kernels::DTypeSize(t.dtype)),
            "size_bytes != numel * element size");
    end = t.param_offset + t.size_bytes;
  }
  Require(layout->param_arena_bytes >= end, "arena shorter than its tensors");
  std::map<std::string, std::vector<diond::optim::ParamShape>> shapes;
  for (const diond::session::ParamSpec& p : spec->params) shapes[p.group].push_back(p.shape);
  for (const diond::session::GroupSpec& g : spec->groups) {
    auto it = shapes.find(g.name);
    if (it == shapes.end()) continue;
    RequireBounded(diond::optim::ValidateGroup(g.config, it->second));
  }
  return 0;
}
