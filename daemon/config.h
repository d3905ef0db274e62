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
#include "server/limits.h"

namespace dmuon::server {

struct DaemonConfig {
  // --listen: host:port of the gRPC server (port 0 picks a free one).
  std::string listen = "127.0.0.1:50051";
  // --devices: 'cpu', 'auto', 'cuda' or 'cuda:0,1' (ParseDeviceSpec).
  std::string devices = "cpu";
  // --momentum-dtype: 'fp32' or 'bf16'.
  std::string momentum_dtype = "fp32";
  // --cpu-threads: OpenBLAS threads in total; <= 0: every core this process
  // may use (usable_cpus.h: the affinity mask, capped by the CPU quota).
  int cpu_threads = 0;
  int cpu_executors = 1;  // --cpu-executors, >= 1
  int max_batch = 16;     // --max-batch
  // --metrics-port: Prometheus /metrics on the --listen host, in [0, 65535];
  // 0: off.
  int metrics_port = 0;
  std::string state_dir;       // --state-dir; empty: no snapshots
  std::string autotune_cache;  // --autotune-cache; empty: the cost model
  int snapshot_every = kDefaultSnapshotEvery;  // --snapshot-every, >= 0
  // --job-retention-seconds, >= 0
  int job_retention_seconds = kDefaultJobRetentionSeconds;
  int max_sessions = kDefaultMaxSessions;  // --max-sessions, >= 1
  // Limits on what one peer may make the daemon hold (docs/security.md
  // "Limits"; ServiceOptions has their meaning; the defaults are
  // server/limits.h's).
  int max_world_size = kDefaultMaxWorldSize;  // --max-world-size, >= 1
  // --max-job-parameters, >= 1
  int max_job_parameters = kDefaultMaxJobParameters;
  // --max-job-elements, >= 1
  int64_t max_job_elements = kDefaultMaxJobElements;
  // --max-state-bytes, >= 0; 0: the default, sized from the memory that
  // holds the state (state_bytes_limit(), DefaultStateBytes).
  int64_t max_state_bytes = kDefaultMaxStateBytes;
  // --max-state-read-bytes, >= 1: every GetState stream together.
  int64_t max_state_read_bytes = kDefaultMaxStateReadBytes;
  int max_ns_steps = kDefaultMaxNsSteps;         // --max-ns-steps, >= 1
  int max_job_id_bytes = kDefaultMaxJobIdBytes;  // --max-job-id-bytes, >= 1
  int max_idle_jobs = kDefaultMaxIdleJobs;       // --max-idle-jobs, >= 0
  int marks_per_job = kDefaultMarksPerJob;       // --marks-per-job, >= 1
  int64_t mark_bytes = kDefaultMarkBytes;        // --mark-bytes, >= 0
  // --attach-timeout-seconds, >= 1
  int attach_timeout_seconds = kDefaultAttachTimeoutSeconds;
  // --max-step-queue-bytes, >= 1: a session's Step responses queued for
  // its client; past it the stream's next request is not read.
  int64_t max_step_queue_bytes = kDefaultMaxStepQueueBytes;
  // --max-streams-per-peer, >= 1: Step, GetState and SetState streams of
  // one peer host at once.
  int max_streams_per_peer = kDefaultMaxStreamsPerPeer;
  int64_t max_message_bytes = kDefaultMaxMessageBytes;  // [4096, 2^31)
  int exit_timeout_secs = 30;                           // --exit-timeout-secs
  std::string nan_policy = "skip";                      // 'skip' | 'fail'
  // --strict: refuse every fallback (server/fallbacks.h) instead of taking
  // it.
  bool strict = false;
  std::string log_level = "info";   // trace|debug|info|warn|error|off
  std::string log_format = "text";  // text|json
  int summary_every_secs = 60;      // --summary-every-secs, >= 0; 0: never
  std::string port_file;            // --port-file; empty: none
  // --trace-file: the step timeline's file (daemon/trace_file.h), made or
  // truncated at start (one that cannot be written: an error naming the
  // flag); empty: no tracing but a Trace RPC's window.
  std::string trace_file;
  // Security (docs/security.md). --tls-cert-file and --tls-key-file: PEM
  // server certificate and key (both or neither): TLS on --listen.
  std::string tls_cert_file;
  std::string tls_key_file;
  // --tls-client-ca-file: PEM CA bundle; set: clients must present a
  // certificate it signed (mTLS). Needs the two above.
  std::string tls_client_ca_file;
  // --auth-token-file: `<role> <token> [name]` lines (daemon/auth.h);
  // clients send `authorization: Bearer <token>`. Re-read on SIGHUP.
  std::string auth_token_file;
  // --metrics-tls: /metrics over HTTPS with --tls-cert-file and
  // --tls-key-file (re-read on SIGHUP with them). Needs them.
  bool metrics_tls = false;
  // --metrics-auth: /metrics needs 'Authorization: Bearer <token>' with a
  // token of --auth-token-file, of any role. Needs it.
  bool metrics_auth = false;
  // --insecure: allow a non-loopback --listen without TLS and
  // authentication (tokens or mTLS); logged as a warning.
  bool insecure = false;

