#include "server/gpu_logic.h"

#include <gtest/gtest.h>

#include <numeric>

namespace dmuon::server {
namespace {

TEST(DeviceSpec, ParsesEveryForm) {
  EXPECT_EQ(ParseDeviceSpec("cpu")->kind, DeviceSpec::Kind::kCpu);
  EXPECT_EQ(ParseDeviceSpec("auto")->kind, DeviceSpec::Kind::kAuto);
  auto all = ParseDeviceSpec("cuda");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->kind, DeviceSpec::Kind::kCuda);
  EXPECT_TRUE(all->ordinals.empty());
  auto two = ParseDeviceSpec("cuda:1,0");
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->ordinals, (std::vector<int>{1, 0}));
}

TEST(DeviceSpec, RejectsMalformedSpecsWithTheReason) {
  for (const char* bad : {"gpu", "cuda:", "cuda:a", "cuda:-1", "cuda:0,,1",
                          "cuda:0,0", "cuda0", "CPU"}) {
    auto s = ParseDeviceSpec(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(bad), std::string::npos) << s.status();
  }
  EXPECT_NE(ParseDeviceSpec("cuda:0,0").status().message().find("twice"),
            std::string::npos);
}

TEST(DeviceSpec, ResolvesAgainstTheDeviceCount) {
  const DeviceSpec autos = *ParseDeviceSpec("auto");
  EXPECT_EQ(*ResolveCudaDevices(autos, 2, ""), (std::vector<int>{0, 1}));
  // auto without a GPU: no CUDA executors (the daemon falls back to CPU).
  EXPECT_TRUE(ResolveCudaDevices(autos, -1, "no driver")->empty());
  const DeviceSpec all = *ParseDeviceSpec("cuda");
  EXPECT_EQ(*ResolveCudaDevices(all, 3, ""), (std::vector<int>{0, 1, 2}));
  auto none =
      ResolveCudaDevices(all, -1, "CUDA driver version is insufficient");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.status().message().find("insufficient"), std::string::npos);
  auto beyond = ResolveCudaDevices(*ParseDeviceSpec("cuda:0,2"), 2, "");
  ASSERT_FALSE(beyond.ok());
  EXPECT_NE(beyond.status().message().find("cuda:2 does not exist"),
            std::string::npos)
      << beyond.status();
  EXPECT_EQ(*ResolveCudaDevices(*ParseDeviceSpec("cuda:1"), 2, ""),
            (std::vector<int>{1}));
  EXPECT_TRUE(ResolveCudaDevices(*ParseDeviceSpec("cpu"), 4, "")->empty());
}

TEST(Health, OutOfMemoryClearsDeviceErrorsStick) {
  Health h;
  EXPECT_TRUE(h.healthy());
  h.Record(absl::InvalidArgumentError("NaN in input"));
  EXPECT_TRUE(h.healthy()) << "bad input is not the device's fault";
  h.Record(absl::UnimplementedError(
      "no cuBLASLt algorithm takes GEMM 4096x14336x4096"));
  EXPECT_TRUE(h.healthy()) << "a shape no algorithm takes is the batch's";
  EXPECT_FALSE(h.out_of_service());
  h.Record(absl::ResourceExhaustedError("cudaMalloc: out of memory"));
  EXPECT_FALSE(h.healthy());
  EXPECT_FALSE(h.out_of_service());
  EXPECT_NE(h.last_error().find("out of memory"), std::string::npos);
  h.Record(absl::OkStatus());
  EXPECT_TRUE(h.healthy());
  h.Record(absl::InternalError("cudaErrorIllegalAddress"));
  EXPECT_FALSE(h.healthy());
  EXPECT_TRUE(h.out_of_service());
  h.Record(absl::OkStatus());
  EXPECT_FALSE(h.healthy()) << "a sticky CUDA error never clears";
  EXPECT_NE(h.last_error().find("IllegalAddress"), std::string::npos);
}

