// The iterate's loops (iterate.h).

#include "kernels/iterate.h"

namespace dmuon::kernels::internal {
namespace {

// Partial sums: enough independent adds to hide an add's latency, and a
// whole number of vector registers at any width GCC picks.
constexpr int kLanes = 8;

template <typename T>
double SumSquaresImpl(const T* __restrict x, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = static_cast<double>(x[i + k]);
      acc[k] += v * v;
    }
  }
  double sum = 0;
  for (; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    sum += v * v;
  }
  for (int k = 0; k < kLanes; ++k) sum += acc[k];
  return sum;
}

template <typename T>
void DivideIntoImpl(const T* __restrict src, int64_t n, T d,
                    T* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] / d;
}

}  // namespace

double SumSquares(const float* x, int64_t n) { return SumSquaresImpl(x, n); }
double SumSquares(const double* x, int64_t n) { return SumSquaresImpl(x, n); }

void DivideInto(const float* src, int64_t n, float d, float* dst) {
  DivideIntoImpl(src, n, d, dst);
}
void DivideInto(const double* src, int64_t n, double d, double* dst) {
  DivideIntoImpl(src, n, d, dst);
}

}  // namespace dmuon::kernels::internal
