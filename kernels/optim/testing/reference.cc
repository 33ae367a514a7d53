#include "kernels/optim/testing/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace diond::optim::testing {

Mat MatMul(const Mat& a, const Mat& b) {
  Mat c(a.r, b.c);
  for (int64_t i = 0; i < a.r; ++i)
    for (int64_t k = 0; k < a.c; ++k) {
      const double aik = a.at(i, k);
      for (int64_t j = 0; j < b.c; ++j) c.at(i, j) += aik * b.at(k, j);
    }
  return c;
}

Mat Transpose(const Mat& a) {
  Mat t(a.c, a.r);
  for (int64_t i = 0; i < a.r; ++i)
    for (int64_t j = 0; j < a.c; ++j) t.at(j, i) = a.at(i, j);
  return t;
}

double Fro(const Mat& a) {
  double s = 0;
  for (double x : a.v) s += x * x;
  return std::sqrt(s);
}

namespace {

struct Abc {
  double a, b, c;
};
// ALGORITHMS.md §3.3.
const Abc kPe[5] = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
// ALGORITHMS.md §3.1.
const Abc kNs5[5] = {{4.0848, -6.8946, 2.9270},
                     {3.9505, -6.3029, 2.6377},
                     {3.7418, -5.5913, 2.3037},
                     {2.8769, -3.1427, 1.2046},
                     {2.8366, -3.0525, 1.2012}};

// Y ← a·Y + (b·A + c·A²)·Y with A = Y·Yᵀ (wide).
Mat WideIterations(Mat y, const Abc* co) {
  for (int i = 0; i < 5; ++i) {
    Mat a = MatMul(y, Transpose(y));
    Mat aa = MatMul(a, a);
    Mat b(a.r, a.c);
    for (size_t e = 0; e < b.v.size(); ++e) b.v[e] = co[i].b * a.v[e] + co[i].c * aa.v[e];
    Mat by = MatMul(b, y);
    for (size_t e = 0; e < y.v.size(); ++e) y.v[e] = co[i].a * y.v[e] + by.v[e];
  }
  return y;
}

Mat Scaled(const Mat& g, double s) {
  Mat y = g;
  for (double& e : y.v) e *= s;
  return y;
}

Mat Block(const Mat& a, int64_t r0, int64_t rows) {
  Mat b(rows, a.c);
  std::copy_n(a.v.begin() + r0 * a.c, rows * a.c, b.v.begin());
  return b;
}

// Thin QR by modified Gram-Schmidt twice (positive diagonal of R).
Mat ThinQ(const Mat& p) {
  Mat q = p;
  for (int64_t j = 0; j < q.c; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t k = 0; k < j; ++k) {
        double d = 0;
        for (int64_t i = 0; i < q.r; ++i) d += q.at(i, k) * q.at(i, j);
        for (int64_t i = 0; i < q.r; ++i) q.at(i, j) -= d * q.at(i, k);
      }
    }
    double n = 0;
    for (int64_t i = 0; i < q.r; ++i) n += q.at(i, j) * q.at(i, j);
    n = std::sqrt(n);
    for (int64_t i = 0; i < q.r; ++i) q.at(i, j) = n > 0 ? q.at(i, j) / n : 0;
  }
  return q;
}

Mat Orth(const RefOptions& o, const Mat& u) {
  return o.ns5 ? NewtonSchulz5(u, o.eps) : PolarExpress(u, o.eps);
}

void Decay(const RefOptions& o, Mat& x, const Mat* dir) {
  for (size_t e = 0; e < x.v.size(); ++e) {
    if (o.cautious && dir != nullptr) {
      if (x.v[e] * dir->v[e] >= 0) x.v[e] -= o.lr * o.wd * x.v[e];
    } else {
      x.v[e] *= 1 - o.lr * o.wd;
    }
  }
}

