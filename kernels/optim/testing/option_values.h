// Test helper shared by the tests that walk the option table (kernels/optim/options.def) and
// need a value of each row that differs from the default: the checkpoint codec's and the
// DescribeOptions schema's round trips. Header-only.
#ifndef DIOND_KERNELS_OPTIM_TESTING_OPTION_VALUES_H_
#define DIOND_KERNELS_OPTIM_TESTING_OPTION_VALUES_H_

#include <algorithm>
#include <cstdint>

#include "kernels/optim/option_table.h"

namespace diond::optim::testing {

// A value of `row` other than its default (Muon's, which every algorithm shares for the rows
// that apply to it), inside its range.
inline OptionValue NonDefault(const OptionRow& row) {
  OptionValue v = row.Default(AlgorithmKind::kMuon);
  switch (row.type) {
    case OptionType::kDouble: {
      const double inside = (row.range.lo + std::min(row.range.hi, row.range.lo + 1)) / 2;
      v.number = row.range.lo_open || v.number == row.range.lo ? inside : row.range.lo;
      break;
    }
    case OptionType::kInt:
      v.integer += 1;
      break;
    case OptionType::kBool:
      v.integer = 1 - v.integer;
      break;
    case OptionType::kEnum:
      v.integer = (v.integer + 1) % static_cast<int64_t>(row.enum_names.size());
      break;
  }
  return v;
}

}  // namespace diond::optim::testing

#endif  // DIOND_KERNELS_OPTIM_TESTING_OPTION_VALUES_H_
