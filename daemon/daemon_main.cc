// The body of dmuond (daemon_main.h), in the order it runs: the config from
// the flags (config.h), logging, the executors, the service, /metrics, the
// gRPC server and its health, serving until a signal, then drain and
// shutdown. See `dmuond --help` and README.md.

#include "daemon/daemon_main.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <malloc.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "base/protocol.h"
#include "base/trace.h"
#include "daemon/auth.h"
#include "daemon/config.h"
#include "daemon/flags.h"
#include "daemon/grpc_service.h"
#include "daemon/listen_probe.h"
#include "daemon/logging.h"
#include "daemon/metrics_http.h"
#include "daemon/prometheus_metrics.h"
#include "daemon/quotas_file.h"
#include "daemon/state_dir.h"
#include "daemon/tls_files.h"
#include "daemon/trace_file.h"
#include "daemon/usable_cpus.h"
#include "kernels/blas_core.h"
#include "server/gpu_logic.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// Set across UseBestBlasKernels' exec: the kernels OpenBLAS first chose;
// set when its exec failed: why. The operator's switch to turn it off.
constexpr char kBlasCoreWas[] = "DMUON_BLAS_CORE_WAS";
constexpr char kBlasExecError[] = "DMUON_BLAS_EXEC_ERROR";
constexpr char kNoBlasReexec[] = "DMUON_NO_BLAS_REEXEC";

constexpr char kUsage[] =
    "dmuond: the dmuon optimizer daemon. It owns the Muon momentum state and "
    "orthogonalizes every weight matrix for the trainers that connect to "
    "it.\n"
    "  dmuond --listen=127.0.0.1:50051 --metrics-port=9464 "
    "--state-dir=/var/lib/dmuon";

// Health services: readiness ("" and the Optimizer service: NOT_SERVING
// once draining, so no new trainer is sent here) and liveness
// ("dmuon.liveness": SERVING for as long as the process answers, draining
// or not, so a liveness probe does not restart a daemon that is finishing
// steps).
constexpr char kReadiness[] = "dmuon.v1.Optimizer";
constexpr char kLiveness[] = "dmuon.liveness";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "dmuond: %s\n", msg.c_str());
  return 2;
}

int Fail(const absl::Status& st) { return Fail(std::string(st.message())); }

// "cannot listen on ADDRESS[: why]".
std::string CannotListen(const std::string& host, int port) {
  const std::string address = host + ":" + std::to_string(port);
  const std::string why = port > 0 ? ListenProbe(host, port) : "";
  return "cannot listen on " + address + (why.empty() ? "" : ": " + why);
}

// Sets only named services: grpc's unnamed SetServingStatus(bool) sets every
// service, liveness included.
class ServingHealth {
 public:
  explicit ServingHealth(grpc::HealthCheckServiceInterface* h) : h_(h) {
    h_->SetServingStatus(kLiveness, true);
  }
  void SetReady(bool ready) {
    h_->SetServingStatus("", ready);
    h_->SetServingStatus(kReadiness, ready);
  }

 private:
  grpc::HealthCheckServiceInterface* const h_;
};

