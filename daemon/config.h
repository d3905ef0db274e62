// dmuond's configuration: every --flag of the daemon in one struct, read from
// the absl flags in one place (ConfigFromFlags) and checked in one place
// (ValidateConfig), each error naming its flag. The rest of the daemon
// (daemon_main.cc) reads DaemonConfig, never a flag.

#ifndef DMUON_DAEMON_CONFIG_H_
#define DMUON_DAEMON_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dmuon::server {

struct DaemonConfig {
  // --listen: host:port of the gRPC server (port 0 picks a free one).
  std::string listen = "127.0.0.1:50051";
  // --devices: 'cpu', 'auto', 'cuda' or 'cuda:0,1' (ParseDeviceSpec).
  std::string devices = "cpu";
  // --momentum-dtype: 'fp32' or 'bf16'.
  std::string momentum_dtype = "fp32";
  // --cpu-threads: OpenBLAS threads in total; <= 0: every core.
  int cpu_threads = 0;
  int cpu_executors = 1;  // --cpu-executors, >= 1
  int max_batch = 16;     // --max-batch
  // --metrics-port: Prometheus /metrics on the --listen host; <= 0: off.
  int metrics_port = 0;
  std::string state_dir;            // --state-dir; empty: no snapshots
  std::string autotune_cache;       // --autotune-cache; empty: the cost model
  int snapshot_every = 0;           // --snapshot-every, >= 0
  int job_retention_seconds = 600;  // --job-retention-seconds, >= 0
  int max_sessions = 64;            // --max-sessions, >= 1
  int64_t max_message_bytes = int64_t{64} << 20;  // [4096, 2^31)
  int exit_timeout_secs = 30;                     // --exit-timeout-secs
  std::string nan_policy = "skip";                // 'skip' | 'fail'
  std::string log_level = "info";   // trace|debug|info|warn|error|off
  std::string log_format = "text";  // text|json
  int summary_every_secs = 60;      // --summary-every-secs; <= 0: never
  std::string port_file;            // --port-file; empty: none

  // The host part of `listen` (what /metrics binds to).
  std::string ListenHost() const;
  bool json_log() const { return log_format == "json"; }
  bool skip_nonfinite() const { return nan_policy == "skip"; }
  bool bf16_momentum() const { return momentum_dtype == "bf16"; }
};

// INVALID_ARGUMENT naming the first flag whose value is not allowed, as
// "--flag-name ...". Checks each value on its own; what depends on the
// executors (--momentum-dtype=bf16 needs CUDA ones) is checked when they
// are made.
absl::Status ValidateConfig(const DaemonConfig& config);

// The config from the parsed absl flags (ParseFlags has run), validated.
absl::StatusOr<DaemonConfig> ConfigFromFlags();

// The file defining dmuond's flags (for ParseFlags' --help).
inline constexpr char kDaemonFlagsSource[] = "daemon/config.cc";

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_CONFIG_H_
