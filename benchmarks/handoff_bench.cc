// The hand-off's own cost, doorbell against Step messages (docs/protocol.md
// "Doorbell"): a real dmuond on one core, a trainer on another, a table of
// small matrices whose Newton–Schulz costs next to nothing, so that a step
// is all hand-off: each gradient declared as backward would (last layer
// first), each update waited for, FinishStep. Per configuration: the step's
// wall time, and the CPU time it cost the trainer's process (all its
// threads: the caller, the client's stream reader, gRPC's own) and
// dmuond's. The two configurations alternate within one
// run, repeat after repeat, on the same daemon.

#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "client/client.h"

ABSL_FLAG(std::string, dmuond, "bazel-bin/daemon/dmuond", "the daemon binary");
ABSL_FLAG(int, matrices, 16, "matrices in the table");
ABSL_FLAG(int, rows, 32, "rows of each matrix");
ABSL_FLAG(int, cols, 32, "columns of each matrix");
ABSL_FLAG(int, steps, 200, "timed steps per configuration and repeat");
ABSL_FLAG(int, warmup, 20, "untimed steps first");
ABSL_FLAG(int, repeats, 5, "alternations of the two configurations");
ABSL_FLAG(int, trainer_cpu, 0, "the core of this process (the trainer)");
ABSL_FLAG(int, daemon_cpu, 1, "dmuond's core");
ABSL_FLAG(std::string, out, "", "JSON results path");