// The executors: CUDA ones from `gpu` for a --devices other than 'cpu'
// (then also the GPU transports and the autotuner's backend, in *opts),
// else --cpu-executors CPU ones sharing *threads OpenBLAS threads.
absl::StatusOr<std::vector<std::unique_ptr<Executor>>> BuildExecutors(
    const DaemonConfig& config, const GpuSupport* gpu, ServiceOptions* opts,
    int* threads) {
  const auto spec = ParseDeviceSpec(config.devices);
  if (!spec.ok()) return spec.status();
  std::vector<std::unique_ptr<Executor>> ex;
  if (spec->kind == DeviceSpec::Kind::kCuda && gpu == nullptr) {
    return absl::InvalidArgumentError(
        "--devices=" + config.devices +
        ": this build has CPU executors only; run dmuond_cuda (the CUDA "
        "build) for GPUs, or use --devices=cpu");
  }
  if (spec->kind != DeviceSpec::Kind::kCpu && gpu != nullptr) {
    std::string why;
    auto cuda = gpu->executors(config.devices, config.bf16_momentum(),
                               config.strict, &why);
    if (!cuda.ok()) return cuda.status();
    ex = *std::move(cuda);
    if (ex.empty()) {
      spdlog::warn("--devices={}: no usable GPU ({}); using the CPU",
                   config.devices, why);
    }
  }
  if (!ex.empty()) {
    std::vector<std::string> names;
    for (const auto& e : ex) names.push_back(e->device());
    if (gpu->transports) opts->device_transports = gpu->transports(names);
    if (gpu->tuning && !opts->autotune_cache.empty()) {
      auto tuning = gpu->tuning(names);
      if (tuning.ok()) {
        opts->tuning = *std::move(tuning);
        spdlog::info("--autotune-cache: methods measured on {}",
                     opts->tuning.device);
      } else {
        spdlog::warn(
            "--autotune-cache={}: {}; the cost model chooses methods instead",
            opts->autotune_cache, std::string(tuning.status().message()));
        opts->autotune_cache.clear();
      }
    }
  } else if (config.momentum_dtype != "fp32") {
    return absl::InvalidArgumentError(
        "--momentum-dtype=" + config.momentum_dtype +
        ": CPU executors keep fp32 momentum");
  }
  *threads =
      config.cpu_threads > 0
          ? config.cpu_threads
          : UsableCpus();  // the affinity mask and CPU quota, not the node's
  if (ex.empty()) {
    for (int i = 0; i < config.cpu_executors; ++i) {
      ex.push_back(
          NewCpuExecutor(i, std::max(1, *threads / config.cpu_executors)));
    }
  }
  for (const auto& e : ex) opts->devices.push_back(e->device());
  return ex;
}

// The summed memory of the devices whose executors keep state there (0: the
// state is in host memory).
uint64_t StateDeviceMemory(
    const std::vector<std::unique_ptr<Executor>>& executors) {
  uint64_t total = 0;
  for (const auto& e : executors)
    if (e->holds_state()) total += e->device_memory_capacity();
  return total;
}

// The service's options from the config (devices and GPU parts are added
// by BuildExecutors; max_state_bytes by DaemonMain, once they are made).
ServiceOptions ServiceOptionsOf(const DaemonConfig& config) {
  ServiceOptions opts;
  opts.skip_nonfinite = config.skip_nonfinite();
  opts.max_sessions = config.max_sessions;
  opts.max_message_bytes = static_cast<uint64_t>(config.max_message_bytes);
  opts.state_dir = config.state_dir;
  opts.snapshot_every = config.snapshot_every;
  opts.autotune_cache = config.autotune_cache;
  opts.job_retention_seconds = config.job_retention_seconds;
  opts.max_world_size = config.max_world_size;
  opts.max_job_parameters = config.max_job_parameters;
  opts.max_job_elements = config.max_job_elements;
  opts.max_ns_steps = config.max_ns_steps;
  opts.max_state_read_bytes =
      static_cast<uint64_t>(config.max_state_read_bytes);
  opts.max_job_id_bytes = config.max_job_id_bytes;
  opts.max_idle_jobs = config.max_idle_jobs;
  opts.marks_per_job = config.marks_per_job;
  opts.mark_bytes = static_cast<uint64_t>(config.mark_bytes);
  opts.attach_timeout_seconds = config.attach_timeout_seconds;
  opts.snapshot_failed = [](const absl::Status& st) {
    spdlog::error("snapshot: {}", LogSafe(st.ToString(), 1024));
  };
  opts.strict = config.strict;
  // Once per kind per process (fallbacks.h): the counter says how often.
  opts.fallback_logged = [](std::string_view kind, const std::string& why) {
    spdlog::warn(
        "fallback {}: {} (logged once; counted in Status and "
        "dmuon_fallbacks_total{{kind=\"{}\"}})",
        std::string(kind), LogSafe(why, 1024), std::string(kind));
  };
  return opts;
}

