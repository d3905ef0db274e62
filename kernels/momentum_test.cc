// MomentumUpdate and LrScale against independent formulas.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kernels.h"
#include "kernels/testing/momentum_reference.h"

namespace dmuon::kernels {
namespace {

TEST(Momentum, MatchesReferenceOverSteps) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (bool nesterov : {true, false}) {
    for (double mu : {0.95, 0.9, 0.5, 0.0}) {
      const size_t n = 257;
      std::vector<float> m(n, 0.0f), u(n);
      std::vector<double> ref_m(n, 0.0);
      for (int step = 0; step < 10; ++step) {
        std::vector<float> g(n);
        for (float& x : g) x = d(rng);
        ASSERT_TRUE(MomentumUpdate(g, absl::MakeSpan(m), absl::MakeSpan(u), mu,
                                   nesterov)
                        .ok());
        for (size_t i = 0; i < n; ++i) {
          ref_m[i] = mu * ref_m[i] + (1 - mu) * g[i];
          const double ref_u =
              nesterov ? (1 - mu) * g[i] + mu * ref_m[i] : ref_m[i];
          ASSERT_NEAR(m[i], ref_m[i], 1e-5 * (1 + std::abs(ref_m[i])));
          ASSERT_NEAR(u[i], ref_u, 1e-5 * (1 + std::abs(ref_u)));
        }
      }
    }
  }
}

// The device kernels' CPU reference (kernels/testing), without rounding,
// is MomentumUpdate bit for bit.
TEST(Momentum, DeviceReferenceWithoutRoundingIsMomentumUpdate) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  const size_t n = 1000;
  for (bool nesterov : {true, false}) {
    for (double mu : {0.95, 0.5, 0.0}) {
      std::vector<float> g(n), m(n);
      for (float& x : g) x = d(rng);
      for (float& x : m) x = d(rng);
      std::vector<float> ref_m = m, ref_u(n), u(n);
      ASSERT_TRUE(
          MomentumUpdate(g, absl::MakeSpan(m), absl::MakeSpan(u), mu, nesterov)
              .ok());
      testing::MomentumReference(g, absl::MakeSpan(ref_m),
                                 absl::MakeSpan(ref_u), mu, nesterov,
                                 [](float v) { return v; });
      EXPECT_EQ(ref_m, m) << "nesterov=" << nesterov << " mu=" << mu;
      EXPECT_EQ(ref_u, u) << "nesterov=" << nesterov << " mu=" << mu;
    }
  }
}

// The vectorized loops (elementwise.h), in place and out of place, against
// the scalar reference bit for bit: every lerp form (weights below, at and
// above 0.5), lengths around the vector width, and values from subnormal
// to large.
TEST(Momentum, VectorizedLoopsAreTheScalarReferenceBitForBit) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  std::uniform_int_distribution<int> exponent(-140, 60);
  auto value = [&] { return std::ldexp(d(rng), exponent(rng)); };
  for (bool nesterov : {true, false}) {
    for (double mu : {0.95, 0.9, 0.7, 0.5, 0.3, 0.0}) {
      for (size_t n :
           {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4099}) {
        std::vector<float> g(n), m(n);
        for (float& x : g) x = value();
        for (float& x : m) x = value();
        std::vector<float> ref_m = m, ref_u(n);
        testing::MomentumReference(g, absl::MakeSpan(ref_m),
                                   absl::MakeSpan(ref_u), mu, nesterov,
                                   [](float v) { return v; });
        std::vector<float> out_m = m, out_u(n);
        ASSERT_TRUE(MomentumUpdate(g, absl::MakeSpan(out_m),
                                   absl::MakeSpan(out_u), mu, nesterov)
                        .ok());
        std::vector<float> in_m = m, in_gu = g;
        ASSERT_TRUE(MomentumUpdate(in_gu, absl::MakeSpan(in_m),
                                   absl::MakeSpan(in_gu), mu, nesterov)
                        .ok());
        const std::string where =
            absl::StrCat("nesterov=", nesterov, " mu=", mu, " n=", n);
        auto same = [&](const std::vector<float>& want,
                        const std::vector<float>& got, const char* what) {
          ASSERT_TRUE(n == 0 ||
                      std::memcmp(want.data(), got.data(), n * 4) == 0)
              << what << ": " << where;
        };
        same(ref_m, out_m, "momentum, update out of place");
        same(ref_u, out_u, "update out of place");
        same(ref_m, in_m, "momentum, update in place");
        same(ref_u, in_gu, "update in place");
        // The new momentum into another buffer (the old one kept), the
        // update out of place and over the gradient.
        for (bool over_grad : {false, true}) {
          std::vector<float> kept = m, next(n, NAN), gu = g, u(n);
          std::vector<float>& update = over_grad ? gu : u;
          ASSERT_TRUE(MomentumUpdate(gu, kept, absl::MakeSpan(next),
                                     absl::MakeSpan(update), mu, nesterov)
                          .ok());
          same(ref_m, next, over_grad ? "kept, new (over grad)" : "kept, new");
          same(ref_u, update, over_grad ? "kept, update over grad" : "kept, u");
          same(m, kept, "the old momentum kept");
        }
      }
    }
  }
}