// NorMuon core on one block (rows of `d`), V values for those rows.
void Normalize(const RefOptions& o, Mat& d, double* v) {
  const double f = Fro(d);
  const double w = 1 - o.muon_beta2;
  for (int64_t i = 0; i < d.r; ++i) {
    double s = 0;
    for (int64_t j = 0; j < d.c; ++j) s += d.at(i, j) * d.at(i, j);
    v[i] = v[i] + w * (s / d.c - v[i]);
  }
  for (int64_t i = 0; i < d.r; ++i)
    for (int64_t j = 0; j < d.c; ++j) d.at(i, j) /= std::sqrt(v[i]) + 1e-8;
  const double s = f / std::max(Fro(d), 1e-8);
  for (double& e : d.v) e *= s;
}

}  // namespace

Mat PolarExpress(const Mat& g, double eps) {
  const bool tall = g.r > g.c;
  Mat y = Scaled(g, 1.0 / (1.02 * Fro(g) + eps));
  // The tall form a·Y + Y·(b·A + c·A²), A = YᵀY, equals the wide form on Yᵀ, transposed.
  return tall ? Transpose(WideIterations(Transpose(y), kPe)) : WideIterations(y, kPe);
}

Mat NewtonSchulz5(const Mat& g, double eps) {
  const bool tall = g.r > g.c;
  Mat y = Scaled(g, 1.0 / (Fro(g) + eps));
  return tall ? Transpose(WideIterations(Transpose(y), kNs5)) : WideIterations(y, kNs5);
}

double Adjust(int mode, double fan_out, double fan_in) {
  if (mode == 0) return std::sqrt(fan_out / fan_in);
  if (mode == 1) return 0.2 * std::sqrt(std::max(fan_out, fan_in));
  return 1.0;
}

void RefMuonStep(const RefOptions& o, bool normuon, Mat& x, Mat& m, std::vector<double>& v,
                 const Mat& g) {
  Mat u(m.r, m.c);
  for (size_t e = 0; e < m.v.size(); ++e) {
    m.v[e] = o.mu * m.v[e] + g.v[e];
    u.v[e] = o.nesterov ? o.mu * m.v[e] + g.v[e] : m.v[e];
  }
  std::vector<int64_t> blocks = o.row_blocks.empty() ? std::vector<int64_t>{m.r} : o.row_blocks;
  Mat upd(m.r, m.c);  // α_b·D_b per block
  Mat dir(m.r, m.c);  // D (for the cautious mask)
  int64_t r0 = 0;
  for (int64_t s : blocks) {
    Mat d = Orth(o, Block(u, r0, s));
    if (normuon) Normalize(o, d, v.data() + r0);
    // heads: α of the head shape; split: α(m, n)·c_i = α(s_i, n) exactly (§3.8).
    const double alpha =
        o.lr * Adjust(o.adjust, static_cast<double>(o.row_blocks.empty() ? m.r : s),
                      static_cast<double>(m.c));
    for (int64_t e = 0; e < s * m.c; ++e) {
      upd.v[r0 * m.c + e] = alpha * d.v[e];
      dir.v[r0 * m.c + e] = d.v[e];
    }
    r0 += s;
  }
  Decay(o, x, &dir);
  for (size_t e = 0; e < x.v.size(); ++e) x.v[e] -= upd.v[e];
}

void RefDion2Step(const RefOptions& o, bool nordion, Mat& x, Mat& m, std::vector<double>& v,
                  const Mat& g) {
  for (size_t e = 0; e < m.v.size(); ++e) m.v[e] += g.v[e];
  Decay(o, x, nullptr);
  std::vector<int64_t> blocks = o.row_blocks.empty() ? std::vector<int64_t>{m.r} : o.row_blocks;
  int64_t r0 = 0;
  for (int64_t h : blocks) {
    const bool rows = nordion || h <= m.c;
    const int64_t len = rows ? h : m.c;
    const int64_t k = std::min<int64_t>(
        len, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(o.fraction * len))));
    std::vector<double> score(len, 0.0);
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < m.c; ++j) score[rows ? i : j] += std::abs(m.at(r0 + i, j));
    std::vector<int64_t> idx(len);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    idx.resize(k);
    Mat s(rows ? k : h, rows ? m.c : k);
    for (int64_t t = 0; t < k; ++t) {
      for (int64_t q = 0; q < (rows ? m.c : h); ++q) {
        double& src = rows ? m.at(r0 + idx[t], q) : m.at(r0 + q, idx[t]);
        (rows ? s.at(t, q) : s.at(q, t)) = src;
        src *= nordion ? o.mu : o.ef_decay;
      }
    }
    Mat d = Orth(o, s);
    if (nordion) {
      std::vector<double> vi(k);
      for (int64_t t = 0; t < k; ++t) vi[t] = v[r0 + idx[t]];
      Normalize(o, d, vi.data());
      for (int64_t t = 0; t < k; ++t) v[r0 + idx[t]] = vi[t];
    }
    const double alpha = o.lr * Adjust(o.adjust, static_cast<double>(h), static_cast<double>(m.c));
    for (int64_t t = 0; t < k; ++t)
      for (int64_t q = 0; q < (rows ? m.c : h); ++q) {
        if (rows)
          x.at(r0 + idx[t], q) -= alpha * d.at(t, q);
        else
          x.at(r0 + q, idx[t]) -= alpha * d.at(q, t);
      }
    r0 += h;
  }
}

