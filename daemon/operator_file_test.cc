#include "daemon/operator_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>

namespace dmuon {
namespace {

std::string Dir() {
  static const std::string dir = [] {
    std::string t =
        std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                               : "/tmp") +
        "/operator_file_XXXXXX";
    return std::string(::mkdtemp(t.data()));
  }();
  return dir;
}

std::string Write(const std::string& name, const std::string& body) {
  const std::string path = Dir() + "/" + name;
  std::ofstream(path, std::ios::binary) << body;
  return path;
}

TEST(OperatorFile, ReadsARegularFileWhole) {
  const std::string body = "-----BEGIN CERTIFICATE-----\nabc\n";
  auto got = ReadOperatorFile(Write("cert.pem", body), 1024, "--tls-cert-file");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, body);
  auto empty = ReadOperatorFile(Write("empty", ""), 1024, "--x");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "");
}

TEST(OperatorFile, RefusesAFileOverItsBoundNamingTheFlag) {
  const std::string path = Write("big", std::string(1025, 'x'));
  auto got = ReadOperatorFile(path, 1024, "--auth-token-file=" + path);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("--auth-token-file=" + path +
                                        ": 1025 "
                                        "bytes, more than the 1024"),
            std::string::npos)
      << got.status();
  EXPECT_TRUE(ReadOperatorFile(path, 1025, "--x").ok());
}

TEST(OperatorFile, RefusesAFifoWithoutWaitingOnIt) {
  const std::string path = Dir() + "/fifo";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto got = ReadOperatorFile(path, 1024, "--tls-key-file");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("--tls-key-file: not a regular file"),
            std::string::npos)
      << got.status();
}

TEST(OperatorFile, RefusesDevicesDirectoriesAndMissingFiles) {
  for (const std::string& path : {std::string("/dev/zero"), Dir()}) {
    auto got = ReadOperatorFile(path, 1 << 20, "--x");
    ASSERT_FALSE(got.ok()) << path;
    EXPECT_NE(got.status().message().find("not a regular file"),
              std::string::npos)
        << got.status();
  }
  auto missing = ReadOperatorFile(Dir() + "/none", 1024, "--tls-cert-file");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--tls-cert-file: No such file"),
            std::string::npos)
      << missing.status();
}

}  // namespace
}  // namespace dmuon
