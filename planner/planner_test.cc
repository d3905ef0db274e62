#include "planner/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace dmuon::planner {
namespace {

// Every matrix on an existing executor, and the loads and makespan are
// those of the assignment (summed here in index order), within `rel` of the
// total cost.
void ExpectValid(const Plan& p, const std::vector<double>& costs, int k,
                 double rel = 1e-9) {
  ASSERT_EQ(p.executor_of.size(), costs.size());
  ASSERT_EQ(p.predicted_load.size(), static_cast<size_t>(k));
  std::vector<double> load(k, 0);
  double total = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    ASSERT_GE(p.executor_of[i], 0);
    ASSERT_LT(p.executor_of[i], k);
    load[p.executor_of[i]] += costs[i];
    total += costs[i];
  }
  for (int e = 0; e < k; ++e)
    EXPECT_NEAR(load[e], p.predicted_load[e], rel * total) << e;
  EXPECT_NEAR(p.makespan, *std::max_element(load.begin(), load.end()),
              rel * total);
}

// The minimum makespan over all k^n assignments.
double BruteForce(const std::vector<double>& costs, int k) {
  std::vector<double> load(k, 0);
  double best = INFINITY;
  auto go = [&](auto&& self, size_t i) -> void {
    if (i == costs.size()) {
      best = std::min(best, *std::max_element(load.begin(), load.end()));
      return;
    }
    for (int e = 0; e < k; ++e) {
      load[e] += costs[i];
      self(self, i + 1);
      load[e] -= costs[i];
    }
  };
  go(go, 0);
  return best;
}

// n costs uniform in [1, 100).
std::vector<double> UniformCosts(std::mt19937& rng, size_t n) {
  std::vector<double> costs(n);
  std::uniform_real_distribution<double> u(1, 100);
  for (double& c : costs) c = u(rng);
  return costs;
}

// Random costs: uniform reals, or small integers (many ties) half the time.
std::vector<double> RandomCosts(std::mt19937& rng, size_t n) {
  if (rng() % 2 == 0) return UniformCosts(rng, n);
  std::vector<double> costs(n);
  for (double& c : costs) c = 1 + rng() % 6;
  return costs;
}

std::vector<int> RandomLayers(std::mt19937& rng, size_t n) {
  std::vector<int> layers(n);
  const int count = 1 + rng() % std::max<size_t>(1, n / 2);
  for (int& l : layers) l = static_cast<int>(rng() % (count + 1)) - 1;
  return layers;
}

TEST(Planner, LptIsDeterministicAndBalanced) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<double> costs = UniformCosts(rng, 1 + rng() % 60);
    const int k = 1 + rng() % 5;
    Plan a = PlanLpt(costs, k), b = PlanLpt(costs, k);
    EXPECT_EQ(a.executor_of, b.executor_of);
    double total = 0, biggest = 0;
    for (double c : costs) total += c, biggest = std::max(biggest, c);
    // Graham's bounds: any list schedule ends by total / k + (1 - 1/k) of
    // the biggest cost; LPT within (4/3 - 1/(3k)) of the optimum, checked
    // where PlanBest proved its makespan optimal. (max(total / k, biggest)
    // is no substitute for the optimum: it can be well below it.)
    EXPECT_LE(a.makespan, total / k + (1.0 - 1.0 / k) * biggest + 1e-9);
    if (const Plan opt = PlanBest(costs, {}, k); opt.optimal) {
      EXPECT_LE(a.makespan,
                (4.0 / 3.0 - 1.0 / (3.0 * k)) * opt.makespan + 1e-9);
    }
    // LPT sums in cost order, ExpectValid in index order.
    ExpectValid(a, costs, k, 1e-12);
  }
}