  // The host part of `listen` (what /metrics binds to).
  std::string ListenHost() const;
  bool json_log() const { return log_format == "json"; }
  bool skip_nonfinite() const { return nan_policy == "skip"; }
  bool bf16_momentum() const { return momentum_dtype == "bf16"; }
  // --max-state-bytes, or its default (0) resolved by DefaultStateBytes
  // for this host and `device_memory` (the summed device_memory_capacity()
  // of executors keeping state on devices; 0: state in host memory).
  uint64_t state_bytes_limit(uint64_t device_memory) const;
  // One line for the log: the limit in force and where it comes from.
  std::string StateBytesLimitLine(uint64_t device_memory) const;
  bool tls() const { return !tls_cert_file.empty(); }
  // Callers are authenticated: tokens, or mTLS client certificates.
  bool authenticated() const {
    return !auth_token_file.empty() || !tls_client_ca_file.empty();
  }
  // --listen's host is a loopback address: a unix socket, "localhost", or
  // an address that parses as 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104 (any
  // other name is not: DNS may resolve it to anything).
  bool loopback() const;
  // A non-loopback --listen without TLS and authentication: needs
  // --insecure (ValidateConfig), and dmuond warns.
  bool exposed_insecurely() const {
    return !loopback() && !(tls() && authenticated());
  }
  // The gRPC port is protected (TLS and authentication) but /metrics is
  // served without TLS or without tokens: dmuond warns.
  bool metrics_less_protected() const {
    return metrics_port > 0 && tls() && authenticated() &&
           !(metrics_tls && metrics_auth);
  }
};

// INVALID_ARGUMENT naming the first flag whose value is not allowed, as
// "--flag-name ...". Checks each value on its own; what depends on the
// executors (--momentum-dtype=bf16 needs CUDA ones) is checked when they
// are made.
absl::Status ValidateConfig(const DaemonConfig& config);

// --max-state-bytes' default: the fp32 momentum bytes all jobs together may
// hold. `device_memory` > 0 (the total memory of the devices whose
// executors keep state there): two fifths of it, since the CUDA executor
// keeps a step-start copy of every momentum buffer (the two take four
// fifths) and a fifth stays for staging buffers, Newton-Schulz workspaces
// and plans. Otherwise (state in host memory) a quarter of `host_memory`:
// the gather buffers and the ranks' regions take as much again. 0 (no
// limit) when both are unknown (0).
uint64_t DefaultStateBytes(uint64_t host_memory, uint64_t device_memory);

// The config from the parsed absl flags (ParseFlags has run), validated.
absl::StatusOr<DaemonConfig> ConfigFromFlags();

// The file defining dmuond's flags (for ParseFlags' --help).
inline constexpr char kDaemonFlagsSource[] = "daemon/config.cc";

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_CONFIG_H_
