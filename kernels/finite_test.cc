#include "kernels/finite.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dmuon::kernels {
namespace {

// The oracle: the first element std::isfinite rejects.
template <typename T>
int64_t Reference(const std::vector<T>& x) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

template <typename T>
std::vector<T> Values(std::mt19937_64& rng, int64_t n) {
  // Normal values with the extremes every element may be: the largest
  // finite, the smallest normal, subnormals, signed zeros.
  const T special[] = {std::numeric_limits<T>::max(),
                       -std::numeric_limits<T>::max(),
                       std::numeric_limits<T>::min(),
                       std::numeric_limits<T>::denorm_min(),
                       T(0),
                       -T(0)};
  std::normal_distribution<T> normal(0, 3);
  std::uniform_int_distribution<int> pick(0, 15);
  std::vector<T> x(static_cast<size_t>(n));
  for (T& v : x) {
    const int k = pick(rng);
    v = k < 6 ? special[k] : normal(rng);
  }
  return x;
}

template <typename T>
void CheckRandom() {
  std::mt19937_64 rng(std::random_device{}());
  const T bad[] = {
      std::numeric_limits<T>::quiet_NaN(), -std::numeric_limits<T>::quiet_NaN(),
      std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity(),
      std::numeric_limits<T>::signaling_NaN()};
  for (int trial = 0; trial < 200; ++trial) {
    // Sizes around the block (1024) and its multiples, and odd tails.
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
    std::vector<T> x = Values<T>(rng, n);
    const int count = n == 0 ? 0 : trial % 4;  // 0 to 3 non-finite elements
    for (int k = 0; k < count; ++k) {
      const auto at = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
      x[static_cast<size_t>(at)] = bad[(trial + k) % 5];
    }
    ASSERT_EQ(FirstNonFinite(x.data(), n), Reference(x))
        << "n=" << n << " trial " << trial;
  }
}

TEST(FirstNonFiniteTest, MatchesIsfiniteOnRandomArraysFloat) {
  CheckRandom<float>();
}

TEST(FirstNonFiniteTest, MatchesIsfiniteOnRandomArraysDouble) {
  CheckRandom<double>();
}

TEST(FirstNonFiniteTest, EveryPositionOfABlockAndItsEdges) {
  const int64_t n = 3 * 1024 + 7;
  std::vector<float> x(static_cast<size_t>(n), 1.5f);
  EXPECT_EQ(FirstNonFinite(x.data(), n), -1);
  for (int64_t at : {int64_t{0}, int64_t{1023}, int64_t{1024}, int64_t{2047},
                     int64_t{3072}, n - 1}) {
    x[static_cast<size_t>(at)] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(FirstNonFinite(x.data(), n), at);
    x[static_cast<size_t>(at)] = 1.5f;
  }
  // Two in one block, and one in an earlier block: the first wins.
  x[2000] = NAN;
  x[1500] = -INFINITY;
  EXPECT_EQ(FirstNonFinite(x.data(), n), 1500);
  x[10] = NAN;
  EXPECT_EQ(FirstNonFinite(x.data(), n), 10);
  EXPECT_EQ(FirstNonFinite(x.data(), 10), -1);  // a prefix
  EXPECT_EQ(FirstNonFinite(x.data(), 0), -1);
}

TEST(NonFiniteMessageTest, NamesTheValueAndItsRowAndColumn) {
  EXPECT_EQ(NonFiniteMessage("gradient of 'w'", NAN, 7, 3),
            "gradient of 'w' has a non-finite value (nan) at element (2,1)");
  EXPECT_EQ(NonFiniteMessage("x", -INFINITY, 0, 5),
            "x has a non-finite value (-inf) at element (0,0)");
  EXPECT_EQ(NonFiniteMessage("x", INFINITY, 9, 1),
            "x has a non-finite value (inf) at element (9,0)");
}

}  // namespace
}  // namespace dmuon::kernels
