#include "transport/cuda_ipc.h"

#include <gtest/gtest.h>

#include <limits>

namespace dmuon::transport {
namespace {

CudaIpcExport Good() {
  CudaIpcExport e;
  e.mem_handle.assign(kCudaIpcHandleBytes, '\1');
  e.device_uuid.assign(kCudaUuidBytes, '\2');
  e.offset = 512;
  e.bytes = 4096;
  return e;
}

::testing::AssertionResult Fails(const absl::Status& st,
                                 const std::string& part) {
  if (st.code() != absl::StatusCode::kInvalidArgument)
    return ::testing::AssertionFailure() << "code: " << st;
  if (std::string(st.message()).find(part) == std::string::npos)
    return ::testing::AssertionFailure() << st << " lacks " << part;
  return ::testing::AssertionSuccess();
}

TEST(CudaIpcExport, AcceptsAWellFormedExport) {
  EXPECT_TRUE(ValidateCudaIpcExport(Good(), 4096).ok());
  CudaIpcExport e = Good();
  e.event_handle.assign(kCudaIpcHandleBytes, '\3');
  EXPECT_TRUE(ValidateCudaIpcExport(e, 1000).ok());
}

TEST(CudaIpcExport, RejectsEachMalformedField) {
  CudaIpcExport e = Good();
  e.mem_handle.resize(8);
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "mem_handle has 8"));
  e = Good();
  e.event_handle = "short";
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "event_handle has 5"));
  e = Good();
  e.device_uuid.clear();
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "device_uuid has 0"));
  e = Good();
  e.offset = 100;
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "not a multiple of 64"));
  e = Good();
  e.bytes = 4095;
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "smaller than"));
  e = Good();
  e.offset = std::numeric_limits<uint64_t>::max() - 63;
  EXPECT_TRUE(Fails(ValidateCudaIpcExport(e, 4096), "overflows"));
}

TEST(CudaIpcMapping, TheAllocationMustCoverTheRegion) {
  const CudaIpcExport e = Good();  // offset 512
  EXPECT_TRUE(ValidateCudaIpcMapping(e, 512 + 4096, 4096).ok());
  EXPECT_TRUE(
      Fails(ValidateCudaIpcMapping(e, 512 + 4095, 4096), "[512, 4608)"));
  EXPECT_TRUE(Fails(ValidateCudaIpcMapping(e, 100, 0), "freed"));
}

TEST(CudaIpcDevice, UuidStringIsNvidiaSmisForm) {
  std::string uuid;
  for (int i = 0; i < 16; ++i) uuid.push_back(static_cast<char>(i * 0x11));
  EXPECT_EQ(UuidString(uuid), "GPU-00112233-4455-6677-8899-aabbccddeeff");
  EXPECT_EQ(UuidString(std::string("\x01\xfe", 2)), "GPU-01fe");
  EXPECT_EQ(UuidString(""), "GPU-");
}

TEST(CudaIpcDevice, FoundByUuidOrNamed) {
  const std::string a(16, '\x11'), b(16, '\xab');
  EXPECT_EQ(*FindDeviceByUuid({a, b}, b), 1);
  auto missing = FindDeviceByUuid({a}, b);
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(
                "GPU-abababab-abab-abab-abab-abababababab"),
            std::string::npos)
      << missing.status();
  EXPECT_NE(missing.status().message().find("GPU-11111111"), std::string::npos);
  EXPECT_NE(FindDeviceByUuid({}, b).status().message().find("no GPU"),
            std::string::npos);
}

}  // namespace
}  // namespace dmuon::transport
