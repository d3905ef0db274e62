#include "server/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace dmuon::server {
namespace {

TEST(Planner, LptIsDeterministicAndBalanced) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> u(1, 100);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> costs(1 + rng() % 60);
    for (double& c : costs) c = u(rng);
    const int k = 1 + rng() % 5;
    Plan a = PlanLpt(costs, k), b = PlanLpt(costs, k);
    EXPECT_EQ(a.executor_of, b.executor_of);
    double total = 0, biggest = 0;
    for (double c : costs) total += c, biggest = std::max(biggest, c);
    // Graham's bound for LPT: makespan <= (4/3 - 1/(3k)) OPT, and OPT is at
    // least max(total / k, biggest).
    const double lower = std::max(total / k, biggest);
    EXPECT_LE(a.makespan, (4.0 / 3.0) * lower + 1e-9);
    std::vector<double> load(k, 0);
    for (size_t i = 0; i < costs.size(); ++i)
      load[a.executor_of[i]] += costs[i];
    for (int e = 0; e < k; ++e) EXPECT_DOUBLE_EQ(load[e], a.predicted_load[e]);
  }
}

TEST(Planner, RefinementNeverWorseAndFixesLptsClassicMiss) {
  // LPT puts {3,3,2,2,2} on two executors as 3+2+2 / 3+2 = 7; optimal is 6.
  Plan lpt = PlanLpt({3, 3, 2, 2, 2}, 2);
  Plan ref = PlanRefined({3, 3, 2, 2, 2}, 2);
  EXPECT_DOUBLE_EQ(lpt.makespan, 7);
  EXPECT_DOUBLE_EQ(ref.makespan, 6);
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> u(1, 100);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> costs(2 + rng() % 40);
    for (double& c : costs) c = u(rng);
    const int k = 2 + rng() % 4;
    Plan a = PlanLpt(costs, k), b = PlanRefined(costs, k);
    EXPECT_LE(b.makespan, a.makespan + 1e-9);
    EXPECT_EQ(b.executor_of, PlanRefined(costs, k).executor_of);
    std::vector<double> load(k, 0);
    for (size_t i = 0; i < costs.size(); ++i)
      load[b.executor_of[i]] += costs[i];
    for (int e = 0; e < k; ++e) EXPECT_NEAR(load[e], b.predicted_load[e], 1e-9);
  }
}

TEST(Planner, OneExecutorTakesAll) {
  Plan p = PlanLpt({3, 1, 2}, 1);
  EXPECT_EQ(p.executor_of, (std::vector<int>{0, 0, 0}));
  EXPECT_DOUBLE_EQ(p.makespan, 6);
}

TEST(Planner, PlanOnMovesLoadOntoTheGivenExecutors) {
  // Executor 1 of 3 is unhealthy: plan over two, place on 0 and 2.
  Plan p = PlanOn(PlanLpt({3, 1, 2}, 2), {0, 2}, 3);
  EXPECT_EQ(p.executor_of, (std::vector<int>{0, 2, 2}));
  EXPECT_EQ(p.predicted_load, (std::vector<double>{3, 0, 3}));
  EXPECT_DOUBLE_EQ(p.makespan, 3);
}

}  // namespace
}  // namespace dmuon::server
