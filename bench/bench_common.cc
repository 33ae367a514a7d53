#include "bench/bench_common.h"

#include <algorithm>
#include <map>
#include <utility>

namespace diond::bench {
namespace {
std::map<std::pair<std::string, int>, double>& Table() {
  static auto* t = new std::map<std::pair<std::string, int>, double>();
  return *t;
}
}  // namespace

void RecordCeiling(const std::string& precision, int threads, double gflops) {
  double& v = Table()[{precision, threads}];
  v = std::max(v, gflops);
}

double Ceiling(const std::string& precision, int threads) {
  auto it = Table().find({precision, threads});
  return it == Table().end() ? 0.0 : it->second;
}

}  // namespace diond::bench