TEST(ScaleInPlace, EachElementTimesTheScaleOnce) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (size_t n : {0, 1, 5, 17, 1025}) {
    std::vector<float> x(n);
    for (float& v : x) v = d(rng);
    std::vector<float> want = x;
    const float s = std::abs(d(rng)) + 0.5f;
    for (float& v : want) v = v * s;
    ScaleInPlace(absl::MakeSpan(x), s);
    EXPECT_EQ(x, want) << "n=" << n;
  }
}

TEST(Momentum, UpdateMayAliasGrad) {
  std::vector<float> g = {1, 2, 3}, m = {0, 0, 0};
  ASSERT_TRUE(
      MomentumUpdate(g, absl::MakeSpan(m), absl::MakeSpan(g), 0.5, false).ok());
  EXPECT_FLOAT_EQ(g[2], 1.5f);
  EXPECT_FLOAT_EQ(m[2], 1.5f);
}

TEST(Momentum, RejectsBadArguments) {
  std::vector<float> g(4), m(3), u(4);
  EXPECT_EQ(
      MomentumUpdate(g, absl::MakeSpan(m), absl::MakeSpan(u), 0.9, true).code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<float> m4(4);
  std::vector<float> m5(5);
  const absl::Status sizes =
      MomentumUpdate(g, m4, absl::MakeSpan(m5), absl::MakeSpan(u), 0.9, true);
  EXPECT_EQ(sizes.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sizes.message().find("momentum 4 in, 5 out"), std::string::npos)
      << sizes;
  EXPECT_EQ(MomentumUpdate(g, absl::MakeSpan(m4), absl::MakeSpan(u), 1.0, true)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MomentumUpdate(g, absl::MakeSpan(m4), absl::MakeSpan(u),
                           std::nan(""), true)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LrScale, TorchFormulas) {
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kOriginal, {4096, 1024}), 2.0);
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kOriginal, {1024, 4096}), 1.0);
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kMatchRmsAdamW, {1024, 4096}), 0.2 * 64);
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kMatchRmsAdamW, {4096, 1024}), 0.2 * 64);
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kSpectralUnclamped, {1024, 4096}), 0.5);
  EXPECT_DOUBLE_EQ(LrScale(LrAdjust::kSpectralUnclamped, {4096, 1024}), 2.0);
  EXPECT_TRUE(ParseLrAdjust("match_rms_adamw").ok());
  EXPECT_EQ(*ParseLrAdjust("spectral_unclamped"), LrAdjust::kSpectralUnclamped);
  EXPECT_FALSE(ParseLrAdjust("sqrt").ok());
}

}  // namespace
}  // namespace dmuon::kernels