// Resumes the jobs of --state-dir and starts dropping idle jobs. An
// unusable state dir (FAILED_PRECONDITION) is an error; an unreadable
// snapshot a warning.
absl::Status StartService(const DaemonConfig& config,
                          OptimizerService* service) {
  if (!config.state_dir.empty()) {
    if (absl::Status st = service->LoadSnapshots(); !st.ok()) {
      if (st.code() == absl::StatusCode::kFailedPrecondition)
        return absl::FailedPreconditionError(st.ToString());
      spdlog::warn("{}", st.ToString());
    }
    int found = 0;
    const v1::StatusResponse status = service->Status();
    for (const auto& j : status.jobs()) found += j.on_disk();
    spdlog::info(
        "--state-dir={}: {} job snapshot(s) found; each job resumes from its "
        "snapshot when a trainer reopens it (`dmuonctl status` lists them "
        "as on disk)",
        config.state_dir, found);
  }
  const int retention = config.job_retention_seconds;
  service->StartReaper([retention](const ReapResult& r) {
    for (const auto& [job, snapshotted] : r.dropped) {
      spdlog::info(
          "job '{}' dropped: no rank open for --job-retention-seconds={}{}",
          LogSafe(job), retention,
          snapshotted ? "; snapshotted, a reopen resumes from it"
                      : "; its momentum is released");
    }
    for (const absl::Status& st : r.failed)
      spdlog::error("idle job snapshot: {}", LogSafe(st.ToString(), 1024));
  });
  return absl::OkStatus();
}

// The metrics port's TLS context from the files `tls` serves now.
absl::StatusOr<MetricsHttp::TlsContext> MetricsTls(const TlsFiles& tls) {
  const TlsFiles::Pem pem = tls.current();
  return MetricsHttp::MakeTlsContext(pem.cert, pem.key);
}

// GET /metrics on the --listen host; null when --metrics-port is off. Over
// HTTPS with --metrics-tls (`tls`: the --tls-* files), with tokens of `auth`
// with --metrics-auth.
absl::StatusOr<std::unique_ptr<MetricsHttp>> StartMetrics(
    const DaemonConfig& config, const PrometheusMetrics& metrics,
    const TlsFiles* tls, const Authenticator* auth) {
  if (config.metrics_port <= 0) return nullptr;
  MetricsHttp::Security sec;
  if (config.metrics_tls && tls != nullptr) {
    auto ctx = MetricsTls(*tls);
    if (!ctx.ok()) {
      return absl::InvalidArgumentError("--metrics-tls: " +
                                        std::string(ctx.status().message()));
    }
    sec.tls = *std::move(ctx);
  }
  if (config.metrics_auth && auth != nullptr) {
    sec.token_ok = [auth](const std::string& token) {
      return auth->RoleOfToken(token) >= Role::kReader;
    };
  }
  if (config.metrics_less_protected()) {
    spdlog::warn(
        "--metrics-port={} serves /metrics {}{}{} while gRPC needs TLS and "
        "authentication: anyone who reaches it reads the daemon's load and "
        "job counts (add --metrics-tls and --metrics-auth)",
        config.metrics_port, config.metrics_tls ? "" : "in plaintext",
        !config.metrics_tls && !config.metrics_auth ? " and " : "",
        config.metrics_auth ? "" : "without tokens");
  }
  auto m = MetricsHttp::Start(
      config.ListenHost(), config.metrics_port,
      [&metrics] { return metrics.Render(); }, std::move(sec));
  if (!m.ok()) {
    return absl::UnavailableError(
        "--metrics-port=" + std::to_string(config.metrics_port) + ": " +
        std::string(m.status().message()));
  }
  return m;
}

