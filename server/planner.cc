#include "server/planner.h"

#include <algorithm>
#include <numeric>

namespace dmuon::server {

Plan PlanLpt(const std::vector<double>& costs, int executors) {
  Plan p;
  executors = std::max(1, executors);
  p.executor_of.assign(costs.size(), 0);
  p.predicted_load.assign(executors, 0.0);
  std::vector<size_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  for (size_t i : order) {
    const int e = static_cast<int>(
        std::min_element(p.predicted_load.begin(), p.predicted_load.end()) -
        p.predicted_load.begin());
    p.executor_of[i] = e;
    p.predicted_load[e] += costs[i];
  }
  p.makespan =
      *std::max_element(p.predicted_load.begin(), p.predicted_load.end());
  return p;
}

}  // namespace dmuon::server