namespace dmuon::bench {
namespace {

using Clock = std::chrono::steady_clock;

void PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

// This process's CPU seconds (every thread), and another's from /proc.
double SelfCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(in, line);
  // Fields after the command's closing parenthesis: utime is the 12th.
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 1; i <= 13 && rest >> field; ++i)
    if (i == 12 || i == 13) ticks += std::stod(field);
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// dmuond on `cpu` (the affinity it inherits), one executor, one thread.
absl::Status Start(DaemonProcess& d, int cpu) {
  PinTo(cpu);
  absl::Status st = d.Start(absl::GetFlag(FLAGS_dmuond),
                            {"--log-level=warn", "--summary-every-secs=0",
                             "--cpu-executors=1", "--cpu-threads=1"});
  PinTo(absl::GetFlag(FLAGS_trainer_cpu));
  return st;
}

// One step: every gradient declared, last matrix first, then every update
// waited for in forward order.
absl::Status Step(Session& s, int n, const std::vector<float>& g) {
  for (int i = n - 1; i >= 0; --i) {
    auto dst = s.gradient(i);
    std::copy(g.begin(), g.begin() + dst.size(), dst.begin());
    if (auto st = s.GradientReady(i); !st.ok()) return st;
  }
  for (int i = 0; i < n; ++i)
    if (auto st = s.WaitUpdate(i); !st.ok()) return st;
  return s.FinishStep();
}

struct Sample {
  double wall_ms = 0, trainer_cpu_ms = 0, daemon_cpu_ms = 0;  // per step
};

// One configuration's run on its own session: warm-up, then timed steps.
absl::StatusOr<Sample> RunOnce(const DaemonProcess& d, bool doorbell,
                               int repeat) {
  ClientOptions o;
  o.doorbell = doorbell;
  auto client = Client::Connect(d.address(), o);
  if (!client.ok()) return client.status();
  const int n = absl::GetFlag(FLAGS_matrices);
  SessionSpec spec;
  spec.job_id = absl::StrCat(doorbell ? "doorbell-" : "stream-", repeat);
  spec.transport = TransportChoice::kShm;
  for (int i = 0; i < n; ++i) {
    spec.params.push_back({absl::StrCat("m", i), absl::GetFlag(FLAGS_rows),
                           absl::GetFlag(FLAGS_cols)});
  }
  auto session = (*client)->OpenSession(spec);
  if (!session.ok()) return session.status();
  if ((*session)->doorbell() != doorbell)
    return absl::InternalError("the doorbell was not granted as asked");
  std::vector<float> g(absl::GetFlag(FLAGS_rows) * absl::GetFlag(FLAGS_cols));
  FillRandom(repeat, absl::MakeSpan(g));
  for (int k = 0; k < absl::GetFlag(FLAGS_warmup); ++k)
    if (auto st = Step(**session, n, g); !st.ok()) return st;
  const int steps = absl::GetFlag(FLAGS_steps);
  const double cpu0 = SelfCpuSeconds(), daemon0 = ProcessCpuSeconds(d.pid());
  const auto t0 = Clock::now();
  for (int k = 0; k < steps; ++k)
    if (auto st = Step(**session, n, g); !st.ok()) return st;
  Sample s;
  s.wall_ms =
      1e3 * std::chrono::duration<double>(Clock::now() - t0).count() / steps;
  s.trainer_cpu_ms = 1e3 * (SelfCpuSeconds() - cpu0) / steps;
  s.daemon_cpu_ms = 1e3 * (ProcessCpuSeconds(d.pid()) - daemon0) / steps;
  if (auto st = (*session)->Close(); !st.ok()) return st;
  return s;
}

nlohmann::json Summary(std::vector<Sample> runs, int n) {
  auto median = [&](double Sample::*f) {
    std::vector<double> v;
    for (const auto& r : runs) v.push_back(r.*f);
    std::sort(v.begin(), v.end());
    return Median(v);
  };
  nlohmann::json j;
  j["wall_ms_per_step"] = median(&Sample::wall_ms);
  j["trainer_cpu_ms_per_step"] = median(&Sample::trainer_cpu_ms);
  j["daemon_cpu_ms_per_step"] = median(&Sample::daemon_cpu_ms);
  j["trainer_cpu_us_per_matrix"] = 1e3 * median(&Sample::trainer_cpu_ms) / n;
  for (const auto& r : runs) {
    j["runs"].push_back({{"wall_ms", r.wall_ms},
                         {"trainer_cpu_ms", r.trainer_cpu_ms},
                         {"daemon_cpu_ms", r.daemon_cpu_ms}});
  }
  return j;
}

absl::Status Run(int argc, char** argv) {
  PinTo(absl::GetFlag(FLAGS_trainer_cpu));
  DaemonProcess d;
  if (auto st = Start(d, absl::GetFlag(FLAGS_daemon_cpu)); !st.ok()) return st;
  std::vector<Sample> bell, stream;
  for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
    // Alternate which goes first, so neither always follows the other.
    for (bool doorbell : {r % 2 == 0, r % 2 != 0}) {
      auto s = RunOnce(d, doorbell, r);
      if (!s.ok()) return s.status();
      (doorbell ? bell : stream).push_back(*s);
      std::printf(
          "repeat %d %-8s %7.3f ms/step wall, %7.3f trainer CPU, "
          "%7.3f dmuond CPU\n",
          r, doorbell ? "doorbell" : "stream", s->wall_ms, s->trainer_cpu_ms,
          s->daemon_cpu_ms);
    }
  }
  const int n = absl::GetFlag(FLAGS_matrices);
  nlohmann::json extra;
  extra["table"] = {{"matrices", n},
                    {"rows", absl::GetFlag(FLAGS_rows)},
                    {"cols", absl::GetFlag(FLAGS_cols)}};
  extra["steps"] = absl::GetFlag(FLAGS_steps);
  extra["repeats"] = absl::GetFlag(FLAGS_repeats);
  extra["cpus"] = {{"trainer", absl::GetFlag(FLAGS_trainer_cpu)},
                   {"daemon", absl::GetFlag(FLAGS_daemon_cpu)}};
  extra["statistic"] = "per step over the timed steps, median over repeats";
  extra["doorbell"] = Summary(bell, n);
  extra["stream"] = Summary(stream, n);
  for (const char* k : {"wall_ms_per_step", "trainer_cpu_ms_per_step",
                        "daemon_cpu_ms_per_step"}) {
    extra["doorbell_over_stream"][k] =
        extra["doorbell"][k].get<double>() / extra["stream"][k].get<double>();
  }
  std::printf("%s\n", extra.dump(1).c_str());
  // As ./dmuon runs it, without this checkout's paths.
  std::string command = "./dmuon bench handoff";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--dmuond=", 0) != 0 && a.rfind("--out=", 0) != 0)
      absl::StrAppend(&command, " ", a);
  }
  return WriteJson(absl::GetFlag(FLAGS_out), "handoff", CpuMachine(), command,
                   {}, extra);
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status st = dmuon::bench::Run(argc, argv); !st.ok()) {
    std::fprintf(stderr, "handoff_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
