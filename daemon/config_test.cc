// ValidateConfig: every value it refuses, with the flag named in the error;
// and that DaemonConfig's defaults are its flags' and the service's.

#include "daemon/config.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

TEST(DaemonConfig, DefaultsAreValid) {
  EXPECT_TRUE(ValidateConfig(DaemonConfig()).ok());
}

// Every flag's default is the default-constructed DaemonConfig's field it
// fills, and every limit the daemon hands the service is ServiceOptions'
// default too (each written once, in server/limits.h; a field that is not a
// limit is written in config.h and config.cc, tied here).
TEST(DaemonConfig, DefaultsAreTheFlagsAndTheServicesDefaults) {
  const DaemonConfig c;
  const ServiceOptions o;
  struct Case {
    std::string flag;     // absl name (underscores)
    std::string config;   // DaemonConfig{}'s value, as the flag prints it
    std::string service;  // ServiceOptions{}'s, empty: not the service's
  };
  const auto str = [](auto v) { return absl::StrCat(v); };
  const std::vector<Case> cases = {
      {"listen", c.listen, ""},
      {"devices", c.devices, ""},
      {"momentum_dtype", c.momentum_dtype, ""},
      {"cpu_threads", str(c.cpu_threads), ""},
      {"cpu_executors", str(c.cpu_executors), ""},
      {"max_batch", str(c.max_batch), ""},
      {"metrics_port", str(c.metrics_port), ""},
      {"state_dir", c.state_dir, o.state_dir},
      {"autotune_cache", c.autotune_cache, o.autotune_cache},
      {"snapshot_every", str(c.snapshot_every), str(o.snapshot_every)},
      {"job_retention_seconds", str(c.job_retention_seconds),
       str(o.job_retention_seconds)},
      {"max_sessions", str(c.max_sessions), str(o.max_sessions)},
      {"max_world_size", str(c.max_world_size), str(o.max_world_size)},
      {"max_job_parameters", str(c.max_job_parameters),
       str(o.max_job_parameters)},
      {"max_job_elements", str(c.max_job_elements), str(o.max_job_elements)},
      // 0 both: the service's "no limit", dmuond's "derived"
      // (DefaultStateBytes), which it hands the service.
      {"max_state_bytes", str(c.max_state_bytes), str(o.max_state_bytes)},
      {"max_state_read_bytes", str(c.max_state_read_bytes),
       str(o.max_state_read_bytes)},
      {"max_ns_steps", str(c.max_ns_steps), str(o.max_ns_steps)},
      {"max_job_id_bytes", str(c.max_job_id_bytes), str(o.max_job_id_bytes)},
      {"max_idle_jobs", str(c.max_idle_jobs), str(o.max_idle_jobs)},
      {"marks_per_job", str(c.marks_per_job), str(o.marks_per_job)},
      {"mark_bytes", str(c.mark_bytes), str(o.mark_bytes)},
      {"attach_timeout_seconds", str(c.attach_timeout_seconds),
       str(o.attach_timeout_seconds)},
      {"max_step_queue_bytes", str(c.max_step_queue_bytes), ""},
      {"max_streams_per_peer", str(c.max_streams_per_peer), ""},
      {"max_message_bytes", str(c.max_message_bytes), str(o.max_message_bytes)},
      {"exit_timeout_secs", str(c.exit_timeout_secs), ""},
      {"nan_policy", c.nan_policy, o.skip_nonfinite ? "skip" : "fail"},
      {"log_level", c.log_level, ""},
      {"log_format", c.log_format, ""},
      {"summary_every_secs", str(c.summary_every_secs), ""},
      {"port_file", c.port_file, ""},
      {"trace_file", c.trace_file, ""},
      {"tls_cert_file", c.tls_cert_file, ""},
      {"tls_key_file", c.tls_key_file, ""},
      {"tls_client_ca_file", c.tls_client_ca_file, ""},
      {"auth_token_file", c.auth_token_file, ""},
      {"metrics_tls", c.metrics_tls ? "true" : "false", ""},
      {"metrics_auth", c.metrics_auth ? "true" : "false", ""},
      {"insecure", c.insecure ? "true" : "false", ""},
  };
  for (const Case& k : cases) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(k.flag);
    ASSERT_NE(flag, nullptr) << "--" << k.flag;
    EXPECT_EQ(flag->DefaultValue(), k.config) << "--" << k.flag;
    if (!k.service.empty()) {
      EXPECT_EQ(k.service, k.config) << "--" << k.flag;
    }
  }
  // --max-state-bytes stays 0 by default: derived, never a fixed number.
  EXPECT_EQ(c.max_state_bytes, 0);
  EXPECT_EQ(o.max_state_bytes, 0u);
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
      {"--metrics-tls", [](DaemonConfig& c) { c.metrics_tls = true; }},
      {"--metrics-auth", [](DaemonConfig& c) { c.metrics_auth = true; }},
      {"--max-world-size", [](DaemonConfig& c) { c.max_world_size = 0; }},
      {"--max-job-parameters",
       [](DaemonConfig& c) { c.max_job_parameters = 0; }},
      {"--max-job-elements", [](DaemonConfig& c) { c.max_job_elements = 0; }},
      {"--max-state-bytes", [](DaemonConfig& c) { c.max_state_bytes = -1; }},
      {"--max-state-read-bytes",
       [](DaemonConfig& c) { c.max_state_read_bytes = 0; }},
      {"--max-ns-steps", [](DaemonConfig& c) { c.max_ns_steps = 0; }},
      {"--max-ns-steps", [](DaemonConfig& c) { c.max_ns_steps = 10001; }},
      {"--max-job-id-bytes", [](DaemonConfig& c) { c.max_job_id_bytes = 0; }},
      {"--max-idle-jobs", [](DaemonConfig& c) { c.max_idle_jobs = -1; }},
      {"--marks-per-job", [](DaemonConfig& c) { c.marks_per_job = 0; }},
      {"--mark-bytes", [](DaemonConfig& c) { c.mark_bytes = -1; }},
      {"--attach-timeout-seconds",
       [](DaemonConfig& c) { c.attach_timeout_seconds = 0; }},
      {"--max-step-queue-bytes",
       [](DaemonConfig& c) { c.max_step_queue_bytes = 0; }},
      {"--max-streams-per-peer",
       [](DaemonConfig& c) { c.max_streams_per_peer = 0; }},
      {"--cpu-threads", [](DaemonConfig& c) { c.cpu_threads = -1; }},
      {"--max-batch", [](DaemonConfig& c) { c.max_batch = 0; }},
      {"--metrics-port", [](DaemonConfig& c) { c.metrics_port = 70000; }},
      {"--metrics-port", [](DaemonConfig& c) { c.metrics_port = -1; }},
      {"--exit-timeout-secs",
       [](DaemonConfig& c) { c.exit_timeout_secs = -1; }},
      {"--summary-every-secs",
       [](DaemonConfig& c) { c.summary_every_secs = -5; }},
      // No port: gRPC would serve on 443 unasked.
      {"--listen=127.0.0.1", [](DaemonConfig& c) { c.listen = "127.0.0.1"; }},
      {"--listen=localhost:", [](DaemonConfig& c) { c.listen = "localhost:"; }},
      {"--listen=127.0.0.1:65536",
       [](DaemonConfig& c) { c.listen = "127.0.0.1:65536"; }},
      {"--listen=127.0.0.1:+80",
       [](DaemonConfig& c) { c.listen = "127.0.0.1:+80"; }},
      {"--listen=::1", [](DaemonConfig& c) { c.listen = "::1"; }},
      {"--listen=[::1]", [](DaemonConfig& c) { c.listen = "[::1]"; }},
      {"--listen=unix:", [](DaemonConfig& c) { c.listen = "unix:"; }},
      {"--tls-cert-file", [](DaemonConfig& c) { c.tls_cert_file = "c"; }},
      {"--tls-cert-file", [](DaemonConfig& c) { c.tls_key_file = "k"; }},
      {"--tls-client-ca-file",
       [](DaemonConfig& c) { c.tls_client_ca_file = "ca"; }},
      {"--listen=0.0.0.0:1", [](DaemonConfig& c) { c.listen = "0.0.0.0:1"; }},
      // TLS without authentication, or tokens without TLS, is not enough.
      {"--listen=10.0.0.1:1",
       [](DaemonConfig& c) {
         c.listen = "10.0.0.1:1";
         c.tls_cert_file = "c";
         c.tls_key_file = "k";
       }},
      {"--listen=[::]:1",
       [](DaemonConfig& c) {
         c.listen = "[::]:1";
         c.auth_token_file = "t";
       }},
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

