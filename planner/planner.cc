#include "planner/planner.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>

#include "planner/planner_internal.h"

namespace dmuon::planner {
namespace {

using internal::ByDecreasingCost;
using internal::Finish;
using internal::Tolerance;

// Layers renumbered 0..L-1 in first-appearance order (< 0 stays -1), so
// per-executor counts fit a k x L table whatever ids the caller used.
std::vector<int> DenseLayers(const std::vector<int>& layers, size_t n,
                             int* count) {
  std::vector<int> out(n, -1);
  std::map<int, int> id;
  for (size_t i = 0; i < n && i < layers.size(); ++i) {
    if (layers[i] < 0) continue;
    out[i] = id.emplace(layers[i], static_cast<int>(id.size())).first->second;
  }
  *count = static_cast<int>(id.size());
  return out;
}

// Changes each phase of the local search makes at most.
constexpr int kRounds = 1000;

// The local search of PlanBest over one plan: matrices move between
// executors, loads and per-(executor, layer) counts follow. Every accepted
// change lowers (makespan, executors at the makespan) or, in the second
// phase, the same-layer pairs without any load exceeding the makespan; the
// first acceptable change of the best value wins (matrix index, then
// executor, then the swapped matrix's index), so the search is
// deterministic.
class LayerSearch {
 public:
  LayerSearch(const std::vector<double>& costs, const std::vector<int>& layer,
              int layers, const Plan& start)
      : c_(costs),
        layer_(layer),
        n_(static_cast<int>(costs.size())),
        nl_(std::max(1, layers)),
        k_(static_cast<int>(start.predicted_load.size())),
        tol_(Tolerance(costs)),
        owner_(start.executor_of),
        load_(start.predicted_load),
        count_(static_cast<size_t>(k_) * nl_, 0),
        on_(k_) {
    for (int i = 0; i < n_; ++i)
      if (layer_[i] >= 0) ++count(owner_[i], layer_[i]);
  }

  // Moves or swaps out of the (first) most loaded executor whose new pair
  // maximum is below the makespan: each removes one executor from the
  // makespan, or lowers it. Smallest pair maximum first, then fewest pairs.
  void DescendMakespan(int rounds) {
    for (int round = 0; round < rounds; ++round) {
      const int hi = static_cast<int>(
          std::max_element(load_.begin(), load_.end()) - load_.begin());
      const double top = load_[hi];
      Change best;
      for (auto& v : on_) v.clear();
      for (int i = 0; i < n_; ++i) on_[owner_[i]].push_back(i);
      for (int i : on_[hi]) {
        for (int e = 0; e < k_; ++e) {
          if (e == hi) continue;
          Consider(&best, top, i, -1, e);
          for (int j : on_[e])
            if (c_[j] < c_[i]) Consider(&best, top, i, j, e);
        }
      }
      if (best.i < 0) return;
      Apply(best);
    }
  }

  // Moves or swaps of a matrix sharing its executor with its layer that
  // lower the same-layer pairs, keeping every load at most the makespan.
  // Most pairs removed first.
  void DescendPairs(int rounds) {
    const double cap = *std::max_element(load_.begin(), load_.end());
    for (int round = 0; round < rounds; ++round) {
      Change best;
      best.pairs = 0;  // only strict decreases
      for (int i = 0; i < n_; ++i) {
        const int li = layer_[i], a = owner_[i];
        if (li < 0 || count(a, li) < 2) continue;
        for (int e = 0; e < k_; ++e) {
          const double le = load_[e] + c_[i];
          if (e == a || le > cap) continue;
          const int d = count(e, li) - (count(a, li) - 1);
          if (d < best.pairs) best = {i, -1, e, load_[a] - c_[i], le, d};
        }
        for (int j = 0; j < n_; ++j) {
          const int e = owner_[j];
          if (e == a || layer_[j] == li) continue;
          const double la = load_[a] - c_[i] + c_[j];
          const double le = load_[e] - c_[j] + c_[i];
          if (la > cap || le > cap) continue;
          const int d = SwapPairs(i, j, a, e);
          if (d < best.pairs) best = {i, j, e, la, le, d};
        }
      }
      if (best.i < 0) return;
      Apply(best);
    }
  }