// --listen's credentials: TLS from `tls` (the --tls-* files, re-read on
// SIGHUP; client certificates required and verified with
// --tls-client-ca-file), else none.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(TlsFiles* tls) {
  if (tls == nullptr) return grpc::InsecureServerCredentials();
  return tls->Credentials();
}

// Takes gRPC's reflection plugin out of a server being built (it registers
// itself for every server once its library is linked).
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*
                         plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const auto& p) {
                                    return p->name() ==
                                           "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

// The gRPC server on --listen, started; *port: the bound port. Without
// SO_REUSEPORT: a second daemon on a taken address fails here instead of
// sharing its connections.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(
    const DaemonConfig& config, TlsFiles* tls, GrpcOptimizer* service,
    int* port) {
  // A port that is taken is refused here, with our message alone: gRPC's
  // BuildAndStart would first log its own multi-line error for it.
  if (config.listen.rfind("unix:", 0) != 0) {
    int requested = 0;
    const size_t colon = config.listen.rfind(':');
    if (absl::SimpleAtoi(config.listen.substr(colon + 1), &requested) &&
        requested > 0 && !ListenProbe(config.ListenHost(), requested).empty()) {
      return absl::UnavailableError(
          "--listen=" + config.listen + ": " +
          CannotListen(config.ListenHost(), requested));
    }
  }
  const auto creds = ServerCredentials(tls);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Reflection is gRPC's own service, which our token check cannot guard
  // (and whose sync streams each pin a server thread): served only without
  // --auth-token-file (with mTLS alone the handshake already requires a
  // client certificate). Health stays open for probes.
  if (!config.auth_token_file.empty())
    builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(config.listen, creds, port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) {
    const size_t colon = config.listen.rfind(':');
    int requested = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(config.listen.substr(colon + 1), &requested)) {
      requested = 0;
    }
    return absl::UnavailableError(
        "--listen=" + config.listen + ": " +
        (requested > 0 ? CannotListen(config.ListenHost(), requested)
                       : "cannot listen on " + config.listen));
  }
  return server;
}

// For scripts and tests: the bound port, written atomically.
void WritePortFile(const std::string& path, int port) {
  if (path.empty()) return;
  std::ofstream(path + ".tmp") << port << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

// Blocks SIGTERM, SIGINT and SIGHUP in this thread and every thread started
// after (they are waited for in Serve).
sigset_t BlockStopSignals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  return sigs;
}

// Logs a summary every --summary-every-secs until `stop`.
void SummaryLoop(const DaemonConfig& config, const OptimizerService& service,
                 const std::atomic<bool>& stop) {
  const int every = config.summary_every_secs;
  auto next = std::chrono::steady_clock::now() + std::chrono::seconds(every);
  while (!stop && every > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (std::chrono::steady_clock::now() < next) continue;
    next += std::chrono::seconds(every);
    const auto s = service.Status();
    double busy = 0;
    for (const auto& e : s.executors()) busy += e.busy_seconds();
    uint64_t errors = 0;
    for (const auto& [code, n] : s.errors()) errors += n;
    spdlog::info(
        "summary: {} sessions, {} jobs, {} steps, step p50 {:.4f}s p99 "
        "{:.4f}s, busy {:.1f}s, "
        "{} errors",
        s.sessions_size(), s.jobs_size(), s.step_latency().count(),
        s.step_latency().p50_seconds(), s.step_latency().p99_seconds(), busy,
        errors);
  }
}

// Serves (and logs summaries) until SIGTERM or SIGINT; returns it. SIGHUP
// calls `on_hup` (re-reads --auth-token-file) and serves on.
int Serve(const DaemonConfig& config, const OptimizerService& service,
          const sigset_t& sigs, const std::function<void()>& on_hup) {
  std::atomic<bool> stop{false};
  std::thread summary([&] { SummaryLoop(config, service, stop); });
  int sig = 0;
  while (sigwait(&sigs, &sig) == 0 && sig == SIGHUP) on_hup();
  stop = true;
  summary.join();
  return sig;
}

