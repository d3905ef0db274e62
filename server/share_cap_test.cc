// The principal cap's weights (share_cap.h) against shares worked out by
// hand: a job's share of an executor is its charged weight over the sum.

#include "server/share_cap.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

namespace dmuon::server {
namespace {

const std::string kA = "team-a", kB = "team-b", kC = "team-c";

// Each claim's share of the executor under CappedWeights.
std::vector<double> Shares(const std::vector<ShareClaim>& claims) {
  const std::vector<double> w = CappedWeights(claims);
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<double> out;
  for (double x : w) out.push_back(x / sum);
  return out;
}

TEST(ShareCap, NoCapKeepsTheWeights) {
  const std::vector<double> w =
      CappedWeights({{&kA, 3, 1}, {&kB, 1, 1}, {&kB, 2, 1}});
  EXPECT_EQ(w, (std::vector<double>{3, 1, 2}));
}

TEST(ShareCap, CapThatDoesNotBindKeepsTheWeights) {
  // a claims 1/4 by weight, under its cap of 0.5.
  const std::vector<double> w = CappedWeights({{&kA, 1, 0.5}, {&kB, 3, 1}});
  EXPECT_DOUBLE_EQ(w[0], 1);
  EXPECT_DOUBLE_EQ(w[1], 3);
}

TEST(ShareCap, CappedPrincipalGetsItsCapAcrossItsJobs) {
  // a's two jobs (weights 3 and 1) would take 80 %; its cap is 30 %, split
  // 3:1 between them; b's two jobs share the other 70 % equally.
  const auto s =
      Shares({{&kA, 3, 0.3}, {&kA, 1, 0.3}, {&kB, 0.5, 1}, {&kB, 0.5, 1}});
  EXPECT_NEAR(s[0] + s[1], 0.3, 1e-12);
  EXPECT_NEAR(s[0] / s[1], 3, 1e-12);
  EXPECT_NEAR(s[2], 0.35, 1e-12);
  EXPECT_NEAR(s[3], 0.35, 1e-12);
}

TEST(ShareCap, WhatACapGivesUpGoesByWeightAndIsCappedAgain) {
  // a (weight 6, cap 0.2) gives up 0.4 of its 0.6; b (weight 2, cap 0.3)
  // would then claim 0.4 and is held at 0.3; c takes the remaining 0.5.
  const auto s = Shares({{&kA, 6, 0.2}, {&kB, 2, 0.3}, {&kC, 2, 1}});
  EXPECT_NEAR(s[0], 0.2, 1e-12);
  EXPECT_NEAR(s[1], 0.3, 1e-12);
  EXPECT_NEAR(s[2], 0.5, 1e-12);
}

TEST(ShareCap, EveryCapReachedIsWorkConservingByCap) {
  // Caps summing to 0.5: the executor is still used whole, 1:4 by cap.
  const auto s = Shares({{&kA, 1, 0.1}, {&kB, 1, 0.4}});
  EXPECT_NEAR(s[0], 0.2, 1e-12);
  EXPECT_NEAR(s[1], 0.8, 1e-12);
}

TEST(ShareCap, AlonePrincipalUsesEverything) {
  const std::vector<double> w = CappedWeights({{&kA, 2, 0.1}, {&kA, 1, 0.1}});
  EXPECT_EQ(w, (std::vector<double>{2, 1}));
}

TEST(ShareCap, LeastCapOfAPrincipalsJobsApplies) {
  // Jobs made under two quota files: the stricter cap holds.
  const auto s = Shares({{&kA, 1, 0.5}, {&kA, 1, 0.25}, {&kB, 1, 1}});
  EXPECT_NEAR(s[0] + s[1], 0.25, 1e-12);
}

}  // namespace
}  // namespace dmuon::server