TEST(SplitBatch, PowersOfTwoLargestFirst) {
  EXPECT_TRUE(SplitBatch(0, 16).empty());
  EXPECT_EQ(SplitBatch(1, 16), (std::vector<int64_t>{1}));
  EXPECT_EQ(SplitBatch(13, 16), (std::vector<int64_t>{8, 4, 1}));
  EXPECT_EQ(SplitBatch(16, 16), (std::vector<int64_t>{16}));
  EXPECT_EQ(SplitBatch(37, 16), (std::vector<int64_t>{16, 16, 4, 1}));
  EXPECT_EQ(SplitBatch(7, 12), (std::vector<int64_t>{4, 2, 1}));
  EXPECT_EQ(SplitBatch(3, 0), (std::vector<int64_t>{1, 1, 1}));
  for (int64_t n = 0; n < 100; ++n) {
    auto parts = SplitBatch(n, 16);
    EXPECT_EQ(std::accumulate(parts.begin(), parts.end(), int64_t{0}), n);
    for (int64_t p : parts) EXPECT_EQ(p & (p - 1), 0) << p;
  }
}

TEST(RowsOf, ByteRangeOfARowShard) {
  const RowBytes r = RowsOf(3, 5, 10);
  EXPECT_EQ(r.offset, 3u * 10 * 4);
  EXPECT_EQ(r.bytes, 2u * 10 * 4);
}

// A launch that fails on the graph path the way kernels/cuda/plan.cc reports
// a failed capture, and computes (counts) on the eager one.
struct FakeLaunch {
  absl::Status graph_error = absl::InternalError(
      "kernels/cuda/plan.cc:212: cudaStreamEndCapture failed: "
      "cudaErrorStreamCaptureInvalidated (operation failed due to a previous "
      "error during capture)");
  absl::Status eager_error;
  int graph_calls = 0, eager_calls = 0, recovers = 0;
  std::vector<std::string> warnings;

  absl::Status Run(GraphFallback& g, const std::string& key) {
    return g.Run(
        "cuda:0", key,
        [&](bool graphs) {
          ++(graphs ? graph_calls : eager_calls);
          return graphs ? graph_error : eager_error;
        },
        [&] {
          ++recovers;
          return absl::OkStatus();
        },
        [&](const std::string& w) { warnings.push_back(w); });
  }
};

TEST(GraphFallback, AFailedCaptureRunsEagerlyFromThenOnWarnedOncePerCause) {
  GraphFallback g(true);
  FakeLaunch f;
  const std::string a = GraphKey(64, 96, 4, "direct");
  EXPECT_TRUE(g.use_graphs(a));
  ASSERT_TRUE(f.Run(g, a).ok());
  EXPECT_EQ(f.graph_calls, 1);
  EXPECT_EQ(f.eager_calls, 1);
  EXPECT_EQ(f.recovers, 1);
  EXPECT_FALSE(g.use_graphs(a));
  EXPECT_EQ(g.fallbacks(), 1u);
  ASSERT_EQ(f.warnings.size(), 1u);
  EXPECT_NE(f.warnings[0].find("cuda:0"), std::string::npos) << f.warnings[0];
  EXPECT_NE(f.warnings[0].find(a), std::string::npos) << f.warnings[0];
  EXPECT_NE(f.warnings[0].find("cudaErrorStreamCaptureInvalidated"),
            std::string::npos);
  // That key never tries a graph again.
  ASSERT_TRUE(f.Run(g, a).ok());
  EXPECT_EQ(f.graph_calls, 1);
  EXPECT_EQ(f.eager_calls, 2);
  // Another key with the same cause (another source line): counted, not
  // warned again.
  f.graph_error = absl::InternalError(
      "kernels/cuda/plan.cc:230: cudaStreamEndCapture failed: "
      "cudaErrorStreamCaptureInvalidated (operation failed due to a previous "
      "error during capture)");
  const std::string b = GraphKey(64, 96, 2, "direct");
  ASSERT_TRUE(f.Run(g, b).ok());
  EXPECT_EQ(g.fallbacks(), 2u);
  EXPECT_EQ(f.warnings.size(), 1u);
  // A new cause warns once more.
  f.graph_error = absl::InternalError(
      "kernels/cuda/plan.cc:240: cudaGraphInstantiate failed: "
      "cudaErrorNotSupported (operation not supported)");
  ASSERT_TRUE(f.Run(g, GraphKey(8, 8, 1, "gram")).ok());
  EXPECT_EQ(g.fallbacks(), 3u);
  EXPECT_EQ(f.warnings.size(), 2u);
}

