// The cuBLASLt algorithm fallback policy (algo_fallback.h) with injected
// failures: the candidates are a script of statuses per call, the oracle the
// sequence of candidates tried.

#include "kernels/cuda/algo_fallback.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace dmuon::kernels::cuda::algo {
namespace {

// What cublasLtMatmul returns for CUBLAS_STATUS_NOT_SUPPORTED (check.h).
absl::Status NotSupported() {
  return absl::UnimplementedError(
      "lt_matmul.cc:1: cublasLtMatmul(...) failed: "
      "CUBLAS_STATUS_NOT_SUPPORTED (the functionality requested is not "
      "supported)");
}

// A fake "run candidate c": the status scripted for c (OK if none), and the
// order in which candidates were tried.
struct Script {
  std::map<int, absl::Status> fails;
  std::vector<int> tried;
  absl::Status operator()(int c) {
    tried.push_back(c);
    auto it = fails.find(c);
    return it == fails.end() ? absl::OkStatus() : it->second;
  }
};

constexpr char kShape[] = "M=1024 N=1024 K=4096 batch 16 TN";

TEST(AlgoFallback, UsableSkipsFailedAndOversizedResultsInOrder) {
  const std::vector<HeuristicResult> results = {
      {true, 1 << 20}, {false, 0}, {true, 64 << 20}, {true, 0}, {true, 32}};
  EXPECT_EQ(Usable(results, 32 << 20), (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(Usable(results, 16), (std::vector<int>{3}));
  EXPECT_TRUE(Usable({}, 1 << 30).empty());
  EXPECT_EQ(DescribeResults(results, 32 << 20),
            "5 results: 1 need more than the 33554432-byte workspace, 1 "
            "reported an error");
  EXPECT_EQ(DescribeResults({}, 0), "no results");
}

TEST(AlgoFallback, NotSupportedFallsBackToTheNextAndRemembersIt) {
  AlgoFallback f(4, kShape);
  Script s;
  s.fails[0] = NotSupported();
  ASSERT_TRUE(f.Run(std::ref(s)).ok());
  EXPECT_EQ(s.tried, (std::vector<int>{0, 1}));
  EXPECT_EQ(f.current(), 1);
  // Later calls start from the one that worked.
  s.tried.clear();
  ASSERT_TRUE(f.Run(std::ref(s)).ok());
  EXPECT_EQ(s.tried, (std::vector<int>{1}));
}

TEST(AlgoFallback, WrapsAroundFromTheRememberedCandidate) {
  AlgoFallback f(3, kShape);
  Script s;
  s.fails[0] = NotSupported();
  s.fails[1] = NotSupported();
  ASSERT_TRUE(f.Run(std::ref(s)).ok());
  EXPECT_EQ(f.current(), 2);
  // Candidate 2 stops working (other pointers), 0 works again.
  s.fails = {{2, NotSupported()}};
  s.tried.clear();
  ASSERT_TRUE(f.Run(std::ref(s)).ok());
  EXPECT_EQ(s.tried, (std::vector<int>{2, 0}));
  EXPECT_EQ(f.current(), 0);
}

TEST(AlgoFallback, AllRefusedIsAnErrorNamingTheShapeAndTheStatus) {
  AlgoFallback f(3, kShape);
  Script s;
  for (int c = 0; c < 3; ++c) s.fails[c] = NotSupported();
  const absl::Status st = f.Run(std::ref(s));
  EXPECT_EQ(s.tried, (std::vector<int>{0, 1, 2})) << "each tried once";
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_NE(st.message().find(kShape), std::string::npos) << st;
  EXPECT_NE(st.message().find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos)
      << st;
  EXPECT_NE(st.message().find("all 3 candidates"), std::string::npos) << st;
  EXPECT_EQ(f.current(), 0);
}

TEST(AlgoFallback, OtherErrorsAreReturnedWithoutTryingMore) {
  AlgoFallback f(3, kShape);
  Script s;
  s.fails[0] = absl::InternalError("CUBLAS_STATUS_EXECUTION_FAILED");
  const absl::Status st = f.Run(std::ref(s));
  EXPECT_EQ(st, s.fails[0]);
  EXPECT_EQ(s.tried, (std::vector<int>{0}));
  EXPECT_EQ(f.current(), 0);
  s.fails[0] = absl::ResourceExhaustedError("CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_EQ(f.Run(std::ref(s)).code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace dmuon::kernels::cuda::algo
