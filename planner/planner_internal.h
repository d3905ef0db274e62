// Helpers shared by planner.cc and planner_exact.cc (not a public API).

#ifndef DMUON_PLANNER_PLANNER_INTERNAL_H_
#define DMUON_PLANNER_PLANNER_INTERNAL_H_

#include <algorithm>
#include <numeric>
#include <vector>

#include "planner/planner.h"

namespace dmuon::planner::internal {

// Two makespans closer than this are equal: a relative 1e-12 of the total
// cost, far above the rounding of summing a table's costs in another order
// and far below any difference a plan could measurably make.
inline double Tolerance(const std::vector<double>& costs) {
  return 1e-12 * std::accumulate(costs.begin(), costs.end(), 0.0);
}

// Matrix indices in decreasing cost, ties by index.
inline std::vector<int> ByDecreasingCost(const std::vector<double>& costs) {
  std::vector<int> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return costs[a] > costs[b]; });
  return order;
}

// `p` with its loads summed afresh in index order and its makespan set, so
// that plans reached along different paths report comparable numbers.
inline Plan Finish(Plan p, const std::vector<double>& costs, int executors) {
  p.predicted_load.assign(std::max(1, executors), 0.0);
  for (size_t i = 0; i < costs.size(); ++i)
    p.predicted_load[p.executor_of[i]] += costs[i];
  p.makespan =
      *std::max_element(p.predicted_load.begin(), p.predicted_load.end());
  return p;
}

}  // namespace dmuon::planner::internal

#endif  // DMUON_PLANNER_PLANNER_INTERNAL_H_
