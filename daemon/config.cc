// DaemonConfig (config.h): dmuond's flags, read and validated in one place.

#include "daemon/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/host_port.h"
#include "kernels/types.h"
#include "server/gpu_logic.h"

// dmuond's flags (`dmuond --help` lists the ones defined in this file). The
// limits' defaults are server/limits.h's (DaemonConfig's too: config_test.cc).
ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address to serve on (host:port; port 0 picks a free one)");
ABSL_FLAG(std::string, devices, "cpu",
          "optimizer devices: 'cpu', 'auto' (every GPU, else the CPU), 'cuda' "
          "(every GPU) or 'cuda:0,1' (those GPUs; CUDA executors need the "
          "dmuond_cuda build)");
ABSL_FLAG(std::string, momentum_dtype, "fp32",
          "CUDA executors' momentum storage: 'fp32', or 'bf16' (half the "
          "device memory; CHANGES THE NUMBERS: momentum is rounded to bf16 "
          "every step)");
ABSL_FLAG(int, cpu_threads, 0,
          "OpenBLAS threads in total (0: every core this process may use: its "
          "affinity mask, capped by its cgroup CPU quota)");
ABSL_FLAG(
    int, cpu_executors, 1,
    "CPU executors (each a queue and a thread; threads are split among them)");
ABSL_FLAG(int, max_batch, 16,
          "most same-shape matrices in one batched launch (GPU executors; a "
          "CPU executor runs one matrix at a time)");
ABSL_FLAG(int, metrics_port, 0,
          "Prometheus /metrics port on the --listen host (0 disables)");
ABSL_FLAG(
    std::string, state_dir, "",
    "directory for state snapshots; a restarted daemon resumes jobs from it "
    "(made if missing, mode 0700; locked: one daemon per directory)");
ABSL_FLAG(
    std::string, autotune_cache, "",
    "file caching measured method choices: parameters with method 'auto' get "
    "the faster of direct and Gram as measured on this daemon's executors "
    "(the CPU, or dmuond_cuda's first GPU), and the planner balances measured "
    "times (empty: the cost model decides)");
ABSL_FLAG(int, snapshot_every, dmuon::server::kDefaultSnapshotEvery,
          "snapshot each job every N completed steps (0: only at shutdown)");
ABSL_FLAG(int, job_retention_seconds,
          dmuon::server::kDefaultJobRetentionSeconds,
          "seconds a job whose ranks have all closed keeps its momentum "
          "in the daemon (device memory on GPUs) for a restarted trainer to "
          "reopen the same job id and continue; then it is dropped and its "
          "memory freed. With --state-dir it is snapshotted first and a "
          "later reopen resumes from the snapshot; WITHOUT --state-dir ITS "
          "MOMENTUM IS GONE and a reopen starts from zero. 0: drop as soon as "
          "the last rank closes; >= 0");
ABSL_FLAG(int, max_sessions, dmuon::server::kDefaultMaxSessions,
          "most open sessions; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_world_size, dmuon::server::kDefaultMaxWorldSize,
          "most ranks in one job (OpenSession world_size); more get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_job_parameters, dmuon::server::kDefaultMaxJobParameters,
          "most parameters (matrices) in one job's table; more get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_job_elements, dmuon::server::kDefaultMaxJobElements,
          "most matrix elements (sum of rows*cols) in one job's table, 4 bytes "
          "of momentum each; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_state_bytes, dmuon::server::kDefaultMaxStateBytes,
          "most fp32 momentum bytes of all jobs together (idle ones "
          "included); a new job past it gets RESOURCE_EXHAUSTED. 0: the "
          "default, two fifths of the GPUs' memory when CUDA executors keep "
          "the state (the step-start copies take as much again), else a "
          "quarter of the host's physical memory; logged at start");