// Drain: new sessions refused, readiness NOT_SERVING (liveness stays
// SERVING); in-flight steps finish until 3/4 of --exit-timeout-secs, state
// is snapshotted, and what is still open (idle Step streams, idle channels)
// is cancelled within a second, not waited for. False when the final
// snapshot failed (the daemon then exits non-zero).
bool DrainAndShutdown(const DaemonConfig& config, int sig,
                      OptimizerService* service, ServingHealth* health,
                      grpc::Server* server) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::seconds(config.exit_timeout_secs);
  spdlog::warn("{}: draining (health NOT_SERVING, new sessions refused)",
               strsignal(sig));
  service->Drain();
  health->SetReady(false);
  const auto wait_until = std::chrono::steady_clock::now() +
                          (deadline - std::chrono::steady_clock::now()) * 3 / 4;
  while (service->Busy() && std::chrono::steady_clock::now() < wait_until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (service->Busy()) {
    spdlog::warn(
        "exit timeout: steps still in flight are void; the snapshot holds "
        "each job's last completed step");
  }
  const absl::Status snapshot = service->SnapshotAll();
  if (!snapshot.ok()) {
    spdlog::error("final snapshot failed, exiting with status 1: {}",
                  LogSafe(snapshot.ToString(), 1024));
  } else if (!config.state_dir.empty()) {
    spdlog::info("state snapshotted to {}", config.state_dir);
  }
  const auto left = std::max(std::chrono::steady_clock::duration::zero(),
                             deadline - std::chrono::steady_clock::now());
  server->Shutdown(
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::min<std::chrono::steady_clock::duration>(
              left, std::chrono::seconds(1))));
  return snapshot.ok();
}

// --insecure in force: says what anyone who reaches the port may do.
void WarnInsecure(const DaemonConfig& config) {
  spdlog::warn(
      "--insecure: serving {} without {}: anyone who reaches it may open "
      "sessions, read and overwrite momentum, and drain the daemon",
      config.listen,
      config.tls() ? "authentication (--auth-token-file, "
                     "--tls-client-ca-file)"
                   : "TLS (--tls-cert-file)");
}

// Logs a warning when the served certificate has expired, is not valid yet
// or expires within 7 days (`when`: at start or at SIGHUP).
void WarnCertificateValidity(const char* when, const std::string& cert_pem) {
  const std::string w = CertificateValidityWarning(
      cert_pem, static_cast<int64_t>(std::time(nullptr)), 7 * 24 * 3600);
  if (!w.empty()) spdlog::warn("{}: {}", when, w);
}

// --quotas-file (into `quotas`, null without it), then the authenticator
// that applies it.
absl::StatusOr<std::unique_ptr<Authenticator>> MakeAuthenticator(
    const DaemonConfig& config, std::unique_ptr<QuotasFile>* quotas) {
  if (!config.quotas_file.empty()) {
    auto q = QuotasFile::Create(config.quotas_file);
    if (!q.ok()) return q.status();
    *quotas = *std::move(q);
  }
  return Authenticator::Create(config.auth_token_file,
                               !config.tls_client_ca_file.empty(),
                               quotas->get());
}

