// Jobs of varied shapes for the soak and fault tests (tests/soak_test.cc,
// tests/fault_test.cc, tests/fault_client.cc): a table of tall, wide, square
// and tiny matrices (1x1 included), mixed shardings when the job has several
// ranks, and four hyperparameter groups (classic, Polar Express with Gram,
// "You" without Nesterov, a custom schedule), all drawn from the job's seed
// so every rank and the test that checks it build the same job. Updates are
// checked against tests/muon_job.h's fp64 Reference.

#ifndef DMUON_TESTS_VARIED_JOB_H_
#define DMUON_TESTS_VARIED_JOB_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "tests/muon_job.h"

namespace dmuon::testing {

struct VariedJob {
  std::string id;
  uint64_t seed = 1;
  int world = 1;
  std::vector<ParamSpec> table;  // whole matrices (row ranges unset)
  std::vector<GroupSpec> groups;
  std::vector<double> tolerance;  // by group (VariedTolerance)
};

// `params` parameters, shapes cycling tall, wide, square, tiny.
VariedJob MakeVariedJob(const std::string& id, uint64_t seed, int params,
                        int world);

// The error allowed for parameter `p`'s updates: ||got - want|| / ||want||
// (Frobenius; for a rank's rows of a row-sharded parameter, over the whole
// matrix's ||want||) at most max(1e-4, 1.2e-6 * G), G the largest slope of
// the group's composite Newton–Schulz polynomial on [0, 1] (ScheduleGain:
// 485 for the classic 5 steps, about 1000 for Polar Express). Why: the
// daemon's momentum is fp32, so its Nesterov input differs from the fp64
// reference's by up to about u32 / (1 - mu) = 1.2e-6 relative, and on an
// ill-conditioned matrix (tiny ones are often) NS amplifies that by up to
// G; measured in the soak: 1.2e-4 on a 2x2 of the classic schedule. fp32
// Polar Express through Gram adds up to 5.5e-4 of its own on 3x3 (the
// kernel alone against the oracle on its own fp32 input, 200k Gaussian
// inputs; docs/kernels.md states 1e-4). A wrong update (another step's,
// job's or parameter's; a corrupted element of a 100x100 matrix) is off by
// 1e-2 or more.
double VariedTolerance(const VariedJob& job, int p);

// max over s in [0, 1] of |f'(s)|, f the composition of the schedule's step
// polynomials (applied after the normalization by norm_safety).
double ScheduleGain(const kernels::Schedule& schedule);

// Rank `rank`'s session spec (its rows of row-sharded parameters).
SessionSpec VariedSpec(const VariedJob& job, int rank,
                       TransportChoice transport);

// A fresh Reference of the job.
Reference VariedReference(const VariedJob& job);

struct StepCheck {
  int64_t checked = 0;     // updates compared
  int64_t mismatches = 0;  // over the tolerance
  std::string first;       // the first mismatch, described
};

// Runs the session's current step for rank `rank` of `job`: writes and
// declares every gradient (in reverse order, as backward does, so
// parameter 0 is the last; `before`, if set, is called before each
// GradientReady with the parameter id), then
// calls `want` for the step's expected updates (Reference::Step; it runs
// while the daemon computes), waits for every update and compares it (the
// rank's view) with them within VariedTolerance, then FinishStep. Errors
// are the session's.
absl::StatusOr<StepCheck> RunVariedStep(
    Session& session, const VariedJob& job, const SessionSpec& spec,
    const std::function<std::vector<std::vector<double>>()>& want,
    const std::function<void(int)>& before = nullptr);

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_VARIED_JOB_H_
