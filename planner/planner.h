// Planner: assigns matrices to executors (devices of a daemon, or daemons of
// a pool) so the per-step makespan — the load of the most loaded executor —
// is small. Every function is deterministic: ties are broken by index and no
// clock, randomness or address enters, so every process that plans the same
// table with the same costs gets the same assignment (a pool's clients rely
// on this: each computes the split on its own).
//
// PlanBest is the planner the daemon and the pool use:
//   1. LPT with same-layer spreading (PlanSpreadLpt), and PlanRefined (LPT +
//      move/swap search) as a second start;
//   2. on each, a local search with the lexicographic objective (makespan,
//      then same-layer pairs sharing an executor) that never raises the
//      makespan; the better of the two is kept (ties: the spread start);
//   3. where the table has at most PlanOptions::exact_max_matrices matrices
//      (kExactMaxMatrices = 64) and the plan is not already at the lower
//      bound, a branch-and-bound over assignments (PlanExact) minimizing the
//      makespan, within a node budget (kExactNodeBudget = 200,000
//      placements: a few tens of milliseconds of one core at worst); its
//      plan, if better, gets the same spreading search.
//
// Layers. A "layer" groups matrices the next forward needs at the same time
// (e.g. the attention and MLP matrices of one transformer block). Spreading
// a layer over executors lets its updates come back in parallel, so the
// trainer's per-module forward pre-hooks wait for one matrix's time rather
// than a whole layer's. Spreading is secondary: PlanBest never trades
// makespan for it (fewer same-layer pairs win only at an equal makespan).

#ifndef DMUON_PLANNER_PLANNER_H_
#define DMUON_PLANNER_PLANNER_H_

#include <cstdint>
#include <vector>

namespace dmuon::planner {

struct Plan {
  std::vector<int> executor_of;        // by matrix index
  std::vector<double> predicted_load;  // summed cost per executor
  double makespan = 0;
  // Set by PlanBest and PlanExact only: the makespan is proven minimal (up
  // to a relative 1e-12 of the total cost), because the exact search
  // finished or the makespan equals MakespanLowerBound.
  bool optimal = false;
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

// --- Layers and the best plan ---

// `layers[i]`: matrix i's layer, any value >= 0; < 0: none (the matrix is
// placed by cost alone). An empty vector means no matrix has a layer;
// otherwise it has costs.size() entries.

// Pairs of matrices of one layer on one executor: the spreading objective
// (0 = every layer's matrices are on distinct executors).
int64_t SameLayerPairs(const std::vector<int>& executor_of,
                       const std::vector<int>& layers);

// A lower bound on any plan's makespan: the largest cost, the average load,
// and for each j, the ceil(j / executors) smallest of the j largest costs
// (some executor holds that many of them). Exact for equal costs.
double MakespanLowerBound(const std::vector<double>& costs, int executors);

// LPT with same-layer spreading: matrices in decreasing cost (ties by
// index); each goes to the least-loaded executor holding no matrix of its
// layer, unless that executor's load exceeds the least-loaded executor's by
// more than the matrix's own cost, in which case (and for matrices without
// a layer) to the least-loaded one. Load ties go to the lower index.
Plan PlanSpreadLpt(const std::vector<double>& costs,
                   const std::vector<int>& layers, int executors);

// Branch-and-bound for the minimum makespan, ignoring layers: matrices in
// decreasing cost (ties by index), each tried on the executors in
// increasing load (ties by index), skipping an executor whose load equals
// one already tried (symmetry), pruning a branch that cannot beat the
// incumbent (an executor overflowing it; the remaining cost exceeding the
// room left on executors that can still take the smallest matrix). Starts
// from `incumbent` (a plan of these costs over `executors`); returns the
// best plan found, `optimal` when the search finished within `node_budget`
// placements or hit MakespanLowerBound. `nodes`, if given, receives the
// placements tried.
Plan PlanExact(const std::vector<double>& costs, int executors,
               const Plan& incumbent, int64_t node_budget,
               int64_t* nodes = nullptr);

inline constexpr int kExactMaxMatrices = 64;
inline constexpr int64_t kExactNodeBudget = 200000;

struct PlanOptions {
  // The exact search runs only on tables of at most this many matrices.
  int exact_max_matrices = kExactMaxMatrices;
  int64_t exact_node_budget = kExactNodeBudget;
};

// The planner of the daemon and the pool (see the top of this file).
// Guarantees: makespan <= PlanRefined's <= PlanLpt's (up to a relative
// 1e-12 of the total cost); same-layer pairs locally minimal at that
// makespan (no single move or swap lowers them without a load exceeding
// it; not a global minimum); `optimal` when the makespan is proven minimal.
// Same input, same plan.
Plan PlanBest(const std::vector<double>& costs, const std::vector<int>& layers,
              int executors, const PlanOptions& options = {});

}  // namespace dmuon::planner

#endif  // DMUON_PLANNER_PLANNER_H_
