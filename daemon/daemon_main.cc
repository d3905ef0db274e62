// The body of dmuond (daemon_main.h): flags, logging, the service, the gRPC
// server, metrics, signals and drain. See `dmuond --help` and README.md.

#include "daemon/daemon_main.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/flags.h"
#include "daemon/grpc_service.h"
#include "daemon/prometheus_metrics.h"
#include "prometheus/exposer.h"
#include "server/gpu_logic.h"
#include "server/service.h"

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
ABSL_FLAG(int, cpu_threads, 0, "OpenBLAS threads in total (0: every core)");
ABSL_FLAG(
    int, cpu_executors, 1,
    "CPU executors (each a queue and a thread; threads are split among them)");
ABSL_FLAG(int, max_batch, 16, "most same-shape matrices in one batched launch");
ABSL_FLAG(int, metrics_port, 0,
          "Prometheus /metrics port on the --listen host (0 disables)");
ABSL_FLAG(
    std::string, state_dir, "",
    "directory for state snapshots; a restarted daemon resumes jobs from it");
ABSL_FLAG(
    std::string, autotune_cache, "",
    "file caching measured method choices: parameters with method 'auto' get "
    "the faster of direct and Gram as measured on this daemon's executors "
    "(the CPU, or dmuond_cuda's first GPU), and the planner balances measured "
    "times (empty: the cost model decides)");
ABSL_FLAG(int, snapshot_every, 0,
          "snapshot each job every N completed steps (0: only at shutdown)");
ABSL_FLAG(int, job_retention_seconds, 600,
          "seconds a job whose ranks have all closed keeps its momentum "
          "in the daemon (device memory on GPUs) for a restarted trainer to "
          "reopen the same job id and continue; then it is dropped and its "
          "memory freed. With --state-dir it is snapshotted first and a "
          "later reopen resumes from the snapshot; WITHOUT --state-dir ITS "
          "MOMENTUM IS GONE and a reopen starts from zero. 0: drop as soon as "
          "the last rank closes; >= 0");
ABSL_FLAG(int, max_sessions, 64,
          "most open sessions; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "largest gRPC message accepted or sent; inline tensors travel in "
          "chunks below it");
ABSL_FLAG(
    int, exit_timeout_secs, 30,
    "on SIGTERM/SIGINT: seconds to finish in-flight steps, snapshot and exit");
ABSL_FLAG(std::string, nan_policy, "skip",
          "a gradient with NaN/Inf: 'skip' (momentum untouched, zero update, "
          "reported) "
          "or 'fail' (the job's step fails)");
ABSL_FLAG(std::string, log_level, "info", "trace|debug|info|warn|error");
ABSL_FLAG(std::string, log_format, "text",
          "text|json (one JSON object per line)");
ABSL_FLAG(int, summary_every_secs, 60,
          "seconds between summary log lines (0: never)");
ABSL_FLAG(std::string, port_file, "",
          "write the bound gRPC port to this file once serving (for scripts "
          "and tests)");

namespace {

using dmuon::server::GrpcOptimizer;
using dmuon::server::OptimizerService;

// %* : the message, JSON-escaped (for --log-format=json).
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    for (char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            dest.append(std::string_view(buf));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

int Fail(const std::string& msg) {
  std::fprintf(stderr, "dmuond: %s\n", msg.c_str());
  return 2;
}

}  // namespace

namespace dmuon::server {

int DaemonMain(int argc, char** argv, const GpuSupport* gpu) {
  dmuon::server::ParseFlags(
      argc, argv,
      "dmuond: the dmuon optimizer daemon. It owns the Muon momentum state and "
      "orthogonalizes every weight matrix for the trainers that connect to "
      "it.\n"
      "  dmuond --listen=127.0.0.1:50051 --metrics-port=9464 "
      "--state-dir=/var/lib/dmuon",
      "daemon/daemon_main.cc");

  // Logging.
  auto logger = spdlog::stdout_logger_mt("dmuond");
  spdlog::set_default_logger(logger);
  const std::string fmt = absl::GetFlag(FLAGS_log_format);
  if (fmt == "json") {
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","logger":"%n","msg":"%*"})");
    spdlog::set_formatter(std::move(f));
  } else if (fmt != "text") {
    return Fail("--log-format must be 'text' or 'json', got '" + fmt + "'");
  }
  const auto level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  if (level == spdlog::level::off && absl::GetFlag(FLAGS_log_level) != "off") {
    return Fail("--log-level must be trace|debug|info|warn|error|off");
  }
  spdlog::set_level(level);
  spdlog::flush_on(spdlog::level::info);

