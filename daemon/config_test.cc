// ValidateConfig: every value it refuses, with the flag named in the error.

#include "daemon/config.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace dmuon::server {
namespace {

TEST(DaemonConfig, DefaultsAreValid) {
  EXPECT_TRUE(ValidateConfig(DaemonConfig()).ok());
}

TEST(DaemonConfig, ListenHost) {
  DaemonConfig c;
  c.listen = "0.0.0.0:50051";
  EXPECT_EQ(c.ListenHost(), "0.0.0.0");
  c.listen = "[::1]:0";
  EXPECT_EQ(c.ListenHost(), "[::1]");
}

TEST(DaemonConfig, EachBadValueIsRefusedNamingItsFlag) {
  struct Case {
    std::string flag;  // what the error starts with
    std::function<void(DaemonConfig&)> set;
  };
  const std::vector<Case> cases = {
      {"--log-format", [](DaemonConfig& c) { c.log_format = "xml"; }},
      {"--log-level", [](DaemonConfig& c) { c.log_level = "loud"; }},
      {"--nan-policy", [](DaemonConfig& c) { c.nan_policy = "ignore"; }},
      {"--max-sessions", [](DaemonConfig& c) { c.max_sessions = 0; }},
      {"--max-message-bytes",
       [](DaemonConfig& c) { c.max_message_bytes = 4095; }},
      {"--max-message-bytes",
       [](DaemonConfig& c) { c.max_message_bytes = int64_t{1} << 31; }},
      {"--snapshot-every", [](DaemonConfig& c) { c.snapshot_every = -1; }},
      {"--job-retention-seconds",
       [](DaemonConfig& c) { c.job_retention_seconds = -1; }},
      {"--devices=gpu", [](DaemonConfig& c) { c.devices = "gpu"; }},
      {"--devices=cuda:0,0", [](DaemonConfig& c) { c.devices = "cuda:0,0"; }},
      {"--momentum-dtype", [](DaemonConfig& c) { c.momentum_dtype = "fp16"; }},
      {"--cpu-executors", [](DaemonConfig& c) { c.cpu_executors = 0; }},
  };
  for (const Case& k : cases) {
    DaemonConfig c;
    k.set(c);
    const absl::Status st = ValidateConfig(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << k.flag;
    EXPECT_EQ(std::string(st.message()).rfind(k.flag, 0), 0u)
        << "expected the error to start with " << k.flag << ": " << st;
  }
}

TEST(DaemonConfig, BoundaryValuesAreAccepted) {
  DaemonConfig c;
  c.max_sessions = 1;
  c.max_message_bytes = 4096;
  c.snapshot_every = 0;
  c.job_retention_seconds = 0;
  c.cpu_executors = 1;
  c.log_level = "warn";
  c.log_format = "json";
  c.nan_policy = "fail";
  c.devices = "cuda:0,1";
  c.momentum_dtype = "bf16";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.max_message_bytes = (int64_t{1} << 31) - 1;
  c.log_level = "off";
  c.devices = "auto";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

}  // namespace
}  // namespace dmuon::server
