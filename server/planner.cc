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

Plan PlanRefined(const std::vector<double>& costs, int executors, int rounds) {
  Plan p = PlanLpt(costs, executors);
  const int k = static_cast<int>(p.predicted_load.size());
  auto argmax = [&] {
    return static_cast<int>(
        std::max_element(p.predicted_load.begin(), p.predicted_load.end()) -
        p.predicted_load.begin());
  };
  for (int round = 0; round < rounds; ++round) {
    const int hi = argmax();
    const double top = p.predicted_load[hi];
    // The best single move or swap out of `hi`, judged by the new pair max.
    double best = top;
    int bi = -1, bj = -1, bto = -1;
    for (size_t i = 0; i < costs.size(); ++i) {
      if (p.executor_of[i] != hi) continue;
      for (int e = 0; e < k; ++e) {
        if (e == hi) continue;
        const double moved =
            std::max(top - costs[i], p.predicted_load[e] + costs[i]);
        if (moved < best - 1e-12)
          best = moved, bi = static_cast<int>(i), bj = -1, bto = e;
        for (size_t j = 0; j < costs.size(); ++j) {
          if (p.executor_of[j] != e) continue;
          const double d = costs[i] - costs[j];
          if (d <= 0) continue;
          const double swapped = std::max(top - d, p.predicted_load[e] + d);
          if (swapped < best - 1e-12) {
            best = swapped, bi = static_cast<int>(i), bj = static_cast<int>(j),
            bto = e;
          }
        }
      }
    }
    if (bi < 0) break;
    p.executor_of[bi] = bto;
    p.predicted_load[hi] -= costs[bi];
    p.predicted_load[bto] += costs[bi];
    if (bj >= 0) {
      p.executor_of[bj] = hi;
      p.predicted_load[bto] -= costs[bj];
      p.predicted_load[hi] += costs[bj];
    }
    // A change that only moved the maximum elsewhere can still lower it.
    if (*std::max_element(p.predicted_load.begin(), p.predicted_load.end()) >=
        top - 1e-12)
      break;
  }
  p.makespan =
      *std::max_element(p.predicted_load.begin(), p.predicted_load.end());
  return p;
}

Plan PlanOn(const Plan& p, const std::vector<int>& indices, int total) {
  Plan out;
  out.predicted_load.assign(std::max(1, total), 0.0);
  out.executor_of.reserve(p.executor_of.size());
  for (int k : p.executor_of) out.executor_of.push_back(indices[k]);
  for (size_t k = 0; k < p.predicted_load.size() && k < indices.size(); ++k)
    out.predicted_load[indices[k]] = p.predicted_load[k];
  out.makespan = p.makespan;
  return out;
}

}  // namespace dmuon::server
