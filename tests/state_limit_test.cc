// --max-state-bytes' default, against the real daemon binaries: sized from
// the executors' device memory when they keep the state on devices (two
// fifths of it; fake_gpu_dmuond's executors report --fake-device-memory),
// from the host's memory otherwise (a quarter), logged at start; a job just
// below the default opens, one just above is refused naming the flag.

#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

// Opens a one-rank job of `params` (inline: no segment to map) and closes
// it again; returns the open's status.
absl::Status OpenJob(const Daemon& d, const std::string& job,
                     const std::vector<ParamSpec>& params) {
  auto client = Client::Connect(d.address());
  if (!client.ok()) return client.status();
  SessionSpec spec;
  spec.job_id = job;
  spec.params = params;
  spec.transport = TransportChoice::kInline;
  auto session = (*client)->OpenSession(spec);
  return session.status();
}

// A job of `bytes` of fp32 momentum (a multiple of 4): rows of 1024.
std::vector<ParamSpec> JobOfBytes(uint64_t bytes) {
  const int64_t elements = static_cast<int64_t>(bytes / 4);
  std::vector<ParamSpec> p;
  p.push_back({"w", elements / 1024, 1024});
  if (elements % 1024 != 0) p.push_back({"tail", 1, elements % 1024});
  return p;
}

uint64_t HostMemory() {
  return static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

TEST(StateLimit, DefaultIsTwoFifthsOfTheStateDevicesMemory) {
  // Two fake executors of 10 MiB each: 20 MiB of device memory, 8 MiB of
  // momentum by default.
  const uint64_t per_device = uint64_t{10} << 20;
  const uint64_t limit = 2 * per_device / 5 * 2;
  ASSERT_EQ(limit, uint64_t{8} << 20);
  Daemon d({"--devices=cuda:0,1",
            "--fake-device-memory=" + std::to_string(per_device)},
           "tests/fake_gpu_dmuond");
  EXPECT_TRUE(OpenJob(d, "below", JobOfBytes(limit - 4096)).ok()) << d.log();
  // Held by "below" now: a second job of 8 KiB would pass the limit.
  const absl::Status second = OpenJob(d, "second", JobOfBytes(8192));
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted) << second;
  const std::string log = d.log();
  EXPECT_NE(log.find(absl::StrCat("state limit: ", limit, " bytes")),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("two fifths of the state devices'"), std::string::npos)
      << log;
}

TEST(StateLimit, AJobJustAboveTheDeviceDefaultIsRefusedNamingTheFlag) {
  const uint64_t per_device = uint64_t{10} << 20;
  const uint64_t limit = per_device / 5 * 2;
  Daemon d({"--devices=cuda:0",
            "--fake-device-memory=" + std::to_string(per_device)},
           "tests/fake_gpu_dmuond");
  const absl::Status above = OpenJob(d, "above", JobOfBytes(limit + 4));
  EXPECT_EQ(above.code(), absl::StatusCode::kResourceExhausted) << above;
  EXPECT_NE(std::string(above.message()).find("--max-state-bytes"),
            std::string::npos)
      << above;
  // Exactly at the limit fits.
  EXPECT_TRUE(OpenJob(d, "at", JobOfBytes(limit)).ok()) << d.log();
}

TEST(StateLimit, AnExplicitFlagWinsOverTheDeviceDefault) {
  Daemon d({"--devices=cuda:0", "--fake-device-memory=1048576",
            "--max-state-bytes=4194304"},
           "tests/fake_gpu_dmuond");
  // 4 MiB fits, though the default would be 0.4 MiB.
  EXPECT_TRUE(OpenJob(d, "flag", JobOfBytes(uint64_t{4} << 20)).ok())
      << d.log();
  EXPECT_NE(d.log().find("state limit: 4194304 bytes"), std::string::npos)
      << d.log();
}

TEST(StateLimit, HostExecutorsDefaultToAQuarterOfTheHostsMemory) {
  Daemon d;  // CPU executors: the state is in host memory
  const uint64_t limit = HostMemory() / 4;
  // Refused before any momentum is allocated: just above costs nothing.
  const absl::Status above =
      OpenJob(d, "above", JobOfBytes((limit / 4096 + 1) * 4096));
  EXPECT_EQ(above.code(), absl::StatusCode::kResourceExhausted) << above;
  const std::string log = d.log();
  EXPECT_NE(log.find(absl::StrCat("state limit: ", limit, " bytes")),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("a quarter of the host's"), std::string::npos) << log;
  // A fake executor reporting no device memory keeps the host rule.
  Daemon fake({"--devices=cuda:0"}, "tests/fake_gpu_dmuond");
  EXPECT_TRUE(OpenJob(fake, "small", JobOfBytes(4096)).ok()) << fake.log();
  EXPECT_NE(fake.log().find("a quarter of the host's"), std::string::npos)
      << fake.log();
}

}  // namespace
}  // namespace dmuon::testing