// SIGHUP: re-reads --quotas-file (`quotas`, may be null), the TLS files
// (and gives /metrics the new ones with --metrics-tls) and the token file;
// a file that fails keeps what was in force, logged. Open streams of a token
// the new file revokes (or whose role it lowers below theirs) are ended
// (GrpcOptimizer::EndRevokedStreams). `tls`, `metrics` may be null (not in
// use).
void Reload(const DaemonConfig& config, TlsFiles* tls, MetricsHttp* metrics,
            Authenticator* auth, GrpcOptimizer* grpc_service,
            QuotasFile* quotas) {
  if (quotas != nullptr) {
    if (auto n = quotas->Reload(); n.ok()) {
      spdlog::info(
          "SIGHUP: --quotas-file re-read: {} principal(s); new jobs get its "
          "weights and quotas",
          *n);
    } else {
      spdlog::error("SIGHUP: {}; the quotas stay as they were",
                    std::string(n.status().message()));
    }
  }
  if (tls != nullptr) {
    auto cert = tls->Reload();
    if (cert.ok() && metrics != nullptr && config.metrics_tls) {
      if (auto ctx = MetricsTls(*tls); ctx.ok())
        metrics->SetTls(*std::move(ctx));
    }
    if (cert.ok()) {
      spdlog::info("SIGHUP: TLS files re-read ({}); new connections use them",
                   *cert);
      WarnCertificateValidity("SIGHUP", tls->current().cert);
    } else {
      spdlog::error("SIGHUP: {}; the TLS certificates stay as they were",
                    std::string(cert.status().message()));
    }
  }
  if (config.auth_token_file.empty()) {
    if (tls == nullptr) spdlog::info("SIGHUP: no --auth-token-file to re-read");
    return;
  }
  auto n = auth->Reload();
  if (n.ok()) {
    spdlog::info("SIGHUP: --auth-token-file re-read: {} tokens", *n);
    if (const int ended = grpc_service->EndRevokedStreams(); ended > 0) {
      spdlog::warn(
          "SIGHUP: ended {} stream(s) whose token was revoked or lost the "
          "role they need",
          ended);
    }
  } else {
    spdlog::error("SIGHUP: {}; the tokens stay as they were",
                  std::string(n.status().message()));
  }
}

// glibc gives threads that allocate at once arenas of their own (up to 8 per
// core), and each keeps its high-water mark. dmuond's many threads (gRPC's,
// the executors', one per Step stream) allocate and free buffers of a
// snapshot's or a table's size in all of them, so its RSS crept up for
// minutes under a steady load: the soak's quiet phase went from 82 to 117
// MiB in 4 minutes, and stays at about 54 MiB with two arenas. Two, unless
// the operator sets MALLOC_ARENA_MAX (read by glibc itself).
void LimitMallocArenas() {
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, 2);
}

// OpenBLAS picked its kernels when it loaded; a generic choice on a CPU that
// runs better ones (kernels/blas_core.h) is corrected by starting again
// with OPENBLAS_CORETYPE set, before any file or socket is opened (the
// pthread OpenBLAS has started its own idle workers; the exec ends them).
// An OPENBLAS_CORETYPE already set is the operator's choice (or this one's,
// after the exec) and stands; DMUON_NO_BLAS_REEXEC=1 turns the exec off
// (under a debugger or valgrind, or when dmuond is started through the
// dynamic loader: /proc/self/exe is then not dmuond), and so does an exec
// that fails (errno kept for LogBlasKernels).
void UseBestBlasKernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  if (const char* off = std::getenv(kNoBlasReexec);
      off != nullptr && std::string(off) != "0") {
    return;
  }
  const std::string chosen = kernels::BlasCoreName();
  const std::optional<std::string> better =
      kernels::BetterBlasCore(chosen, kernels::HostCpuFeatures());
  if (!better) return;
  setenv("OPENBLAS_CORETYPE", better->c_str(), 1);
  setenv(kBlasCoreWas, chosen.c_str(), 1);
  execv("/proc/self/exe", argv);
  const int err = errno;
  unsetenv("OPENBLAS_CORETYPE");  // no exec: the weaker kernels, said below
  unsetenv(kBlasCoreWas);
  setenv(kBlasExecError, std::strerror(err), 1);
}

