// Planner: assigns matrices to executors so the per-step makespan is small.
// LPT (longest processing time first onto the least-loaded executor) over
// per-matrix costs, ties broken by index so every process that plans the
// same table gets the same assignment.

#ifndef DMUON_SERVER_PLANNER_H_
#define DMUON_SERVER_PLANNER_H_

#include <vector>

namespace dmuon::server {

struct Plan {
  std::vector<int> executor_of;        // by matrix index
  std::vector<double> predicted_load;  // summed cost per executor
  double makespan = 0;
};

// `costs[i]` > 0 (seconds or flops: any consistent unit); executors >= 1.
Plan PlanLpt(const std::vector<double>& costs, int executors);

// LPT, then a deterministic local search: move one matrix, or swap two,
// between the most loaded executor and another whenever that lowers the
// makespan, until nothing does (at most `rounds` improvements). Never worse
// than LPT; same input, same plan.
Plan PlanRefined(const std::vector<double>& costs, int executors,
                 int rounds = 1000);

// `p` planned over indices.size() executors, moved onto executors
// `indices` (ascending, each < total) of `total`: executor k of `p` becomes
// indices[k]; the others get no load.
Plan PlanOn(const Plan& p, const std::vector<int>& indices, int total);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_PLANNER_H_
