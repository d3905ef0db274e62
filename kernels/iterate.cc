// The iterate's loops (iterate.h).

#include "kernels/iterate.h"

#include <cstdint>
#include <cstring>

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

// Branch-free: the exponent bits all ones (Inf, NaN) OR-ed over the pass,
// as kernels/finite.cc tests them, which GCC vectorizes.
template <typename T, typename Bits, Bits kExponent>
bool ScaleIntoImpl(const T* __restrict x, int64_t n, T s, T* __restrict out) {
  static_assert(sizeof(T) == sizeof(Bits));
  Bits bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i] * s;
    Bits b;
    std::memcpy(&b, &v, sizeof(b));
    bad |= static_cast<Bits>((b & kExponent) == kExponent);
    out[i] = v;
  }
  return bad == 0;
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

bool ScaleInto(const float* x, int64_t n, float s, float* out) {
  return ScaleIntoImpl<float, uint32_t, 0x7f800000u>(x, n, s, out);
}
bool ScaleInto(const double* x, int64_t n, double s, double* out) {
  return ScaleIntoImpl<double, uint64_t, 0x7ff0000000000000ull>(x, n, s, out);
}

}  // namespace dmuon::kernels::internal