  Plan Result() const {
    Plan p;
    p.executor_of = owner_;
    return Finish(std::move(p), c_, k_);
  }

 private:
  // Matrix i to executor `to`, and matrix j (if >= 0) back to i's.
  struct Change {
    int i = -1, j = -1, to = -1;
    double from_load = 0, to_load = 0;  // the two loads after the change
    int pairs = std::numeric_limits<int>::max();  // change in same-layer pairs
  };

  int& count(int e, int l) { return count_[static_cast<size_t>(e) * nl_ + l]; }
  int count(int e, int l) const {
    return count_[static_cast<size_t>(e) * nl_ + l];
  }

  // Same-layer pairs gained by i (on a) to e and j (on e) to a.
  int SwapPairs(int i, int j, int a, int e) const {
    const int li = layer_[i], lj = layer_[j];
    if (li == lj) return 0;
    int d = 0;
    if (li >= 0) d += count(e, li) - (count(a, li) - 1);
    if (lj >= 0) d += count(a, lj) - (count(e, lj) - 1);
    return d;
  }

  void Consider(Change* best, double top, int i, int j, int e) {
    const int a = owner_[i];
    const double la = j < 0 ? load_[a] - c_[i] : load_[a] - c_[i] + c_[j];
    const double le = j < 0 ? load_[e] + c_[i] : load_[e] - c_[j] + c_[i];
    const double pair = std::max(la, le);
    if (pair >= top - tol_) return;
    const int d =
        j < 0
            ? (layer_[i] < 0 ? 0
                             : count(e, layer_[i]) - (count(a, layer_[i]) - 1))
            : SwapPairs(i, j, a, e);
    const double was =
        best->i < 0 ? top : std::max(best->from_load, best->to_load);
    if (best->i < 0 || pair < was || (pair == was && d < best->pairs))
      *best = {i, j, e, la, le, d};
  }

  void Apply(const Change& ch) {
    const int a = owner_[ch.i];
    if (const int l = layer_[ch.i]; l >= 0) {
      --count(a, l);
      ++count(ch.to, l);
    }
    owner_[ch.i] = ch.to;
    if (ch.j >= 0) {
      if (const int l = layer_[ch.j]; l >= 0) {
        --count(ch.to, l);
        ++count(a, l);
      }
      owner_[ch.j] = a;
    }
    load_[a] = ch.from_load;
    load_[ch.to] = ch.to_load;
  }

  const std::vector<double>& c_;
  const std::vector<int>& layer_;
  const int n_, nl_, k_;
  const double tol_;
  std::vector<int> owner_;
  std::vector<double> load_;
  std::vector<int> count_;  // [executor][layer]: matrices of the layer there
  std::vector<std::vector<int>> on_;  // matrices on each executor, ascending
};

Plan Improve(const std::vector<double>& costs, const std::vector<int>& layer,
             int layers, const Plan& start) {
  LayerSearch s(costs, layer, layers, start);
  s.DescendMakespan(kRounds);
  s.DescendPairs(kRounds);
  return s.Result();
}

// (makespan, same-layer pairs), makespans within the tolerance being equal.
bool Better(const Plan& a, const Plan& b, const std::vector<int>& layer,
            double tol) {
  if (a.makespan < b.makespan - tol) return true;
  if (b.makespan < a.makespan - tol) return false;
  return SameLayerPairs(a.executor_of, layer) <
         SameLayerPairs(b.executor_of, layer);
}

}  // namespace

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
  out.optimal = p.optimal;
  return out;
}