TEST(Planner, RefinementNeverWorseAndFixesLptsClassicMiss) {
  // LPT puts {3,3,2,2,2} on two executors as 3+2+2 / 3+2 = 7; optimal is 6.
  Plan lpt = PlanLpt({3, 3, 2, 2, 2}, 2);
  Plan ref = PlanRefined({3, 3, 2, 2, 2}, 2);
  EXPECT_DOUBLE_EQ(lpt.makespan, 7);
  EXPECT_DOUBLE_EQ(ref.makespan, 6);
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<double> costs = UniformCosts(rng, 2 + rng() % 40);
    const int k = 2 + rng() % 4;
    Plan a = PlanLpt(costs, k), b = PlanRefined(costs, k);
    EXPECT_LE(b.makespan, a.makespan + 1e-9);
    EXPECT_EQ(b.executor_of, PlanRefined(costs, k).executor_of);
    ExpectValid(b, costs, k, 1e-12);
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

TEST(Planner, ExactSearchMatchesBruteForce) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  int lpt_missed = 0;  // instances where the search had work to do
  for (int trial = 0; trial < 300; ++trial) {
    const int k = 2 + rng() % 3;
    const size_t n = 1 + rng() % (k == 4 ? 8 : 9);
    const std::vector<double> costs = RandomCosts(rng, n);
    const std::vector<int> layers = RandomLayers(rng, n);
    const double opt = BruteForce(costs, k);
    const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " trial " << trial
                                      << " n " << n << " k " << k);
    EXPECT_LE(MakespanLowerBound(costs, k), opt + 1e-9 * total);
    // From LPT's plan, whose makespan is often above the optimum.
    const Plan lpt = PlanLpt(costs, k);
    lpt_missed += lpt.makespan > opt + 1e-9 * total;
    const Plan exact = PlanExact(costs, k, lpt, 1 << 30);
    ExpectValid(exact, costs, k);
    EXPECT_NEAR(exact.makespan, opt, 1e-9 * total);
    EXPECT_TRUE(exact.optimal);
    const Plan best = PlanBest(costs, layers, k);
    ExpectValid(best, costs, k);
    EXPECT_NEAR(best.makespan, opt, 1e-9 * total);
    EXPECT_TRUE(best.optimal);
  }
  EXPECT_GT(lpt_missed, 10) << "seed " << seed;
}

TEST(Planner, BestIsNeverWorseThanLptOrRefinedAndIsDeterministic) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    const size_t n = 1 + rng() % 300;
    const int k = 1 + rng() % 16;
    const std::vector<double> costs = RandomCosts(rng, n);
    const std::vector<int> layers =
        trial % 3 == 0 ? std::vector<int>() : RandomLayers(rng, n);
    const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " trial " << trial
                                      << " n " << n << " k " << k);
    const Plan best = PlanBest(costs, layers, k);
    ExpectValid(best, costs, k);
    EXPECT_LE(best.makespan, PlanLpt(costs, k).makespan + 1e-9 * total);
    EXPECT_LE(best.makespan, PlanRefined(costs, k).makespan + 1e-9 * total);
    EXPECT_GE(best.makespan, MakespanLowerBound(costs, k) - 1e-9 * total);
    const Plan again = PlanBest(costs, layers, k);
    EXPECT_EQ(again.executor_of, best.executor_of);
    EXPECT_EQ(again.predicted_load, best.predicted_load);
    EXPECT_EQ(again.optimal, best.optimal);
  }
}

TEST(Planner, LowerBoundIsExactForEqualCosts) {
  EXPECT_DOUBLE_EQ(MakespanLowerBound({2, 2, 2, 2, 2, 2, 2}, 3), 6);
  EXPECT_DOUBLE_EQ(MakespanLowerBound({5, 1, 1}, 2), 5);
  EXPECT_DOUBLE_EQ(MakespanLowerBound({3, 3, 3}, 2), 6);
  EXPECT_DOUBLE_EQ(MakespanLowerBound({}, 2), 0);
}

