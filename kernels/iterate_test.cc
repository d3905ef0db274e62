// The iterate's loops against plain loops, on fresh random matrices of
// shapes around the tile and lane sizes (iterate.cc: 32, 8).

#include "kernels/iterate.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
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

// rows x cols pairs: below, at and above a tile (32) and the lanes (8),
// wide and tall, and one of the overlap bench's shapes.
const int64_t kShapes[][2] = {{1, 1},  {1, 7},   {7, 1},    {3, 5},
                              {8, 8},  {31, 33}, {32, 32},  {33, 31},
                              {65, 9}, {9, 65},  {100, 37}, {1536, 384}};

template <typename T>
void CheckShape(std::mt19937_64& rng, int64_t rows, int64_t cols) {
  SCOPED_TRACE(testing::Message() << rows << "x" << cols);
  const std::vector<T> src = RandomMatrix<T>(rng, rows * cols);
  // The sum: the plain running sum in long double, to double rounding.
  long double ref = 0;
  for (T v : src) ref += static_cast<long double>(v) * v;
  const double got = SumSquares(src.data(), rows * cols);
  EXPECT_NEAR(got, static_cast<double>(ref), 1e-13 * static_cast<double>(ref));
  const T d =
      static_cast<T>(std::uniform_real_distribution<double>(0.5, 9)(rng));
  for (bool transpose : {false, true}) {
    SCOPED_TRACE(transpose ? "transposed" : "in order");
    std::vector<T> want_div(src.size()), want_copy(src.size());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t to = transpose ? j * rows + i : i * cols + j;
        want_div[to] = src[i * cols + j] / d;
        want_copy[to] = src[i * cols + j];
      }
    }
    std::vector<T> div(src.size(), T(-1)), copy(src.size(), T(-1));
    DivideInto(src.data(), rows, cols, d, transpose, div.data());
    CopyInto(src.data(), rows, cols, transpose, copy.data());
    EXPECT_TRUE(SameBits(div, want_div));  // IEEE division: the same bits
    EXPECT_TRUE(SameBits(copy, want_copy));
  }
}

TEST(IterateTest, MatchesPlainLoopsOnRandomMatrices) {
  std::mt19937_64 rng(std::random_device{}());
  for (const auto& s : kShapes) {
    CheckShape<float>(rng, s[0], s[1]);
    CheckShape<double>(rng, s[0], s[1]);
  }
}

TEST(IterateTest, SumIsFiniteExactlyWhenEveryElementIs) {
  std::mt19937_64 rng(std::random_device{}());
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
  // The largest floats, many of them: their squares still sum finitely.
  const std::vector<float> huge(100000, big);
  EXPECT_TRUE(std::isfinite(SumSquares(huge.data(), 100000)));
}

}  // namespace
}  // namespace dmuon::kernels::internal