void RefDionStep(const RefOptions& o, Mat& x, Mat& m, Mat& q, const Mat& g) {
  for (size_t e = 0; e < m.v.size(); ++e) m.v[e] += g.v[e];
  const bool tr = m.r < m.c;
  Mat b = tr ? Transpose(m) : m;
  bool zero = true;
  for (double e : b.v) zero = zero && e == 0;
  Mat p = ThinQ(MatMul(b, q));
  Mat r = MatMul(Transpose(b), p);
  if (zero) {
    for (double& e : p.v) e = 0;
    r = q;
  }
  Mat prt = MatMul(p, Transpose(r));  // a×b
  for (int64_t i = 0; i < b.r; ++i)
    for (int64_t j = 0; j < b.c; ++j) b.at(i, j) -= (1 - o.mu) * prt.at(i, j);
  m = tr ? Transpose(b) : b;
  for (int64_t j = 0; j < r.c; ++j) {
    double n = 0;
    for (int64_t i = 0; i < r.r; ++i) n += r.at(i, j) * r.at(i, j);
    for (int64_t i = 0; i < r.r; ++i) r.at(i, j) /= std::sqrt(n) + o.eps;
  }
  Mat upd = MatMul(p, Transpose(r));
  if (tr) upd = Transpose(upd);
  const double s = std::sqrt(static_cast<double>(x.r) / x.c) * o.lr;
  for (size_t e = 0; e < x.v.size(); ++e) x.v[e] = (1 - o.lr * o.wd) * x.v[e] - s * upd.v[e];
  q = r;
}

void RefAdamWStep(const RefOptions& o, int64_t t, Mat& x, Mat& m, Mat& v, const Mat& g) {
  const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
  for (size_t e = 0; e < x.v.size(); ++e) {
    const double x0 = x.v[e];
    x.v[e] *= 1 - o.lr * o.wd;
    m.v[e] = o.beta1 * m.v[e] + (1 - o.beta1) * g.v[e];
    v.v[e] = o.beta2 * v.v[e] + (1 - o.beta2) * g.v[e] * g.v[e];
    x.v[e] -= (o.lr / bc1) * m.v[e] / (std::sqrt(v.v[e]) / std::sqrt(bc2) + o.eps);
    if (o.cautious && m.v[e] * x0 < 0) x.v[e] += o.lr * o.wd * x0;
  }
}

void RefLionStep(const RefOptions& o, Mat& x, Mat& m, const Mat& g) {
  for (size_t e = 0; e < x.v.size(); ++e) {
    const double c = o.beta1 * m.v[e] + (1 - o.beta1) * g.v[e];
    const double u = c > 0 ? 1 : c < 0 ? -1 : 0;
    m.v[e] = o.beta2 * m.v[e] + (1 - o.beta2) * g.v[e];
    if (o.cautious) {
      if (x.v[e] * u >= 0) x.v[e] -= o.lr * o.wd * x.v[e];
    } else {
      x.v[e] *= 1 - o.lr * o.wd;
    }
    x.v[e] -= o.lr * u;
  }
}

}  // namespace diond::optim::testing