TEST(Planner, SpreadsEqualLayersOverDistinctExecutorsAtOptimalMakespan) {
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int k = 1; k <= 8; ++k) {
    for (int m = 1; m <= k; ++m) {
      for (int layers = 1; layers <= 12; ++layers) {
        for (const bool shuffled : {false, true}) {
          // L blocks of m equal matrices, in block order or shuffled.
          std::vector<int> layer;
          for (int l = 0; l < layers; ++l) layer.insert(layer.end(), m, l);
          if (shuffled) std::shuffle(layer.begin(), layer.end(), rng);
          const std::vector<double> costs(layer.size(), 3.0);
          SCOPED_TRACE(::testing::Message()
                       << "seed " << seed << " k " << k << " m " << m << " L "
                       << layers << (shuffled ? " shuffled" : ""));
          const Plan p = PlanBest(costs, layer, k);
          ExpectValid(p, costs, k);
          EXPECT_EQ(SameLayerPairs(p.executor_of, layer), 0);
          EXPECT_DOUBLE_EQ(p.makespan, 3.0 * ((layers * m + k - 1) / k));
          EXPECT_TRUE(p.optimal);
        }
      }
    }
  }
}

TEST(Planner, SpreadingNeverCostsMakespan) {
  // One big matrix and four small ones of one layer on two executors: the
  // optimum (4) keeps the layer together on executor 1, and so must we.
  const std::vector<double> costs = {4, 1, 1, 1, 1};
  const std::vector<int> layers = {0, 1, 1, 1, 1};
  const Plan p = PlanBest(costs, layers, 2);
  EXPECT_DOUBLE_EQ(p.makespan, 4);
  EXPECT_TRUE(p.optimal);
  EXPECT_EQ(p.executor_of, (std::vector<int>{0, 1, 1, 1, 1}));
  // Layer ids are any non-negative values; < 0 is none.
  const std::vector<double> eq(4, 1.0);
  EXPECT_EQ(SameLayerPairs(PlanBest(eq, {7, 1000, 7, 1000}, 2).executor_of,
                           {7, 1000, 7, 1000}),
            0);
  EXPECT_EQ(SameLayerPairs({0, 0, 0}, {-1, -1, 2}), 0);
  EXPECT_EQ(SameLayerPairs({0, 0, 0}, {2, -1, 2}), 1);
}

TEST(Planner, BudgetLimitedExactSearchReturnsAValidPlan) {
  // 40 distinct costs on 4 executors: the plans stay above the lower bound
  // (checked below), and 50 placements cannot finish the search.
  std::vector<double> costs;
  for (int i = 0; i < 40; ++i) costs.push_back(10 + std::sqrt(2.0 + i * 7.31));
  PlanOptions o;
  o.exact_node_budget = 50;
  const Plan lpt = PlanLpt(costs, 4);
  int64_t nodes = 0;
  const Plan exact = PlanExact(costs, 4, lpt, 50, &nodes);
  ExpectValid(exact, costs, 4);
  EXPECT_FALSE(exact.optimal);
  EXPECT_LE(exact.makespan, lpt.makespan);
  EXPECT_LE(nodes, 51);
  const Plan best = PlanBest(costs, {}, 4, o);
  ExpectValid(best, costs, 4);
  EXPECT_FALSE(best.optimal);
  EXPECT_LE(best.makespan, lpt.makespan);
  EXPECT_GT(best.makespan, MakespanLowerBound(costs, 4));
  // The same budget, the same plan.
  EXPECT_EQ(PlanBest(costs, {}, 4, o).executor_of, best.executor_of);
}

TEST(Planner, BestFixesLptsClassicMissAndProvesIt) {
  const Plan p = PlanBest({3, 3, 2, 2, 2}, {}, 2);
  EXPECT_DOUBLE_EQ(p.makespan, 6);
  EXPECT_TRUE(p.optimal);
  // 7 equal matrices on 3 executors: the bound (3) proves LPT's plan.
  EXPECT_TRUE(PlanBest(std::vector<double>(7, 1.0), {}, 3).optimal);
  // Nothing to plan.
  const Plan none = PlanBest({}, {}, 3);
  EXPECT_TRUE(none.executor_of.empty());
  EXPECT_EQ(none.predicted_load, (std::vector<double>{0, 0, 0}));
  EXPECT_TRUE(none.optimal);
}

TEST(Planner, PlanOnKeepsOptimality) {
  Plan p = PlanOn(PlanBest({3, 1, 2}, {}, 2), {0, 2}, 3);
  EXPECT_TRUE(p.optimal);
  EXPECT_DOUBLE_EQ(p.makespan, 3);
}

}  // namespace
}  // namespace dmuon::planner