TEST(DaemonConfig, DefaultStateBytesFollowsWhereTheStateLives) {
  // On devices: two fifths of their memory (momentum and its step-start
  // copy in four fifths); the host's memory does not count then.
  EXPECT_EQ(DefaultStateBytes(uint64_t{24} << 30, 150'000'000'000),
            60'000'000'000u);
  EXPECT_EQ(DefaultStateBytes(0, 1000), 400u);
  // In host memory: a quarter of it.
  EXPECT_EQ(DefaultStateBytes(uint64_t{24} << 30, 0), uint64_t{6} << 30);
  // Neither known: no limit.
  EXPECT_EQ(DefaultStateBytes(0, 0), 0u);
  // Llama-3-8B's 27.9 GB of fp32 momentum fits one H200's default.
  EXPECT_GT(DefaultStateBytes(uint64_t{24} << 30, 150'000'000'000),
            27'900'000'000u);
  DaemonConfig c;
  c.max_state_bytes = 12345;
  EXPECT_EQ(c.state_bytes_limit(150'000'000'000), 12345u);
  EXPECT_NE(c.StateBytesLimitLine(0).find("--max-state-bytes"),
            std::string::npos);
  c.max_state_bytes = 0;
  EXPECT_EQ(c.state_bytes_limit(1000), 400u);
  EXPECT_NE(c.StateBytesLimitLine(1000).find("two fifths"), std::string::npos);
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
  c.metrics_port = 65535;
  c.max_batch = 1;
  c.exit_timeout_secs = 0;
  c.summary_every_secs = 0;
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  for (const char* listen :
       {"127.0.0.1:0", "localhost:65535", "[::1]:50051", "unix:/tmp/d.sock"}) {
    c.listen = listen;
    EXPECT_TRUE(ValidateConfig(c).ok()) << listen << ": " << ValidateConfig(c);
  }
  c.listen = "127.0.0.1:50051";
  c.max_message_bytes = (int64_t{1} << 31) - 1;
  c.log_level = "off";
  c.devices = "auto";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(DaemonConfig, NonLoopbackListenNeedsTlsAndAuthOrInsecure) {
  DaemonConfig c;
  for (const char* l : {"127.0.0.1:0", "127.0.0.2:1", "localhost:1", "[::1]:1",
                        "unix:/tmp/x"}) {
    c.listen = l;
    EXPECT_TRUE(c.loopback()) << l;
    EXPECT_TRUE(ValidateConfig(c).ok()) << l;
  }
  // Decided on the address, not on how the text starts.
  for (const char* l :
       {"127.attacker.example:1", "127.0.0.1.nip.io:1", "localhost.example:1",
        "[::ffff:10.0.0.1]:1", "[::]:1", "0.0.0.0:1", "example.com:1"}) {
    c.listen = l;
    EXPECT_FALSE(c.loopback()) << l;
    EXPECT_FALSE(ValidateConfig(c).ok()) << l;
  }
  c.listen = "[::ffff:127.0.0.1]:1";
  EXPECT_TRUE(c.loopback());
  c.listen = "0.0.0.0:50051";
  EXPECT_FALSE(ValidateConfig(c).ok());
  const std::string msg(ValidateConfig(c).message());
  for (const char* flag : {"--tls-cert-file", "--auth-token-file",
                           "--tls-client-ca-file", "--insecure"}) {
    EXPECT_NE(msg.find(flag), std::string::npos) << flag << ": " << msg;
  }
  c.insecure = true;
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.insecure = false;
  c.tls_cert_file = "cert.pem";
  c.tls_key_file = "key.pem";
  c.auth_token_file = "tokens";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.auth_token_file.clear();
  c.tls_client_ca_file = "ca.pem";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(DaemonConfig, AnUnprotectedMetricsPortBesideAProtectedGrpcPortWarns) {
  DaemonConfig c;
  c.metrics_port = 9464;
  EXPECT_FALSE(c.metrics_less_protected());  // nothing is protected
  c.tls_cert_file = "cert.pem";
  c.tls_key_file = "key.pem";
  c.auth_token_file = "tokens";
  EXPECT_TRUE(c.metrics_less_protected());
  c.metrics_tls = true;
  EXPECT_TRUE(c.metrics_less_protected());
  c.metrics_auth = true;
  EXPECT_FALSE(c.metrics_less_protected());
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.metrics_port = 0;
  c.metrics_tls = false;
  EXPECT_FALSE(c.metrics_less_protected());  // no metrics port
}

}  // namespace
}  // namespace dmuon::server