int64_t SameLayerPairs(const std::vector<int>& executor_of,
                       const std::vector<int>& layers) {
  std::map<std::pair<int, int>, int64_t> n;  // (executor, layer) -> matrices
  for (size_t i = 0; i < executor_of.size() && i < layers.size(); ++i)
    if (layers[i] >= 0) ++n[{executor_of[i], layers[i]}];
  int64_t pairs = 0;
  for (const auto& [key, m] : n) pairs += m * (m - 1) / 2;
  return pairs;
}

double MakespanLowerBound(const std::vector<double>& costs, int executors) {
  if (costs.empty()) return 0;
  const int64_t k = std::max(1, executors);
  std::vector<double> s(costs);
  std::sort(s.begin(), s.end(), std::greater<double>());
  std::vector<double> prefix(s.size() + 1, 0.0);
  for (size_t j = 0; j < s.size(); ++j) prefix[j + 1] = prefix[j] + s[j];
  double lb = std::max(s[0], prefix.back() / static_cast<double>(k));
  for (int64_t j = k + 1; j <= static_cast<int64_t>(s.size()); ++j) {
    const int64_t m = (j + k - 1) / k;  // of the j largest, on one executor
    lb = std::max(lb, prefix[j] - prefix[j - m]);
  }
  return lb;
}

Plan PlanSpreadLpt(const std::vector<double>& costs,
                   const std::vector<int>& layers, int executors) {
  const int k = std::max(1, executors);
  int nl = 0;
  const std::vector<int> layer = DenseLayers(layers, costs.size(), &nl);
  std::vector<char> holds(static_cast<size_t>(k) * std::max(1, nl), 0);
  Plan p;
  p.executor_of.assign(costs.size(), 0);
  p.predicted_load.assign(k, 0.0);
  for (int i : ByDecreasingCost(costs)) {
    int least = 0, free = -1;
    for (int e = 0; e < k; ++e) {
      if (p.predicted_load[e] < p.predicted_load[least]) least = e;
      if (layer[i] >= 0 && !holds[static_cast<size_t>(e) * nl + layer[i]] &&
          (free < 0 || p.predicted_load[e] < p.predicted_load[free]))
        free = e;
    }
    // A layer-free executor may be up to one matrix's cost busier: spreading
    // is worth that much, and the searches after this win back the makespan.
    const int e =
        free >= 0 &&
                p.predicted_load[free] - p.predicted_load[least] <= costs[i]
            ? free
            : least;
    p.executor_of[i] = e;
    p.predicted_load[e] += costs[i];
    if (layer[i] >= 0) holds[static_cast<size_t>(e) * nl + layer[i]] = 1;
  }
  return Finish(std::move(p), costs, k);
}

Plan PlanBest(const std::vector<double>& costs, const std::vector<int>& layers,
              int executors, const PlanOptions& options) {
  const int k = std::max(1, executors);
  const double tol = Tolerance(costs);
  int nl = 0;
  const std::vector<int> layer = DenseLayers(layers, costs.size(), &nl);
  Plan best = Improve(costs, layer, nl, PlanSpreadLpt(costs, layer, k));
  // The second start: its spreading search (the costly part on big tables)
  // only where it can win.
  LayerSearch second(costs, layer, nl, PlanRefined(costs, k));
  second.DescendMakespan(kRounds);
  if (const double m = second.Result().makespan;
      m < best.makespan - tol ||
      (m <= best.makespan + tol &&
       SameLayerPairs(best.executor_of, layer) > 0)) {
    second.DescendPairs(kRounds);
    if (Plan r = second.Result(); Better(r, best, layer, tol))
      best = std::move(r);
  }
  if (best.makespan <= MakespanLowerBound(costs, k) + tol) {
    best.optimal = true;
  } else if (static_cast<int64_t>(costs.size()) <= options.exact_max_matrices) {
    Plan exact = PlanExact(costs, k, best, options.exact_node_budget);
    const bool optimal = exact.optimal;
    if (exact.makespan < best.makespan - tol) {
      // Keep the exact makespan; spread what that makespan allows.
      best = Improve(costs, layer, nl, exact);
    }
    best.optimal = optimal;
  }
  return best;
}

}  // namespace dmuon::planner
