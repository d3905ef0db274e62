// The iterate's loops (iterate.h).

#include "kernels/iterate.h"

#include <algorithm>

namespace dmuon::kernels::internal {
namespace {

// Partial sums: enough independent adds to hide an add's latency, and a
// whole number of vector registers at any width GCC picks.
constexpr int kLanes = 8;
// Transposes go tile by tile: a tile's destination lines stay in L1.
constexpr int64_t kTile = 32;

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

// dst <- op(src) for op a division by d (kDivide) or the identity, in
// place order or transposed in tiles.
template <typename T, bool kDivide>
void Into(const T* __restrict src, int64_t rows, int64_t cols, T d,
          bool transpose, T* __restrict dst) {
  if (!transpose) {
    const int64_t n = rows * cols;
    for (int64_t i = 0; i < n; ++i) dst[i] = kDivide ? src[i] / d : src[i];
    return;
  }
  for (int64_t ib = 0; ib < rows; ib += kTile) {
    const int64_t ie = std::min(ib + kTile, rows);
    for (int64_t jb = 0; jb < cols; jb += kTile) {
      const int64_t je = std::min(jb + kTile, cols);
      for (int64_t i = ib; i < ie; ++i) {
        const T* s = src + i * cols;
        for (int64_t j = jb; j < je; ++j) {
          dst[j * rows + i] = kDivide ? s[j] / d : s[j];
        }
      }
    }
  }
}

}  // namespace

double SumSquares(const float* x, int64_t n) { return SumSquaresImpl(x, n); }
double SumSquares(const double* x, int64_t n) { return SumSquaresImpl(x, n); }

void DivideInto(const float* src, int64_t rows, int64_t cols, float d,
                bool transpose, float* dst) {
  Into<float, true>(src, rows, cols, d, transpose, dst);
}
void DivideInto(const double* src, int64_t rows, int64_t cols, double d,
                bool transpose, double* dst) {
  Into<double, true>(src, rows, cols, d, transpose, dst);
}

void CopyInto(const float* src, int64_t rows, int64_t cols, bool transpose,
              float* dst) {
  Into<float, false>(src, rows, cols, 1.0f, transpose, dst);
}
void CopyInto(const double* src, int64_t rows, int64_t cols, bool transpose,
              double* dst) {
  Into<double, false>(src, rows, cols, 1.0, transpose, dst);
}

}  // namespace dmuon::kernels::internal
