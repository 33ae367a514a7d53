// Test-only, straightforward double-precision re-implementation of the single-device update
// rules of ALGORITHMS.md §20, written from the spec independently of the production code (no
// ops API, no shared helpers). Used as the independent expectation of the option tests and to
// generate conformance vector files. Slow (naive loops); for small matrices only.
#ifndef DIOND_KERNELS_OPTIM_TESTING_REFERENCE_H_
#define DIOND_KERNELS_OPTIM_TESTING_REFERENCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace diond::optim::testing {

struct Mat {
  int64_t r = 0, c = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(int64_t rows, int64_t cols) : r(rows), c(cols), v(static_cast<size_t>(rows * cols), 0.0) {}
  double& at(int64_t i, int64_t j) { return v[static_cast<size_t>(i * c + j)]; }
  double at(int64_t i, int64_t j) const { return v[static_cast<size_t>(i * c + j)]; }
};

Mat MatMul(const Mat& a, const Mat& b);
Mat Transpose(const Mat& a);
double Fro(const Mat& a);

// Polar Express (§3.3) and NS5 (§3.1) in double.
Mat PolarExpress(const Mat& g, double eps);
Mat NewtonSchulz5(const Mat& g, double eps);

struct RefOptions {
  double lr = 0.02, wd = 0.01, eps = 1e-8, mu = 0.95, muon_beta2 = 0.95;
  double fraction = 0.25, ef_decay = 0.95;
  double rank_fraction = 1.0;
  int64_t rank_multiple_of = 1;
  double beta1 = 0.9, beta2 = 0.95;
  bool nesterov = false, cautious = false, ns5 = false;
  int adjust = 0;                   // 0 spectral, 1 rms, 2 none
  std::vector<int64_t> row_blocks;  // heads or split_sizes as row blocks (empty: one block)
  bool split = false;               // row_blocks are split_sizes (α of the full shape × c_i)
};

double Adjust(int mode, double fan_out, double fan_in);

// One step of each rule on one m×n matrix; X, M (and V, Q) updated in place.
void RefMuonStep(const RefOptions& o, bool normuon, Mat& x, Mat& m, std::vector<double>& v,
                 const Mat& g);
void RefDion2Step(const RefOptions& o, bool nordion, Mat& x, Mat& m, std::vector<double>& v,
                  const Mat& g);
void RefDionStep(const RefOptions& o, Mat& x, Mat& m, Mat& q, const Mat& g);
void RefAdamWStep(const RefOptions& o, int64_t t, Mat& x, Mat& m, Mat& v, const Mat& g);
void RefLionStep(const RefOptions& o, Mat& x, Mat& m, const Mat& g);

}  // namespace diond::optim::testing

#endif  // DIOND_KERNELS_OPTIM_TESTING_REFERENCE_H_
