// The test job shared by the integration tests and their rank processes: a
// fixed mixed table (replicated, row-sharded, unreduced parameters),
// gradients every process can regenerate from (seed, step, parameter,
// rank), and an fp64 Muon reference (docs/design.md, "The math of a Muon
// step") independent of the daemon: momentum in double, NS from the SVD
// oracle. The reference also takes any other table and hyperparameter
// groups (the soak and fault tests' varied jobs, tests/varied_job.h).

#ifndef DMUON_TESTS_MUON_JOB_H_
#define DMUON_TESTS_MUON_JOB_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/client.h"
#include "kernels/types.h"

namespace dmuon::testing {

// The table for `rank` of `world` (row ranges split as evenly as possible).
std::vector<ParamSpec> TestTable(int rank, int world);

// The whole-matrix gradient rank `rank` holds for parameter `p` at `step`.
std::vector<float> Gradient(uint64_t seed, int64_t step, int p, int rank,
                            int world);
// The same for parameter `p` of any table, `whole` being its spec (the
// whole matrix; for kUnreduced each rank holds its own gradient, for the
// other shardings every rank holds rank 0's).
std::vector<float> Gradient(uint64_t seed, int64_t step, int p, int rank,
                            const ParamSpec& whole);

// fp64 reference: lr_scale * NS(nesterov momentum step) of the gradient the
// daemon must use (rank 0's, the rows, or the rank-order mean), whole matrix.
// The Newton–Schulz options a group asks for (schedule and ns_steps, or the
// custom coefficients; eps), as docs/protocol.md defines them.
kernels::NsOptions NsOptionsOf(const GroupSpec& group);

// Each parameter follows its group's hyperparameters (momentum, nesterov,
// schedule and ns_steps or custom coefficients, eps, adjust_lr_fn; the
// method does not matter to the oracle); an empty `groups` is one group of
// defaults.
class Reference {
 public:
  // The test job (TestTable).
  Reference(uint64_t seed, int world);
  // Any table (whole matrices; row ranges are ignored).
  Reference(uint64_t seed, int world, std::vector<ParamSpec> table,
            std::vector<GroupSpec> groups = {});
  // Updates for `step` (steps must be asked for in order from 1).
  std::vector<std::vector<double>> Step(int64_t step);
  // Only the momentum of `step` (no Newton–Schulz), for a caller that needs
  // the state after a step but not its updates. Same order rule as Step.
  void Advance(int64_t step);
  // Steps taken so far, and each parameter's momentum after the last one
  // (whole matrices; empty before step 1).
  int64_t completed() const { return completed_; }
  const std::vector<std::vector<double>>& momentum() const { return momentum_; }
  // Each momentum element's scale: the same recurrence over the gradients'
  // absolute values. The momentum is a sum whose terms can cancel (a 1x1
  // parameter's momentum can be near zero by chance), so an fp32 state's
  // rounding error is bounded relative to this, not to the momentum itself.
  const std::vector<std::vector<double>>& momentum_scale() const {
    return scale_;
  }

 private:
  // The Nesterov input of parameter p at `step` (advances its momentum).
  std::vector<double> MomentumStep(int64_t step, size_t p);

  uint64_t seed_;
  int world_;
  std::vector<ParamSpec> table_;
  std::vector<GroupSpec> groups_;
  int64_t completed_ = 0;
  std::vector<std::vector<double>> momentum_;
  std::vector<std::vector<double>> scale_;  // momentum_scale()
};

// This rank's view (its rows for row-sharded) of a whole matrix.
template <typename T>
std::vector<T> View(const std::vector<T>& whole, const ParamSpec& p) {
  if (p.sharding != Sharding::kRows) return whole;
  return std::vector<T>(whole.begin() + p.row_begin * p.cols,
                        whole.begin() + p.row_end * p.cols);
}

double RelativeError(const std::vector<float>& got,
                     const std::vector<double>& want);
// ||got - want|| / ||scale||: the error of a sum relative to the sum of its
// terms' magnitudes (Reference::momentum_scale), which rounding bounds.
double ScaledError(const std::vector<float>& got,
                   const std::vector<double>& want,
                   const std::vector<double>& scale);

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_MUON_JOB_H_
