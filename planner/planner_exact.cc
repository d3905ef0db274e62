// PlanExact: branch-and-bound for the minimum makespan (planner.h).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "planner/planner.h"
#include "planner/planner_internal.h"

namespace dmuon::planner {
namespace {

using internal::ByDecreasingCost;
using internal::Finish;
using internal::Tolerance;

class BranchAndBound {
 public:
  BranchAndBound(const std::vector<double>& costs, int executors,
                 const Plan& incumbent, int64_t budget)
      : k_(executors),
        order_(ByDecreasingCost(costs)),
        budget_(budget),
        tol_(Tolerance(costs)),
        lower_(MakespanLowerBound(costs, executors)),
        best_(Finish(incumbent, costs, executors)),
        load_(executors, 0.0),
        at_(order_.size(), 0),
        tried_(order_.size() * executors, 0) {
    for (int i : order_) c_.push_back(costs[i]);
    remaining_.assign(c_.size() + 1, 0.0);
    for (size_t d = c_.size(); d-- > 0;)
      remaining_[d] = remaining_[d + 1] + c_[d];
  }

  Plan Run(int64_t* nodes) {
    bool finished = true;
    if (best_.makespan > lower_ + tol_) {
      target_ = best_.makespan - tol_;
      finished = Search(0);
    }
    if (nodes) *nodes = nodes_;
    best_.optimal = finished;
    return best_;
  }

 private:
  // Places matrices d.. (in decreasing cost) so that every load stays below
  // target_. False when the budget ran out; the search then stops.
  bool Search(size_t d) {
    if (d == c_.size()) {  // every load < target_: a better plan
      for (size_t x = 0; x < c_.size(); ++x)
        best_.executor_of[order_[x]] = at_[x];
      double mk = 0;
      for (int e = 0; e < k_; ++e) mk = std::max(mk, load_[e]);
      best_.predicted_load = load_;
      best_.makespan = mk;
      target_ = mk - tol_;
      done_ = mk <= lower_ + tol_;
      return true;
    }
    // What is left must fit the room below target_ on the executors that
    // can still take the smallest matrix (the last in this order).
    double room = 0;
    for (int e = 0; e < k_; ++e)
      if (target_ - load_[e] > c_.back()) room += target_ - load_[e];
    if (remaining_[d] >= room) return true;
    // Executors by increasing load, ties by index; equal loads are
    // interchangeable, so only the first of them is tried.
    int* ex = &tried_[d * k_];
    if (d == 0) {
      for (int e = 0; e < k_; ++e) ex[e] = e;
    } else {  // the parent's order, one load raised: insertion sort is O(k)
      std::copy(ex - k_, ex, ex);
    }
    auto before = [&](int a, int b) {
      return load_[a] < load_[b] || (load_[a] == load_[b] && a < b);
    };
    for (int x = 1; x < k_; ++x) {
      const int e = ex[x];
      int y = x;
      for (; y > 0 && before(e, ex[y - 1]); --y) ex[y] = ex[y - 1];
      ex[y] = e;
    }
    for (int x = 0; x < k_; ++x) {
      const int e = ex[x];
      if (x > 0 && load_[e] == load_[ex[x - 1]]) continue;
      const double was = load_[e];
      if (was + c_[d] >= target_) break;  // and every later one
      if (++nodes_ > budget_) return false;
      load_[e] = was + c_[d];
      at_[d] = e;
      const bool ok = Search(d + 1);
      load_[e] = was;
      if (!ok) return false;
      if (done_) return true;
      // target_ may have dropped below this executor's next candidates.
    }
    return true;
  }

  const int k_;
  const std::vector<int> order_;  // matrix of each depth
  const int64_t budget_;
  const double tol_, lower_;
  std::vector<double> c_;          // cost of each depth
  std::vector<double> remaining_;  // sum of c_[d..]
  Plan best_;
  double target_ = 0;  // a better plan keeps every load below this
  bool done_ = false;  // best_ meets the lower bound
  int64_t nodes_ = 0;
  std::vector<double> load_;
  std::vector<int> at_;     // executor of each depth
  std::vector<int> tried_;  // per depth: executors in the order tried
};

}  // namespace

Plan PlanExact(const std::vector<double>& costs, int executors,
               const Plan& incumbent, int64_t node_budget, int64_t* nodes) {
  const int k = std::max(1, executors);
  if (costs.empty()) {
    Plan p = Finish(incumbent, costs, k);
    p.optimal = true;
    if (nodes) *nodes = 0;
    return p;
  }
  return BranchAndBound(costs, k, incumbent, node_budget).Run(nodes);
}

}  // namespace dmuon::planner