// After logging is set up: what UseBestBlasKernels did, or could not do.
// The kernels named are the ones loaded (openblas_get_corename), so an
// OPENBLAS_CORETYPE that OpenBLAS ignored shows as the generic core still.
void LogBlasKernels() {
  const std::string now = kernels::BlasCoreName();
  const char* asked = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> better =
      kernels::BetterBlasCore(now, kernels::HostCpuFeatures());
  if (const char* was = std::getenv(kBlasCoreWas); was != nullptr) {
    spdlog::info(
        "OpenBLAS chose its {} kernels (this CPU's model is not in its "
        "table); dmuond started again with OPENBLAS_CORETYPE={} and runs its "
        "{} kernels (set OPENBLAS_CORETYPE to choose, "
        "{}=1 to keep OpenBLAS's choice)",
        was, asked == nullptr ? "" : asked, now, kNoBlasReexec);
    unsetenv(kBlasCoreWas);
  }
  // OPENBLAS_CORETYPE naming the kernels loaded: the operator's choice.
  if (better && !(asked != nullptr && absl::EqualsIgnoreCase(asked, now))) {
    const char* exec_error = std::getenv(kBlasExecError);
    spdlog::warn(
        "OpenBLAS runs its {} kernels though this CPU supports {}{}: "
        "Newton-Schulz is several times slower; set OPENBLAS_CORETYPE={}",
        now, *better,
        exec_error != nullptr
            ? std::string(" (starting again failed: ") + exec_error + ")"
        : asked != nullptr ? std::string(" (OPENBLAS_CORETYPE=") + asked +
                                 " was not applied by this OpenBLAS)"
                           : std::string(),
        *better);
    unsetenv(kBlasExecError);
  }
}

// --tls-cert-file's files, or null without TLS.
absl::StatusOr<std::unique_ptr<TlsFiles>> LoadTls(const DaemonConfig& config) {
  if (!config.tls()) return nullptr;
  auto tls = TlsFiles::Create(config.tls_cert_file, config.tls_key_file,
                              config.tls_client_ca_file);
  if (!tls.ok()) return tls.status();
  WarnCertificateValidity("--tls-cert-file", (*tls)->current().cert);
  return tls;
}

GrpcOptions GrpcOptionsOf(const DaemonConfig& config) {
  GrpcOptions o;
  o.attach_timeout_seconds = config.attach_timeout_seconds;
  o.max_step_queue_bytes = static_cast<uint64_t>(config.max_step_queue_bytes);
  o.max_streams_per_peer = config.max_streams_per_peer;
  return o;
}

// --trace-file's writer, recording from now on (null without the flag).
absl::StatusOr<std::unique_ptr<TraceFile>> OpenTraceFile(
    const DaemonConfig& config, TraceRecorder* trace) {
  if (config.trace_file.empty()) return nullptr;
  return TraceFile::Open(config.trace_file, trace);
}

// Ends --trace-file's file (after the drain: every step's events are in).
void EndTraceFile(const DaemonConfig& config, TraceFile* file) {
  if (file == nullptr) return;
  if (absl::Status st = file->Close(); !st.ok()) {
    spdlog::error("{}", std::string(st.message()));
  } else {
    spdlog::info("step timeline written to {}", config.trace_file);
  }
}

}  // namespace

