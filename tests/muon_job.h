// The test job shared by the integration tests and their rank processes: a
// fixed mixed table (replicated, row-sharded, unreduced parameters),
// gradients every process can regenerate from (seed, step, parameter,
// rank), and an fp64 Muon reference (docs/design.md, "The math of a Muon
// step") independent of the daemon: momentum in double, NS from the SVD
// oracle.

#ifndef DMUON_TESTS_MUON_JOB_H_
#define DMUON_TESTS_MUON_JOB_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/client.h"

namespace dmuon::testing {

// The table for `rank` of `world` (row ranges split as evenly as possible).
std::vector<ParamSpec> TestTable(int rank, int world);

// The whole-matrix gradient rank `rank` holds for parameter `p` at `step`.
std::vector<float> Gradient(uint64_t seed, int64_t step, int p, int rank,
                            int world);

// fp64 reference: lr_scale * NS(nesterov momentum step) of the gradient the
// daemon must use (rank 0's, the rows, or the rank-order mean), whole matrix.
class Reference {
 public:
  Reference(uint64_t seed, int world) : seed_(seed), world_(world) {}
  // Updates for `step` (steps must be asked for in order from 1).
  std::vector<std::vector<double>> Step(int64_t step);

 private:
  uint64_t seed_;
  int world_;
  std::vector<std::vector<double>> momentum_;
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

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_MUON_JOB_H_