  // Flags that need checking.
  dmuon::server::ServiceOptions opts;
  const std::string nan = absl::GetFlag(FLAGS_nan_policy);
  if (nan != "skip" && nan != "fail")
    return Fail("--nan-policy must be 'skip' or 'fail'");
  opts.skip_nonfinite = nan == "skip";
  opts.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  opts.max_message_bytes =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_max_message_bytes));
  if (opts.max_sessions < 1) return Fail("--max-sessions must be >= 1");
  if (absl::GetFlag(FLAGS_max_message_bytes) < 4096 ||
      absl::GetFlag(FLAGS_max_message_bytes) > (int64_t{1} << 31) - 1) {
    return Fail("--max-message-bytes must be in [4096, 2^31)");
  }
  opts.state_dir = absl::GetFlag(FLAGS_state_dir);
  opts.snapshot_every = absl::GetFlag(FLAGS_snapshot_every);
  opts.autotune_cache = absl::GetFlag(FLAGS_autotune_cache);
  if (opts.snapshot_every < 0) return Fail("--snapshot-every must be >= 0");
  opts.job_retention_seconds = absl::GetFlag(FLAGS_job_retention_seconds);
  if (opts.job_retention_seconds < 0)
    return Fail("--job-retention-seconds must be >= 0");
  const std::string devices = absl::GetFlag(FLAGS_devices);
  const auto spec = ParseDeviceSpec(devices);
  if (!spec.ok()) return Fail(std::string(spec.status().message()));
  const std::string momentum_dtype = absl::GetFlag(FLAGS_momentum_dtype);
  if (momentum_dtype != "fp32" && momentum_dtype != "bf16")
    return Fail("--momentum-dtype must be 'fp32' or 'bf16'");
  std::vector<std::unique_ptr<Executor>> ex;
  if (spec->kind == DeviceSpec::Kind::kCuda && gpu == nullptr) {
    return Fail("--devices=" + devices +
                ": this build has CPU executors only; run dmuond_cuda (the "
                "CUDA build) for GPUs, or use --devices=cpu");
  }
  if (spec->kind != DeviceSpec::Kind::kCpu && gpu != nullptr) {
    std::string why;
    auto cuda = gpu->executors(devices, momentum_dtype == "bf16", &why);
    if (!cuda.ok()) return Fail(std::string(cuda.status().message()));
    ex = std::move(*cuda);
    if (ex.empty()) {
      spdlog::warn("--devices={}: no usable GPU ({}); using the CPU", devices,
                   why);
    }
  }
  if (!ex.empty()) {
    std::vector<std::string> names;
    for (const auto& e : ex) names.push_back(e->device());
    if (gpu->transports) opts.device_transports = gpu->transports(names);
    if (gpu->tuning && !opts.autotune_cache.empty()) {
      auto tuning = gpu->tuning(names);
      if (tuning.ok()) {
        opts.tuning = *std::move(tuning);
        spdlog::info("--autotune-cache: methods measured on {}",
                     opts.tuning.device);
      } else {
        spdlog::warn(
            "--autotune-cache={}: {}; the cost model chooses methods instead",
            opts.autotune_cache, std::string(tuning.status().message()));
        opts.autotune_cache.clear();
      }
    }
  } else if (momentum_dtype != "fp32") {
    return Fail("--momentum-dtype=" + momentum_dtype +
                ": CPU executors keep fp32 momentum");
  }
  const int executors = absl::GetFlag(FLAGS_cpu_executors);
  if (executors < 1) return Fail("--cpu-executors must be >= 1");
  int threads = absl::GetFlag(FLAGS_cpu_threads);
  if (threads <= 0)
    threads = static_cast<int>(std::thread::hardware_concurrency());
  if (ex.empty()) {
    for (int i = 0; i < executors; ++i)
      ex.push_back(NewCpuExecutor(i, std::max(1, threads / executors)));
  }
  for (const auto& e : ex) opts.devices.push_back(e->device());
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string host = listen.substr(0, listen.rfind(':'));

  // Signals go to one thread, blocked everywhere else.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  dmuon::server::PrometheusMetrics metrics;
  auto scheduler = std::make_unique<dmuon::server::Scheduler>(
      std::move(ex), absl::GetFlag(FLAGS_max_batch));
  OptimizerService service(opts, std::move(scheduler), &metrics);
  if (!opts.state_dir.empty()) {
    if (absl::Status st = service.LoadSnapshots(); !st.ok()) {
      if (st.code() == absl::StatusCode::kFailedPrecondition)
        return Fail(st.ToString());
      spdlog::warn("{}", st.ToString());
    }
  }

  service.StartReaper([&opts](const dmuon::server::ReapResult& r) {
    for (const auto& [job, snapshotted] : r.dropped) {
      spdlog::info(
          "job '{}' dropped: no rank open for --job-retention-seconds={}{}",
          job, opts.job_retention_seconds,
          snapshotted ? "; snapshotted, a reopen resumes from it"
                      : "; its momentum is released");
    }
    for (const absl::Status& st : r.failed)
      spdlog::error("idle job snapshot: {}", st.ToString());
  });

  std::unique_ptr<prometheus::Exposer> exposer;
  if (const int mp = absl::GetFlag(FLAGS_metrics_port); mp > 0) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(host + ":" +
                                                      std::to_string(mp));
    } catch (const std::exception& e) {
      return Fail("--metrics-port " + std::to_string(mp) + ": " + e.what());
    }
    for (auto& c : metrics.collectables()) exposer->RegisterCollectable(c);
  }

  GrpcOptimizer grpc_service(&service);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(opts.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(opts.max_message_bytes));
  builder.RegisterService(&grpc_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return Fail("cannot serve on --listen=" + listen);
  auto* health = server->GetHealthCheckService();
  auto set_serving = [&](bool serving) {
    health->SetServingStatus(serving);
    health->SetServingStatus("dmuon.v1.Optimizer", serving);
  };
  grpc_service.set_on_drain([&] { set_serving(false); });
  set_serving(true);
  // Liveness: SERVING for as long as the process answers, draining or not,
  // so a liveness probe does not restart a daemon that is finishing steps.
  health->SetServingStatus("dmuon.liveness", true);
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    std::ofstream(pf + ".tmp") << port << "\n";
    std::rename((pf + ".tmp").c_str(), pf.c_str());
  }
  spdlog::info(
      "dmuond {} serving on {}:{} (devices {}, {} OpenBLAS threads, metrics "
      "{})",
      opts.version, host, port, absl::StrJoin(opts.devices, ","), threads,
      exposer ? host + ":" + std::to_string(absl::GetFlag(FLAGS_metrics_port))
              : "off");

  std::atomic<bool> stop{false};
  std::thread summary([&] {
    const int every = absl::GetFlag(FLAGS_summary_every_secs);
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
  });

  int sig = 0;
  sigwait(&sigs, &sig);
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::seconds(absl::GetFlag(FLAGS_exit_timeout_secs));
  spdlog::warn("{}: draining (health NOT_SERVING, new sessions refused)",
               strsignal(sig));
  service.Drain();
  set_serving(false);
  // In-flight steps finish (until 3/4 of the timeout), then state is saved.
  const auto wait_until = std::chrono::steady_clock::now() +
                          (deadline - std::chrono::steady_clock::now()) * 3 / 4;
  while (service.Busy() && std::chrono::steady_clock::now() < wait_until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (service.Busy())
    spdlog::warn("exit timeout: steps still in flight are abandoned");
  if (absl::Status st = service.SnapshotAll(); !st.ok()) {
    spdlog::error("final snapshot: {}", st.ToString());
  } else if (!opts.state_dir.empty()) {
    spdlog::info("state snapshotted to {}", opts.state_dir);
  }
  // Steps are done and state is saved: what is still open (idle Step
  // streams, idle channels) is cancelled within a second, not waited for.
  const auto left = std::max(std::chrono::steady_clock::duration::zero(),
                             deadline - std::chrono::steady_clock::now());
  server->Shutdown(
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::min<std::chrono::steady_clock::duration>(
              left, std::chrono::seconds(1))));
  stop = true;
  summary.join();
  spdlog::info("dmuond exited");
  return 0;
}

}  // namespace dmuon::server