ABSL_FLAG(int64_t, max_state_read_bytes,
          dmuon::server::kDefaultMaxStateReadBytes,
          "most bytes every GetState stream together holds (a chunk and its "
          "serialized copy each); past it readers get smaller chunks (down "
          "to 1 MiB), then wait up to 10 s, then RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_ns_steps, dmuon::server::kDefaultMaxNsSteps,
          "most Newton-Schulz steps of a schedule (ns_steps, or a custom "
          "schedule's coefficients); more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_job_id_bytes, dmuon::server::kDefaultMaxJobIdBytes,
          "longest job id in bytes (job ids are printable ASCII); longer get "
          "INVALID_ARGUMENT");
ABSL_FLAG(int, max_idle_jobs, dmuon::server::kDefaultMaxIdleJobs,
          "most jobs kept without an open rank (--job-retention-seconds); "
          "past it the oldest idle ones are dropped first (snapshotted with "
          "--state-dir)");
ABSL_FLAG(int, marks_per_job, dmuon::server::kDefaultMarksPerJob,
          "marks (a job's momentum at a checkpointed step, Mark) kept per "
          "job; past it the job's oldest is dropped");
ABSL_FLAG(int64_t, mark_bytes, dmuon::server::kDefaultMarkBytes,
          "bytes of momentum every job's marks together may hold in memory; "
          "past it the oldest marks of any job are dropped (0: no marks)");
ABSL_FLAG(int, attach_timeout_seconds,
          dmuon::server::kDefaultAttachTimeoutSeconds,
          "a session whose Step stream has not attached this many seconds "
          "after OpenSession is closed and its shm segment freed; a Step "
          "stream that has not sent its attach this long after it started "
          "ends with DEADLINE_EXCEEDED");
ABSL_FLAG(int, max_streams_per_peer, dmuon::server::kDefaultMaxStreamsPerPeer,
          "most Step, GetState and SetState streams open at once from one "
          "peer host (its address without the port); one more gets "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_step_queue_bytes,
          dmuon::server::kDefaultMaxStepQueueBytes,
          "most bytes of Step responses queued for one session whose client "
          "does not read them; past it the daemon stops reading that "
          "session's requests (its next step waits) until the client has "
          "read below it");
ABSL_FLAG(int64_t, max_message_bytes, dmuon::server::kDefaultMaxMessageBytes,
          "largest gRPC message accepted or sent; inline tensors travel in "
          "chunks below it");
ABSL_FLAG(
    int, exit_timeout_secs, 30,
    "on SIGTERM/SIGINT: seconds to finish in-flight steps, snapshot and exit");
ABSL_FLAG(std::string, nan_policy, "skip",
          "a gradient with NaN/Inf: 'skip' (momentum untouched, zero update, "
          "reported) "
          "or 'fail' (the job's step fails)");
ABSL_FLAG(bool, strict, false,
          "refuse every fallback instead of taking it (a failed CUDA graph "
          "fails its batch; a new job is refused rather than planned around "
          "an unhealthy executor): FAILED_PRECONDITION naming the kind; "
          "without it each is taken, logged once and counted in Status and "
          "dmuon_fallbacks_total{kind}");
ABSL_FLAG(std::string, log_level, "info", "trace|debug|info|warn|error");
ABSL_FLAG(std::string, log_format, "text",
          "text|json (one JSON object per line)");
ABSL_FLAG(int, summary_every_secs, 60,
          "seconds between summary log lines (0: never)");
ABSL_FLAG(std::string, port_file, "",
          "write the bound gRPC port to this file once serving (for scripts "
          "and tests)");
ABSL_FLAG(std::string, trace_file, "",
          "write the step timeline (every matrix's received, queued, gather, "
          "Newton-Schulz and return, per executor) to this file as Chrome "
          "trace-event JSON (Perfetto, chrome://tracing) while dmuond runs; "
          "merge it with the trainer's DMUON_TRACE file: python -m "
          "dmuon.trace merge OUT IN...");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM server certificate (chain): serve gRPC over TLS (with "
          "--tls-key-file)");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls-cert-file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: clients must present a certificate signed by it "
          "(mTLS; needs --tls-cert-file)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of '<role> <token> [name]' lines (roles: reader, trainer, "
          "operator); clients send 'authorization: Bearer <token>'; re-read "
          "on SIGHUP, which ends the open streams of a token it drops "
          "(UNAUTHENTICATED) or lowers below their role (PERMISSION_DENIED); "
          "mTLS certificates are not revoked");
