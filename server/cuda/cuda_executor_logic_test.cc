// FinishOnError (cuda_executor_logic.h) with a fake stream sync: the wait
// always happens, and its failure is reported without hiding the call's.

#include "server/cuda/cuda_executor_logic.h"

#include <gtest/gtest.h>

#include <string>

namespace dmuon::server::gpu {
namespace {

// A fake cudaStreamSynchronize: counts its calls, returns `result`.
struct FakeSync {
  absl::Status result;
  int calls = 0;
  absl::Status operator()() {
    ++calls;
    return result;
  }
};

TEST(FinishOnError, WaitsForTheStreamAndKeepsTheCallsError) {
  FakeSync sync;
  const absl::Status failed =
      absl::ResourceExhaustedError("cudaMalloc(staging): out of memory");
  EXPECT_EQ(FinishOnError(failed, std::ref(sync)), failed);
  EXPECT_EQ(sync.calls, 1);
  const absl::Status input = absl::InvalidArgumentError("bad shape");
  EXPECT_EQ(FinishOnError(input, std::ref(sync)), input);
  EXPECT_EQ(sync.calls, 2);
}

TEST(FinishOnError, AFailedWaitIsReportedWithTheMoreSeriousCode) {
  FakeSync sync{absl::InternalError("cudaErrorIllegalAddress")};
  const absl::Status st = FinishOnError(
      absl::ResourceExhaustedError("cudaMalloc(staging): out of memory"),
      std::ref(sync));
  EXPECT_EQ(sync.calls, 1);
  // The device fault the wait found outranks the out-of-memory.
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  const std::string m(st.message());
  EXPECT_LT(m.find("out of memory"), m.find("cudaErrorIllegalAddress")) << m;
  EXPECT_NE(m.find("waiting for the stream"), std::string::npos) << m;

  // A device error stays one when the wait only ran out of memory.
  sync.result = absl::ResourceExhaustedError("out of memory");
  EXPECT_EQ(FinishOnError(absl::InternalError("cublasLtMatmul failed"),
                          std::ref(sync))
                .code(),
            absl::StatusCode::kInternal);
  // An input error with a failed wait is a device error.
  sync.result = absl::InternalError("cudaErrorLaunchFailure");
  EXPECT_EQ(
      FinishOnError(absl::InvalidArgumentError("bad"), std::ref(sync)).code(),
      absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace dmuon::server::gpu
