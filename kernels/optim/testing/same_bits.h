// Test helpers shared by the kernels/optim tests that compare two runs of the same update bit for
// bit (device_step_test: a device context vs the CPU; step_graph_test: a replayed graph vs the
// eager step). Header-only; for gtest binaries.
#ifndef DIOND_KERNELS_OPTIM_TESTING_SAME_BITS_H_
#define DIOND_KERNELS_OPTIM_TESTING_SAME_BITS_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim::testing {

inline int64_t Numel(const ParamShape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Bitwise equality of two float vectors (NaN patterns included), naming the first mismatch with
// the two sides' names.
inline ::testing::AssertionResult SameBits(const std::vector<float>& got,
                                           const std::vector<float>& want,
                                           const char* got_name = "got",
                                           const char* want_name = "want") {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "element " << i << ": " << got_name << " " << got[i]
                                           << ", " << want_name << " " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace diond::optim::testing

#endif  // DIOND_KERNELS_OPTIM_TESTING_SAME_BITS_H_
