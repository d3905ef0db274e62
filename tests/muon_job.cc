#include "tests/muon_job.h"

#include <cmath>
#include <random>

#include "kernels/kernels.h"
#include "kernels/testing/oracle.h"

namespace dmuon::testing {

std::vector<ParamSpec> TestTable(int rank, int world) {
  std::vector<ParamSpec> t = {
      {"embed_proj", 48, 64, Sharding::kReplicated, 0, 0, 0, 0},
      {"attn.qkv", 96, 48, Sharding::kRows, 0, 0, 1, 0},
      {"mlp.up", 64, 128, Sharding::kUnreduced, 0, 0, 2, 0},
      {"mlp.down", 128, 64, Sharding::kRows, 0, 0, 3, 0},
      {"attn.out", 48, 64, Sharding::kReplicated, 0, 0, 4,
       0},  // same shape: batched
  };
  for (ParamSpec& p : t) {
    if (p.sharding != Sharding::kRows) continue;
    p.row_begin = p.rows * rank / world;
    p.row_end = p.rows * (rank + 1) / world;
  }
  return t;
}

std::vector<float> Gradient(uint64_t seed, int64_t step, int p, int rank,
                            int world) {
  return Gradient(seed, step, p, rank, TestTable(0, world)[p]);
}

std::vector<float> Gradient(uint64_t seed, int64_t step, int p, int rank,
                            const ParamSpec& spec) {
  const int who = spec.sharding == Sharding::kUnreduced ? rank : 0;
  std::mt19937_64 rng(seed * 1000003 + step * 10007 + p * 101 + who);
  std::normal_distribution<float> d;
  std::vector<float> g(spec.rows * spec.cols);
  for (float& x : g) x = d(rng);
  return g;
}

kernels::NsOptions NsOptionsOf(const GroupSpec& group) {
  kernels::NsOptions ns;
  ns.eps = group.eps;
  if (group.schedule == "custom") {
    std::vector<kernels::StepCoefficients> c;
    for (const auto& abc : group.coefficients)
      c.push_back({abc[0], abc[1], abc[2]});
    ns.schedule = *kernels::CustomSchedule(c);
  } else {
    ns.schedule = *kernels::ScheduleByName(group.schedule, group.ns_steps);
  }
  return ns;
}

Reference::Reference(uint64_t seed, int world)
    : Reference(seed, world, TestTable(0, world)) {}

Reference::Reference(uint64_t seed, int world, std::vector<ParamSpec> table,
                     std::vector<GroupSpec> groups)
    : seed_(seed),
      world_(world),
      table_(std::move(table)),
      groups_(std::move(groups)) {
  if (groups_.empty()) groups_.emplace_back();
  momentum_.resize(table_.size());
  scale_.resize(table_.size());
}

std::vector<double> Reference::MomentumStep(int64_t step, size_t p) {
  const ParamSpec& s = table_[p];
  const GroupSpec& group = groups_.at(s.group);
  std::vector<double> g(s.rows * s.cols, 0.0);
  if (s.sharding == Sharding::kUnreduced) {
    for (int r = 0; r < world_; ++r) {
      auto gr = Gradient(seed_, step, p, r, s);
      for (size_t i = 0; i < g.size(); ++i) g[i] += gr[i];
    }
    for (double& x : g) x /= world_;
  } else {
    auto g0 = Gradient(seed_, step, p, 0, s);
    g.assign(g0.begin(), g0.end());
  }
  auto& m = momentum_[p];
  auto& a = scale_[p];
  if (m.empty()) m.assign(g.size(), 0.0);
  if (a.empty()) a.assign(g.size(), 0.0);
  const double mu = group.momentum;
  std::vector<double> u(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    m[i] = mu * m[i] + (1 - mu) * g[i];
    a[i] = mu * a[i] + (1 - mu) * std::abs(g[i]);
    u[i] = group.nesterov ? (1 - mu) * g[i] + mu * m[i] : m[i];
  }
  return u;
}

void Reference::Advance(int64_t step) {
  for (size_t p = 0; p < table_.size(); ++p) MomentumStep(step, p);
  completed_ = step;
}

std::vector<std::vector<double>> Reference::Step(int64_t step) {
  std::vector<std::vector<double>> out;
  for (size_t p = 0; p < table_.size(); ++p) {
    const ParamSpec& s = table_[p];
    const GroupSpec& group = groups_.at(s.group);
    const std::vector<double> u = MomentumStep(step, p);
    const kernels::NsOptions ns = NsOptionsOf(group);
    auto o = kernels::testing::SvdOracle(u, {s.rows, s.cols}, ns);
    const double scale = kernels::LrScale(
        *kernels::ParseLrAdjust(group.adjust_lr_fn), {s.rows, s.cols});
    for (double& x : o) x *= scale;
    out.push_back(std::move(o));
  }
  completed_ = step;
  return out;
}

double ScaledError(const std::vector<float>& got,
                   const std::vector<double>& want,
                   const std::vector<double>& scale) {
  if (got.size() != want.size() || scale.size() != want.size()) {
    return INFINITY;
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += scale[i] * scale[i];
  }
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

double RelativeError(const std::vector<float>& got,
                     const std::vector<double>& want) {
  return ScaledError(got, want, want);
}

}  // namespace dmuon::testing
