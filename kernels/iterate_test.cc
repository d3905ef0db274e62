// The iterate's loops against plain loops, on fresh random matrices of
// sizes around the partial sums' count (iterate.cc: 8).

#include "kernels/iterate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dmuon::kernels::internal {
namespace {

template <typename T>
std::vector<T> RandomMatrix(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<double> d(0.0, 3.0);
  std::vector<T> x(static_cast<size_t>(n));
  for (T& v : x) v = static_cast<T>(d(rng));
  return x;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Sizes below, at and around the partial sums (8), and one of the overlap
// bench's matrices (1536x384).
const int64_t kSizes[] = {1, 3, 7, 8, 9, 15, 16, 17, 1023, 1536 * 384};

template <typename T>
void CheckSize(std::mt19937_64& rng, int64_t n) {
  SCOPED_TRACE(testing::Message() << n << " elements");
  const std::vector<T> src = RandomMatrix<T>(rng, n);
  // The sum: the plain running sum in long double, to double rounding.
  long double ref = 0;
  for (T v : src) ref += static_cast<long double>(v) * v;
  EXPECT_NEAR(SumSquares(src.data(), n), static_cast<double>(ref),
              1e-13 * static_cast<double>(ref));
  const T d =
      static_cast<T>(std::uniform_real_distribution<double>(0.5, 9)(rng));
  std::vector<T> want(src.size()), got(src.size(), T(-1));
  for (size_t i = 0; i < src.size(); ++i) want[i] = src[i] / d;
  DivideInto(src.data(), n, d, got.data());
  EXPECT_TRUE(SameBits(got, want));  // IEEE division: the same bits
  // The scaled copy out: a rounded product each, a plain copy for 1.
  for (T s : {T(1), d}) {
    for (size_t i = 0; i < src.size(); ++i) want[i] = src[i] * s;
    std::fill(got.begin(), got.end(), T(-1));
    EXPECT_TRUE(ScaleInto(src.data(), n, s, got.data()));
    EXPECT_TRUE(SameBits(got, want));
  }
}

// A fresh seed per test, recorded (the test XML's "seed") to replay one.
std::mt19937_64 SeededRng() {
  const uint64_t seed = std::random_device{}();
  testing::Test::RecordProperty("seed", std::to_string(seed));
  return std::mt19937_64(seed);
}

TEST(IterateTest, MatchesPlainLoopsOnRandomMatrices) {
  std::mt19937_64 rng = SeededRng();
  for (int64_t n : kSizes) {
    CheckSize<float>(rng, n);
    CheckSize<double>(rng, n);
  }
}

TEST(IterateTest, SumIsFiniteExactlyWhenEveryElementIs) {
  std::mt19937_64 rng = SeededRng();
  const float big = std::numeric_limits<float>::max();
  for (float bad : {std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    for (int64_t n : {1, 7, 8, 9, 1000}) {
      std::vector<float> x = RandomMatrix<float>(rng, n);
      EXPECT_TRUE(std::isfinite(SumSquares(x.data(), n)));
      x[std::uniform_int_distribution<int64_t>(0, n - 1)(rng)] = bad;
      EXPECT_FALSE(std::isfinite(SumSquares(x.data(), n))) << n;
    }
  }
  // The result's check in ScaleInto: false exactly when an element is
  // not finite, wherever it is.
  for (int64_t n : {1, 7, 8, 9, 1000}) {
    std::vector<float> x = RandomMatrix<float>(rng, n), out(n);
    EXPECT_TRUE(ScaleInto(x.data(), n, 2.0f, out.data()));
    x[std::uniform_int_distribution<int64_t>(0, n - 1)(rng)] =
        std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(ScaleInto(x.data(), n, 2.0f, out.data())) << n;
    x = RandomMatrix<float>(rng, n);
    x[n - 1] = -std::numeric_limits<float>::infinity();
    EXPECT_FALSE(ScaleInto(x.data(), n, 1.0f, out.data())) << n;
  }
  // The largest floats, many of them: their squares still sum finitely.
  const std::vector<float> huge(100000, big);
  EXPECT_TRUE(std::isfinite(SumSquares(huge.data(), 100000)));
  // Doubles above about 1.3e154 do overflow it (ns_cpu.cc checks their
  // elements then).
  const std::vector<double> huge64(9, 1e200);
  EXPECT_FALSE(std::isfinite(SumSquares(huge64.data(), 9)));
  // The result's check is on what is written: a product that overflows, or
  // a non-finite scale, is caught too.
  const std::vector<float> x(9, big);
  std::vector<float> out(9);
  EXPECT_TRUE(ScaleInto(x.data(), 9, 1.0f, out.data()));
  EXPECT_FALSE(ScaleInto(x.data(), 9, 2.0f, out.data()));
  const std::vector<float> one(9, 1.0f);
  EXPECT_FALSE(ScaleInto(one.data(), 9, std::numeric_limits<float>::infinity(),
                         out.data()));
}

}  // namespace
}  // namespace dmuon::kernels::internal