ABSL_FLAG(bool, metrics_tls, false,
          "serve /metrics over HTTPS with --tls-cert-file and --tls-key-file "
          "(re-read on SIGHUP with them)");
ABSL_FLAG(bool, metrics_auth, false,
          "/metrics needs 'Authorization: Bearer <token>' with a token of "
          "--auth-token-file (any role: reader suffices)");
ABSL_FLAG(bool, insecure, false,
          "allow a --listen address other than loopback without TLS "
          "(--tls-cert-file) and authentication (--auth-token-file or "
          "--tls-client-ca-file): anyone who reaches the port may use and "
          "drain the daemon");

namespace dmuon::server {
namespace {

absl::Status Invalid(const std::string& msg) {
  return absl::InvalidArgumentError(msg);
}

// The host's physical memory; 0 when unknown.
uint64_t HostMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

bool IsLogLevel(const std::string& s) {
  for (const char* l : {"trace", "debug", "info", "warn", "warning", "err",
                        "error", "critical", "off"}) {
    if (s == l) return true;
  }
  return false;
}

}  // namespace

uint64_t DefaultStateBytes(uint64_t host_memory, uint64_t device_memory) {
  if (device_memory > 0) return device_memory / 5 * 2;
  return host_memory / 4;
}

uint64_t DaemonConfig::state_bytes_limit(uint64_t device_memory) const {
  if (max_state_bytes > 0) return static_cast<uint64_t>(max_state_bytes);
  return DefaultStateBytes(HostMemoryBytes(), device_memory);
}

std::string DaemonConfig::StateBytesLimitLine(uint64_t device_memory) const {
  const uint64_t limit = state_bytes_limit(device_memory);
  const auto gb = [](uint64_t b) {
    return absl::StrFormat("%.1f GB", static_cast<double>(b) / 1e9);
  };
  if (max_state_bytes > 0) {
    return absl::StrCat("state limit: ", limit, " bytes (", gb(limit),
                        ") of fp32 momentum, --max-state-bytes");
  }
  if (limit == 0) {
    return "state limit: none (--max-state-bytes unset and the host's "
           "memory unknown)";
  }
  return absl::StrCat(
      "state limit: ", limit, " bytes (", gb(limit),
      ") of fp32 momentum, the default: ",
      device_memory > 0
          ? absl::StrCat("two fifths of the state devices' ", gb(device_memory))
          : absl::StrCat("a quarter of the host's ", gb(HostMemoryBytes())),
      " (--max-state-bytes sets it)");
}

std::string DaemonConfig::ListenHost() const {
  return listen.substr(0, listen.rfind(':'));
}

bool DaemonConfig::loopback() const {
  if (listen.rfind("unix:", 0) == 0) return true;
  std::string h = ListenHost();
  if (h == "localhost") return true;  // the one name taken as loopback
  // Decided on the address that will be bound, parsed as a number (never
  // on how the text starts: "127.evil.example" is a name, resolved by DNS
  // to anything, so not loopback).
  if (h.size() > 2 && h.front() == '[' && h.back() == ']')
    h = h.substr(1, h.size() - 2);
  in_addr v4;
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1)
    return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (::inet_pton(AF_INET6, h.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

namespace {

// --listen is unix:PATH, HOST:PORT or [IPv6]:PORT, PORT a number in
// [0, 65535] (0: a free port): without one gRPC would pick 443 unasked.
absl::Status ValidateListen(const std::string& listen) {
  if (listen.rfind("unix:", 0) == 0) {
    if (listen.size() > 5) return absl::OkStatus();
    return Invalid("--listen=unix: needs a path (unix:/path/to/socket)");
  }
  if (!ParseHostPort(listen)) {
    return Invalid("--listen=" + listen +
                   " is not HOST:PORT, [IPv6]:PORT (PORT in [0, 65535], 0: a "
                   "free one) or unix:PATH");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateConfig(const DaemonConfig& c) {
  if (absl::Status st = ValidateListen(c.listen); !st.ok()) return st;
  if (c.log_format != "text" && c.log_format != "json")
    return Invalid("--log-format must be 'text' or 'json', got '" +
                   c.log_format + "'");
  if (!IsLogLevel(c.log_level))
    return Invalid("--log-level must be trace|debug|info|warn|error|off");
  if (c.nan_policy != "skip" && c.nan_policy != "fail")
    return Invalid("--nan-policy must be 'skip' or 'fail'");
  if (c.max_sessions < 1) return Invalid("--max-sessions must be >= 1");
  if (c.max_world_size < 1) return Invalid("--max-world-size must be >= 1");
  if (c.max_job_parameters < 1)
    return Invalid("--max-job-parameters must be >= 1");
  if (c.max_job_elements < 1) return Invalid("--max-job-elements must be >= 1");
  if (c.max_state_bytes < 0)
    return Invalid("--max-state-bytes must be >= 0 (0: the default)");
  if (c.max_state_read_bytes < 1)
    return Invalid("--max-state-read-bytes must be >= 1");
  if (c.max_ns_steps < 1 || c.max_ns_steps > kernels::kMaxNsSteps) {
    return Invalid(absl::StrCat("--max-ns-steps must be in [1, ",
                                kernels::kMaxNsSteps,
                                "] (the kernels' bound)"));
  }
  if (c.max_job_id_bytes < 1) return Invalid("--max-job-id-bytes must be >= 1");
  if (c.max_idle_jobs < 0) return Invalid("--max-idle-jobs must be >= 0");
  if (c.marks_per_job < 1) return Invalid("--marks-per-job must be >= 1");
  if (c.mark_bytes < 0)
    return Invalid("--mark-bytes must be >= 0 (0: no marks are kept)");
  if (c.attach_timeout_seconds < 1)
    return Invalid("--attach-timeout-seconds must be >= 1");
  if (c.max_streams_per_peer < 1)
    return Invalid("--max-streams-per-peer must be >= 1");
  if (c.max_step_queue_bytes < 1)
    return Invalid("--max-step-queue-bytes must be >= 1");
  if (c.max_message_bytes < 4096 ||
      c.max_message_bytes > (int64_t{1} << 31) - 1)
    return Invalid("--max-message-bytes must be in [4096, 2^31)");
  if (c.snapshot_every < 0) return Invalid("--snapshot-every must be >= 0");
  if (c.job_retention_seconds < 0)
    return Invalid("--job-retention-seconds must be >= 0");
  // Names the flag itself ("--devices=...: ...").
  if (auto spec = ParseDeviceSpec(c.devices); !spec.ok()) return spec.status();
  if (c.momentum_dtype != "fp32" && c.momentum_dtype != "bf16")
    return Invalid("--momentum-dtype must be 'fp32' or 'bf16'");
  if (c.cpu_executors < 1) return Invalid("--cpu-executors must be >= 1");
  if (c.cpu_threads < 0)
    return Invalid("--cpu-threads must be >= 0 (0: every core)");
  if (c.max_batch < 1) return Invalid("--max-batch must be >= 1");
  if (c.metrics_port < 0 || c.metrics_port > 65535)
    return Invalid("--metrics-port must be in [0, 65535] (0: off), got " +
                   std::to_string(c.metrics_port));
  if (c.exit_timeout_secs < 0)
    return Invalid("--exit-timeout-secs must be >= 0");
  if (c.summary_every_secs < 0)
    return Invalid("--summary-every-secs must be >= 0 (0: never)");
  if (c.tls_cert_file.empty() != c.tls_key_file.empty())
    return Invalid("--tls-cert-file and --tls-key-file go together");
  if (!c.tls_client_ca_file.empty() && c.tls_cert_file.empty())
    return Invalid(
        "--tls-client-ca-file needs --tls-cert-file and "
        "--tls-key-file (mTLS is TLS)");
  if (c.metrics_tls && c.tls_cert_file.empty())
    return Invalid("--metrics-tls needs --tls-cert-file and --tls-key-file");
  if (c.metrics_auth && c.auth_token_file.empty())
    return Invalid("--metrics-auth needs --auth-token-file");
  if (c.exposed_insecurely() && !c.insecure) {
    return Invalid(
        "--listen=" + c.listen +
        " is not a loopback address: serve it with TLS (--tls-cert-file, "
        "--tls-key-file) and authentication (--auth-token-file or "
        "--tls-client-ca-file), or accept that anyone who reaches it may use "
        "and drain the daemon with --insecure");
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> ConfigFromFlags() {
  DaemonConfig c;
  c.listen = absl::GetFlag(FLAGS_listen);
  c.devices = absl::GetFlag(FLAGS_devices);
  c.momentum_dtype = absl::GetFlag(FLAGS_momentum_dtype);
  c.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  c.cpu_executors = absl::GetFlag(FLAGS_cpu_executors);
  c.max_batch = absl::GetFlag(FLAGS_max_batch);
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  c.state_dir = absl::GetFlag(FLAGS_state_dir);
  c.autotune_cache = absl::GetFlag(FLAGS_autotune_cache);
  c.snapshot_every = absl::GetFlag(FLAGS_snapshot_every);
  c.job_retention_seconds = absl::GetFlag(FLAGS_job_retention_seconds);
  c.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  c.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  c.max_job_parameters = absl::GetFlag(FLAGS_max_job_parameters);
  c.max_job_elements = absl::GetFlag(FLAGS_max_job_elements);
  c.max_state_bytes = absl::GetFlag(FLAGS_max_state_bytes);
  c.max_state_read_bytes = absl::GetFlag(FLAGS_max_state_read_bytes);
  c.max_ns_steps = absl::GetFlag(FLAGS_max_ns_steps);
  c.max_job_id_bytes = absl::GetFlag(FLAGS_max_job_id_bytes);
  c.max_idle_jobs = absl::GetFlag(FLAGS_max_idle_jobs);
  c.marks_per_job = absl::GetFlag(FLAGS_marks_per_job);
  c.mark_bytes = absl::GetFlag(FLAGS_mark_bytes);
  c.attach_timeout_seconds = absl::GetFlag(FLAGS_attach_timeout_seconds);
  c.max_step_queue_bytes = absl::GetFlag(FLAGS_max_step_queue_bytes);
  c.max_streams_per_peer = absl::GetFlag(FLAGS_max_streams_per_peer);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.exit_timeout_secs = absl::GetFlag(FLAGS_exit_timeout_secs);
  c.nan_policy = absl::GetFlag(FLAGS_nan_policy);
  c.strict = absl::GetFlag(FLAGS_strict);
  c.log_level = absl::GetFlag(FLAGS_log_level);
  c.log_format = absl::GetFlag(FLAGS_log_format);
  c.summary_every_secs = absl::GetFlag(FLAGS_summary_every_secs);
  c.port_file = absl::GetFlag(FLAGS_port_file);
  c.trace_file = absl::GetFlag(FLAGS_trace_file);
  c.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  c.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  c.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  c.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  c.metrics_tls = absl::GetFlag(FLAGS_metrics_tls);
  c.metrics_auth = absl::GetFlag(FLAGS_metrics_auth);
  c.insecure = absl::GetFlag(FLAGS_insecure);
  if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
  return c;
}

}  // namespace dmuon::server
