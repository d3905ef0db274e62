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

}  // namespace
}  // namespace dmuon::server
