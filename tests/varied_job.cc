#include "tests/varied_job.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace dmuon::testing {

double ScheduleGain(const kernels::Schedule& schedule) {
  double gain = 0;
  for (int i = 0; i <= 4000; ++i) {
    double x = i / 4000.0 / schedule.norm_safety, d = 1 / schedule.norm_safety;
    for (const kernels::StepCoefficients& c : schedule.steps) {
      const double x2 = x * x;
      d *= c.a + 3 * c.b * x2 + 5 * c.c * x2 * x2;
      x = c.a * x + c.b * x2 * x + c.c * x2 * x2 * x;
    }
    gain = std::max(gain, std::fabs(d));
  }
  return gain;
}

VariedJob MakeVariedJob(const std::string& id, uint64_t seed, int params,
                        int world) {
  VariedJob job;
  job.id = id;
  job.seed = seed;
  job.world = world;
  // 0: torch's defaults. 1: Polar Express through the Gram formulation,
  // Moonlight's lr scale. 2: "You", no Nesterov, momentum 0.9, Bernstein's
  // scale. 3: a custom schedule (3 classic steps, 2 of the convergent
  // quintic (15 s - 10 s^3 + 3 s^5) / 8), method picked by the daemon.
  job.groups.resize(4);
  job.groups[1].schedule = "polar_express";
  job.groups[1].method = "gram";
  job.groups[1].adjust_lr_fn = "match_rms_adamw";
  job.groups[2].schedule = "you";
  job.groups[2].nesterov = false;
  job.groups[2].momentum = 0.9;
  job.groups[2].adjust_lr_fn = "spectral_unclamped";
  job.groups[3].schedule = "custom";
  job.groups[3].coefficients = {{3.4445, -4.7750, 2.0315},
                                {3.4445, -4.7750, 2.0315},
                                {3.4445, -4.7750, 2.0315},
                                {1.875, -1.25, 0.375},
                                {1.875, -1.25, 0.375}};
  job.groups[3].method = "auto";
  for (const GroupSpec& g : job.groups)
    job.tolerance.push_back(
        std::max(1e-4, 1.2e-6 * ScheduleGain(NsOptionsOf(g).schedule)));
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int64_t> v) {
    return *(v.begin() + rng() % v.size());
  };
  for (int p = 0; p < params; ++p) {
    ParamSpec s;
    s.name = "p" + std::to_string(p);
    switch (p % 4) {
      case 0:  // tall
        s.rows = pick({64, 96, 128, 160});
        s.cols = pick({3, 8, 16, 24});
        break;
      case 1:  // wide
        s.rows = pick({3, 8, 16, 24});
        s.cols = pick({64, 96, 128, 160});
        break;
      case 2:  // square
        s.rows = s.cols = pick({8, 16, 24, 32, 48, 64});
        break;
      default:  // tiny, 1x1 among them
        s.rows = pick({1, 1, 2, 3, 4});
        s.cols = pick({1, 2, 3, 5});
        break;
    }
    s.group = (p / 4) % 4;
    s.forward_order = p;
    s.layer = p / 8;
    if (world > 1) {
      switch (p % 3) {
        case 0:
          s.sharding = Sharding::kReplicated;
          break;
        case 1:
          s.sharding =
              s.rows >= world ? Sharding::kRows : Sharding::kReplicated;
          break;
        default:
          s.sharding = Sharding::kUnreduced;
          break;
      }
    }
    job.table.push_back(s);
  }
  return job;
}

double VariedTolerance(const VariedJob& job, int p) {
  return job.tolerance.at(job.table[p].group);
}

SessionSpec VariedSpec(const VariedJob& job, int rank,
                       TransportChoice transport) {
  SessionSpec spec;
  spec.job_id = job.id;
  spec.rank = rank;
  spec.world_size = job.world;
  spec.params = job.table;
  spec.groups = job.groups;
  spec.transport = transport;
  for (ParamSpec& p : spec.params) {
    if (p.sharding != Sharding::kRows) continue;
    p.row_begin = p.rows * rank / job.world;
    p.row_end = p.rows * (rank + 1) / job.world;
  }
  return spec;
}

Reference VariedReference(const VariedJob& job) {
  return Reference(job.seed, job.world, job.table, job.groups);
}

absl::StatusOr<StepCheck> RunVariedStep(
    Session& session, const VariedJob& job, const SessionSpec& spec,
    const std::function<std::vector<std::vector<double>>()>& want,
    const std::function<void(int)>& before) {
  const int64_t step = session.step();
  const int n = static_cast<int>(spec.params.size());
  for (int p = n - 1; p >= 0; --p) {
    auto g = View(Gradient(job.seed, step, p, spec.rank, job.table[p]),
                  spec.params[p]);
    auto dst = session.gradient(p);
    std::copy(g.begin(), g.end(), dst.begin());
    if (before) before(p);
    if (auto st = session.GradientReady(p); !st.ok()) return st;
  }
  const std::vector<std::vector<double>> expected = want();
  StepCheck check;
  for (int p = 0; p < n; ++p) {
    if (auto st = session.WaitUpdate(p); !st.ok()) return st;
    auto u = session.update(p);
    // Relative to the whole matrix: a rank's rows may hold little of it.
    const std::vector<double> mine = View(expected[p], spec.params[p]);
    double num = 0, den = 0;
    for (size_t i = 0; i < mine.size() && i < u.size(); ++i)
      num += (u[i] - mine[i]) * (u[i] - mine[i]);
    for (double x : expected[p]) den += x * x;
    const double err = u.size() == mine.size() && std::isfinite(num)
                           ? std::sqrt(num / den)
                           : INFINITY;
    ++check.checked;
    if (!(err <= VariedTolerance(job, p))) {
      if (check.mismatches++ == 0) {
        const ParamSpec& s = spec.params[p];
        check.first = "job " + job.id + " rank " + std::to_string(spec.rank) +
                      " step " + std::to_string(step) + " " + s.name + " [" +
                      std::to_string(s.rows) + "," + std::to_string(s.cols) +
                      "] group " + std::to_string(s.group) +
                      ": relative error " + std::to_string(err);
      }
    }
  }
  if (auto st = session.FinishStep(); !st.ok()) return st;
  return check;
}

}  // namespace dmuon::testing
