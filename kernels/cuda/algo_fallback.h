// Which of cuBLASLt's candidate algorithms a GEMM runs, in plain C++ (no
// CUDA types) so the policy is built and tested in the default
// configuration. lt_matmul.cc applies it to cublasLtMatmulAlgoGetHeuristic's
// results and to cublasLtMatmul's status.
//
// At creation the heuristic is asked for up to kHeuristicResults algorithms,
// best first; Usable keeps those that report success and fit the workspace.
// At run time AlgoFallback tries the remembered candidate first; a candidate
// the library refuses for the call (CUBLAS_STATUS_NOT_SUPPORTED, which
// check.h maps to UNIMPLEMENTED) passes the call to the next one, wrapping
// around, each tried at most once per call; the first that runs is
// remembered for later calls. Any other failure is returned at once: a
// device fault or a bad argument would not go away with another algorithm.

#ifndef DMUON_KERNELS_CUDA_ALGO_FALLBACK_H_
#define DMUON_KERNELS_CUDA_ALGO_FALLBACK_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dmuon::kernels::cuda::algo {

// How many algorithms a GEMM asks the heuristic for.
inline constexpr int kHeuristicResults = 8;

// One heuristic result as the policy sees it.
struct HeuristicResult {
  bool ok = false;         // the result's state is CUBLAS_STATUS_SUCCESS
  uint64_t workspace = 0;  // workspace bytes the algorithm needs
};

// Indices into `results` of the usable ones (ok, workspace <= limit), in the
// heuristic's order.
std::vector<int> Usable(const std::vector<HeuristicResult>& results,
                        uint64_t workspace_limit);

// Why results are unusable, for error messages: "8 results: 2 need more than
// the 33554432-byte workspace, 1 reported an error" ("no results" when empty).
std::string DescribeResults(const std::vector<HeuristicResult>& results,
                            uint64_t workspace_limit);

// The run-time choice among `count` candidates (0 .. count-1, best first).
// Not thread-safe: one owner (a Context) calls Run.
class AlgoFallback {
 public:
  // count >= 1; `what` names the GEMM (its shape) in errors.
  AlgoFallback(int count, std::string what);

  // Calls try_candidate(c), from the remembered candidate on, until one
  // returns OK (remembered from then on) or a status other than
  // UNIMPLEMENTED (returned as it is). When every candidate returns
  // UNIMPLEMENTED: UNIMPLEMENTED naming `what`, the number of candidates and
  // the last one's message; the remembered candidate is then unchanged.
  absl::Status Run(const std::function<absl::Status(int)>& try_candidate);

  int current() const { return current_; }
  int count() const { return count_; }

 private:
  const int count_;
  const std::string what_;
  int current_ = 0;
};

}  // namespace dmuon::kernels::cuda::algo

#endif  // DMUON_KERNELS_CUDA_ALGO_FALLBACK_H_
