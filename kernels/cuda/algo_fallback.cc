#include "kernels/cuda/algo_fallback.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::kernels::cuda::algo {

std::vector<int> Usable(const std::vector<HeuristicResult>& results,
                        uint64_t workspace_limit) {
  std::vector<int> usable;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].ok && results[i].workspace <= workspace_limit) {
      usable.push_back(static_cast<int>(i));
    }
  }
  return usable;
}

std::string DescribeResults(const std::vector<HeuristicResult>& results,
                            uint64_t workspace_limit) {
  if (results.empty()) return "no results";
  int failed = 0, too_big = 0;
  for (const HeuristicResult& r : results) {
    if (!r.ok) {
      ++failed;
    } else if (r.workspace > workspace_limit) {
      ++too_big;
    }
  }
  return absl::StrCat(results.size(), " results: ", too_big,
                      " need more than the ", workspace_limit,
                      "-byte workspace, ", failed, " reported an error");
}

AlgoFallback::AlgoFallback(int count, std::string what)
    : count_(count), what_(std::move(what)) {}

absl::Status AlgoFallback::Run(
    const std::function<absl::Status(int)>& try_candidate) {
  absl::Status last = absl::InternalError(
      absl::StrCat("no cuBLASLt algorithm candidates for ", what_));
  for (int k = 0; k < count_; ++k) {
    const int c = (current_ + k) % count_;
    last = try_candidate(c);
    if (last.code() == absl::StatusCode::kUnimplemented) continue;
    if (last.ok()) current_ = c;
    return last;
  }
  if (count_ < 1) return last;
  return absl::UnimplementedError(
      absl::StrCat("no cuBLASLt algorithm runs ", what_, ": all ", count_,
                   " candidates of the heuristic refused it, the last with: ",
                   last.message()));
}

}  // namespace dmuon::kernels::cuda::algo
