#include "kernels/testing/oracle.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>

extern "C" void dgesvd_(const char* jobu, const char* jobvt, const int* m,
                        const int* n, double* a, const int* lda, double* s,
                        double* u, const int* ldu, double* vt, const int* ldvt,
                        double* work, const int* lwork, int* info);

namespace dmuon::kernels::testing {
namespace {

struct Svd {
  // Of the column-major c x r matrix that row-major g (r x c) is:
  // g^T = u diag(s) vt, u is c x k, vt is k x r (k = min(r, c)).
  std::vector<double> u, s, vt;
  int k = 0;
};

Svd ComputeSvd(const std::vector<double>& g, Shape shape) {
  const int m = static_cast<int>(shape.cols), n = static_cast<int>(shape.rows);
  Svd r;
  r.k = std::min(m, n);
  std::vector<double> a = g;
  r.s.resize(r.k);
  r.u.resize(static_cast<size_t>(m) * r.k);
  r.vt.resize(static_cast<size_t>(r.k) * n);
  int lwork = -1, info = 0;
  double query = 0;
  const char job = 'S';
  dgesvd_(&job, &job, &m, &n, a.data(), &m, r.s.data(), r.u.data(), &m,
          r.vt.data(), &r.k, &query, &lwork, &info);
  lwork = static_cast<int>(query);
  std::vector<double> work(lwork);
  dgesvd_(&job, &job, &m, &n, a.data(), &m, r.s.data(), r.u.data(), &m,
          r.vt.data(), &r.k, work.data(), &lwork, &info);
  if (info != 0) {
    std::cerr << "dgesvd failed, info=" << info << "\n";
    std::abort();  // test-only code: an oracle that cannot answer must stop
  }
  return r;
}

}  // namespace

std::vector<double> SingularValues(const std::vector<double>& g, Shape shape) {
  return ComputeSvd(g, shape).s;
}

std::vector<double> SvdOracle(const std::vector<double>& g, Shape shape,
                              const NsOptions& options) {
  Svd svd = ComputeSvd(g, shape);
  double fro = 0;
  for (double s : svd.s) fro += s * s;
  const double div =
      std::max(std::sqrt(fro) * options.schedule.norm_safety, options.eps);
  std::vector<double> f(svd.k);
  for (int i = 0; i < svd.k; ++i) {
    double x = svd.s[i] / div;
    for (const StepCoefficients& c : options.schedule.steps) {
      const double x2 = x * x;
      x = c.a * x + c.b * x2 * x + c.c * x2 * x2 * x;
    }
    f[i] = x;
  }
  // out^T (column-major cols x rows) = u diag(f) vt, which is row-major out.
  const int64_t m = shape.cols, n = shape.rows;
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int l = 0; l < svd.k; ++l) {
      const double w = f[l] * svd.vt[l + j * svd.k];
      for (int64_t i = 0; i < m; ++i) out[i + j * m] += svd.u[i + l * m] * w;
    }
  return out;
}

std::vector<double> RandomNormal(Shape shape, std::mt19937_64& rng) {
  std::normal_distribution<double> d;
  std::vector<double> v(shape.elements());
  for (double& x : v) x = d(rng);
  return v;
}

std::vector<double> RandomWithSpectrum(Shape shape, double lo, double hi,
                                       std::mt19937_64& rng) {
  // The singular vectors of a Gaussian matrix are Haar-distributed.
  Svd svd = ComputeSvd(RandomNormal(shape, rng), shape);
  const int k = svd.k;
  std::vector<double> s(k);
  for (int i = 0; i < k; ++i) {
    const double t = k == 1 ? 0.0 : static_cast<double>(i) / (k - 1);
    s[i] = hi * std::pow(lo / hi, t);
  }
  std::shuffle(s.begin(), s.end(), rng);
  const int64_t m = shape.cols, n = shape.rows;
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int l = 0; l < k; ++l) {
      const double w = s[l] * svd.vt[l + j * k];
      for (int64_t i = 0; i < m; ++i) out[i + j * m] += svd.u[i + l * m] * w;
    }
  return out;
}

double RelativeError(const std::vector<double>& a,
                     const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (!std::isfinite(num)) return INFINITY;  // NaN never passes a tolerance
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<float> ToFloat(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}
std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

}  // namespace dmuon::kernels::testing