TEST(GraphFallback, EagerFailureInputErrorsAndOutOfMemoryAreReturned) {
  GraphFallback g(true);
  FakeLaunch f;
  // Eager fails too: a device fault, returned; the key keeps graphs.
  f.eager_error = absl::InternalError("cudaErrorIllegalAddress");
  const std::string k = GraphKey(8, 8, 1, "direct");
  EXPECT_EQ(f.Run(g, k).message(), "cudaErrorIllegalAddress");
  EXPECT_TRUE(g.use_graphs(k));
  EXPECT_EQ(g.fallbacks(), 0u);
  EXPECT_TRUE(f.warnings.empty());
  // Input errors and out of memory are not graph failures: no retry.
  f = FakeLaunch();
  for (const absl::Status& st :
       {absl::InvalidArgumentError("bad shape"),
        absl::ResourceExhaustedError("cudaErrorMemoryAllocation")}) {
    f.graph_error = st;
    EXPECT_EQ(f.Run(g, k), st);
  }
  EXPECT_EQ(f.eager_calls, 0);
  EXPECT_EQ(f.recovers, 0);
  // A failing recovery is returned as it is, without an eager launch.
  const absl::Status stuck = absl::InternalError("capture still open");
  int eager = 0;
  EXPECT_EQ(g.Run(
                "cuda:0", k,
                [&](bool graphs) {
                  eager += graphs ? 0 : 1;
                  return graphs ? FakeLaunch().graph_error : absl::OkStatus();
                },
                [&] { return stuck; }, nullptr),
            stuck);
  EXPECT_EQ(eager, 0);
  EXPECT_TRUE(g.use_graphs(k));
}

TEST(GraphFallback, StrictRefusesTheEagerRetryAndLeavesTheDeviceHealthy) {
  GraphFallback g(true, /*strict=*/true);
  FakeLaunch f;
  const std::string k = GraphKey(64, 96, 4, "direct");
  const absl::Status st = f.Run(g, k);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  for (const char* part : {"--strict", "'graph_eager'", "cuda:0",
                           "cudaErrorStreamCaptureInvalidated"})
    EXPECT_NE(st.message().find(part), std::string::npos) << part << ": " << st;
  EXPECT_NE(st.message().find(k), std::string::npos) << st;
  // Recovered, nothing computed eagerly, nothing counted or warned, and
  // the key keeps its graphs (the next batch tries them again).
  EXPECT_EQ(f.recovers, 1);
  EXPECT_EQ(f.eager_calls, 0);
  EXPECT_EQ(g.fallbacks(), 0u);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_TRUE(g.use_graphs(k));
  // The refusal is the batch's fault, not the device's.
  EXPECT_EQ(ClassifyFault(st), Fault::kInput);
  Health h;
  h.Record(st);
  EXPECT_TRUE(h.healthy());
}

TEST(GraphFallback, DisabledGraphsAndSuccessNeverRetry) {
  GraphFallback off(false);
  FakeLaunch f;
  f.eager_error = absl::InternalError("eager failed");
  EXPECT_FALSE(off.use_graphs("k"));
  EXPECT_EQ(f.Run(off, "k").message(), "eager failed");
  EXPECT_EQ(f.graph_calls, 0);
  EXPECT_EQ(f.recovers, 0);
  GraphFallback on(true);
  f = FakeLaunch();
  f.graph_error = absl::OkStatus();
  EXPECT_TRUE(f.Run(on, "k").ok());
  EXPECT_EQ(f.eager_calls, 0);
  EXPECT_EQ(on.fallbacks(), 0u);
}

TEST(GraphFailureCause, DropsSourcePositionsOnly) {
  const absl::Status a = absl::InternalError(
      "ns3: kernels/cuda/lt_matmul.cc:88: cublasLtMatmul failed: "
      "CUBLAS_STATUS_NOT_SUPPORTED (the functionality requested is not "
      "supported)");
  const absl::Status b = absl::InternalError(
      "ns3: kernels/cuda/lt_matmul.cc:91: cublasLtMatmul failed: "
      "CUBLAS_STATUS_NOT_SUPPORTED (the functionality requested is not "
      "supported)");
  EXPECT_EQ(GraphFailureCause(a), GraphFailureCause(b));
  EXPECT_EQ(GraphFailureCause(a),
            "INTERNAL: ns3: cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED "
            "(the functionality requested is not supported)");
  EXPECT_NE(GraphFailureCause(a),
            GraphFailureCause(absl::UnknownError(std::string(a.message()))));
  EXPECT_EQ(GraphFailureCause(absl::InternalError("x.cc: 12: y:3: z")),
            "INTERNAL: x.cc: 12: y:3: z");
}

}  // namespace
}  // namespace dmuon::server
