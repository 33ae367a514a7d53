// libFuzzer target: ComputeLayout (server/session/layout.cc) on arbitrary shapes and dtypes,
// including the int64 extremes a client may send. UBSan reports any signed overflow; the
// properties checked: an accepted layout is aligned, in order, non-overlapping, sized exactly,
// and an error message stays bounded.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "server/session/layout.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using diond::fuzz::Require;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  std::vector<diond::session::ParamSpec> params(in.ConsumeIntegralInRange<size_t>(0, 12));
  for (size_t i = 0; i < params.size(); ++i) {
    diond::session::ParamSpec& p = params[i];
    p.name = in.ConsumeRandomLengthString(16);
    p.shape.resize(in.ConsumeIntegralInRange<size_t>(0, 10));
    for (int64_t& d : p.shape) {
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0:
          d = in.ConsumeIntegralInRange<int64_t>(-2, 64);
          break;
        case 1:
          d = in.ConsumeIntegral<int64_t>();
          break;
        case 2:
          d = int64_t{1} << in.ConsumeIntegralInRange<int>(0, 62);
          break;
        default:
          d = std::numeric_limits<int64_t>::max() - in.ConsumeIntegralInRange<int64_t>(0, 4);
      }
    }
    p.dtype = static_cast<diond::kernels::DType>(in.ConsumeIntegralInRange<int>(0, 2));
  }
  auto layout = diond::session::ComputeLayout(params);
  if (!layout.ok()) {
    Require(layout.status().message().size() < 2048, "error message longer than 2 KiB");
    return 0;
  }
  Require(layout->tensors.size() == params.size(), "a tensor is missing");
  int64_t end = 0;
  for (const diond::session::TensorPlacement& t : layout->tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      Require(d > 0, "accepted a non-positive dimension");
      numel *= d;  // UBSan: an accepted shape's element count fits int64
    }
    Require(numel == t.numel, "numel differs from the shape's product");
    Require(t.param_offset % diond::session::kArenaAlignment == 0, "unaligned offset");
    Require(t.param_offset >= end && t.grad_offset == t.param_offset, "overlapping tensors");
    end = t.param_offset + t.size_bytes;
  }
  Require(layout->param_arena_bytes >= end && layout->grad_arena_bytes >= end, "short arena");
  return 0;
}
