// FirstNonFinite (finite.h). Built with -ftree-vectorize (kernels/BUILD):
// the block test is a branch-free OR over the exponent bits, which GCC
// vectorizes only with it at -O2 (Clang does by default).

#include "kernels/finite.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dmuon::kernels {
namespace {

// Elements per block: small enough that the search of a block with a
// non-finite element costs nothing, large enough that the per-block branch
// is noise.
constexpr int64_t kBlock = 1024;

template <typename T, typename Bits, Bits kExponent>
int64_t Scan(const T* x, int64_t n) {
  static_assert(sizeof(T) == sizeof(Bits));
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = begin + kBlock < n ? begin + kBlock : n;
    Bits bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      Bits b;
      std::memcpy(&b, x + i, sizeof(b));
      bad |= static_cast<Bits>((b & kExponent) == kExponent);
    }
    if (bad == 0) continue;
    for (int64_t i = begin; i < end; ++i) {
      if (!std::isfinite(x[i])) return i;
    }
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(const float* x, int64_t n) {
  return Scan<float, uint32_t, 0x7f800000u>(x, n);
}

int64_t FirstNonFinite(const double* x, int64_t n) {
  return Scan<double, uint64_t, 0x7ff0000000000000ull>(x, n);
}

std::string NonFiniteMessage(std::string_view what, double value, int64_t index,
                             int64_t cols) {
  return absl::StrCat(std::string(what), " has a non-finite value (", value,
                      ") at element (", index / cols, ",", index % cols, ")");
}

}  // namespace dmuon::kernels