int DaemonMain(int argc, char** argv, const GpuSupport* gpu) {
  UseBestBlasKernels(argv);  // may start again: first
  LimitMallocArenas();       // before any thread
  ParseFlags(argc, argv, kUsage, kDaemonFlagsSource);
  const absl::StatusOr<DaemonConfig> config_or = ConfigFromFlags();
  if (!config_or.ok()) return Fail(config_or.status());
  const DaemonConfig& config = *config_or;
  SetUpLogging(config.json_log(), config.log_level);
  LogBlasKernels();
  // Held for the daemon's life, taken before any snapshot is read.
  std::optional<StateDirLock> state_lock;
  if (!config.state_dir.empty()) {
    auto lock = StateDirLock::Acquire(config.state_dir);
    if (!lock.ok()) return Fail(lock.status());
    state_lock.emplace(*std::move(lock));
  }

  ServiceOptions opts = ServiceOptionsOf(config);
  int threads = 0;
  auto executors = BuildExecutors(config, gpu, &opts, &threads);
  if (!executors.ok()) return Fail(executors.status());
  const uint64_t device_memory = StateDeviceMemory(*executors);
  opts.max_state_bytes = config.state_bytes_limit(device_memory);
  spdlog::info("{}", config.StateBytesLimitLine(device_memory));

  // Signals go to Serve's sigwait, blocked in every thread.
  const sigset_t sigs = BlockStopSignals();

  // The step timeline: recorded while --trace-file is set (from now to the
  // exit) or a Trace RPC asks.
  TraceRecorder trace("dmuond");
  opts.trace = &trace;
  auto trace_file = OpenTraceFile(config, &trace);
  if (!trace_file.ok()) return Fail(trace_file.status());

  PrometheusMetrics metrics;
  OptimizerService service(
      opts,
      std::make_unique<Scheduler>(*std::move(executors), config.max_batch),
      &metrics);
  if (absl::Status st = StartService(config, &service); !st.ok())
    return Fail(st);

  std::unique_ptr<QuotasFile> quotas;
  auto auth = MakeAuthenticator(config, &quotas);
  if (!auth.ok()) return Fail(auth.status());
  auto tls_or = LoadTls(config);
  if (!tls_or.ok()) return Fail(tls_or.status());
  std::unique_ptr<TlsFiles> tls = *std::move(tls_or);

  auto metrics_http = StartMetrics(config, metrics, tls.get(), auth->get());
  if (!metrics_http.ok()) return Fail(metrics_http.status());
  if (config.exposed_insecurely()) WarnInsecure(config);
  // Set, under its lock, once a signal stops the daemon: Undrain then
  // refuses (the shutdown's drain stays).
  std::mutex undrain_mu;
  bool stopping = false;
  GrpcOptimizer grpc_service(&service, auth->get(), GrpcOptionsOf(config));
  int port = 0;
  auto server = StartGrpc(config, tls.get(), &grpc_service, &port);
  if (!server.ok()) return Fail(server.status());
  ServingHealth health((*server)->GetHealthCheckService());
  grpc_service.set_on_drain([&health] { health.SetReady(false); });
  grpc_service.set_on_undrain([&]() -> absl::Status {
    std::lock_guard<std::mutex> l(undrain_mu);
    if (stopping) {
      return absl::FailedPreconditionError(
          "dmuond is shutting down (SIGTERM/SIGINT); it stays draining");
    }
    service.Undrain();
    health.SetReady(true);
    return absl::OkStatus();
  });
  health.SetReady(true);

  const std::string host = config.ListenHost();
  spdlog::info(
      "dmuond {} (protocol 1.{}) serving on {}:{} (devices {}, {} OpenBLAS "
      "threads on {} kernels, metrics {})",
      opts.version, ProtocolMinor(), host, port,
      absl::StrJoin(opts.devices, ","), threads, kernels::BlasCoreName(),
      *metrics_http ? host + ":" + std::to_string(config.metrics_port) : "off");
  // After the line: whoever waits for the port file may read it in the log.
  WritePortFile(config.port_file, port);

  const int sig = Serve(config, service, sigs, [&] {
    Reload(config, tls.get(), metrics_http->get(), auth->get(), &grpc_service,
           quotas.get());
  });
  {
    std::lock_guard<std::mutex> l(undrain_mu);
    stopping = true;
  }
  const bool saved =
      DrainAndShutdown(config, sig, &service, &health, server->get());
  EndTraceFile(config, trace_file->get());
  spdlog::info("dmuond exited{}", saved ? "" : " (final snapshot failed)");
  return saved ? 0 : 1;
}

}  // namespace dmuon::server
