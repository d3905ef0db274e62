// ./dmuon bench scaling (validation): real optimizer steps through 1 and 2
// dmuond processes (--cpu-threads=1 each, the pool planned by
// Client::ConnectPool) for 1 and 2 ranks, against the simulator fed with
// what this run measured: each shape's device time on one thread (the
// daemon's gather, momentum, NS, scale and copy-out for that many ranks)
// and the daemon's round-trip latency. Ranks are threads of this process,
// each with its own pool client; the trainer's backward and forward are
// emulated by sleeping (no CPU), so the daemons are "dedicated" devices.
// Writes benchmarks/results/scaling-validation.json.

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/scaling/cpu_pool.h"
#include "benchmarks/scaling/simulator.h"
#include "client/client.h"
#include "kernels/kernels.h"

ABSL_FLAG(std::string, dmuond, "bazel-bin/daemon/dmuond", "the daemon binary");
ABSL_FLAG(int, scale, 4, "divide GPT-2-small's dimensions by this");
ABSL_FLAG(int, layers, 12, "transformer layers (4 matrices each)");
ABSL_FLAG(int, steps, 7, "timed steps per configuration (after a warm-up)");
ABSL_FLAG(int, kernel_reps, 21, "timed repetitions per shape");
ABSL_FLAG(double, overlap, 0.6,
          "emulated trainer: backward = forward = this x the kernel seconds "
          "per daemon");
ABSL_FLAG(std::string, out, "", "JSON results path");
ABSL_FLAG(int, nice, -10,
          "scheduling priority of this process and its daemons (0: leave)");

namespace dmuon::scaling {
namespace {

using Key = ShapeKey;

std::vector<ParamSpec> Table() {
  return ValidationTable(absl::GetFlag(FLAGS_scale),
                         absl::GetFlag(FLAGS_layers));
}

struct Config {
  std::string name;
  int daemons, world;
  bool trainer;
};

// Each shape's median device time, per pass; their mean over some passes.
struct Stat {
  std::vector<double> medians;
  double Median() const {
    double m = 0;
    for (double x : medians) m += x / medians.size();
    return m;
  }
};
// (shape, ranks, devices running at once)
using Kernels = std::map<std::tuple<Key, int, int>, Stat>;

// One pass over every shape, for 1 and 2 ranks, with one device busy and
// with two busy at once (as two daemons are: the machine is shared with
// other work, so what two threads get at once is measured, not assumed).
absl::StatusOr<Kernels> MeasurePass(nlohmann::json& log) {
  Kernels k;
  const int reps = absl::GetFlag(FLAGS_kernel_reps);
  for (const auto& p : Table()) {
    for (int w : {1, 2}) {
      for (int busy : {1, 2}) {
        const auto key = std::make_tuple(Key{p.rows, p.cols}, w, busy);
        if (k.count(key)) continue;
        auto t = DeviceSecondsAtOnce({p.rows, p.cols}, w, reps, busy);
        if (!t.ok()) return t.status();
        double median = 0;
        for (const auto& samples : *t)
          median += bench::Median(samples) / t->size();
        k[key].medians.push_back(median);
        log[absl::StrCat(p.rows, "x", p.cols, "/", w, "/", busy)] = median;
      }
    }
  }
  return k;
}

Kernels Merge(const Kernels& a, const Kernels& b) {
  Kernels m = a;
  for (const auto& [key, st] : b) {
    m[key].medians.insert(m[key].medians.end(), st.medians.begin(),
                          st.medians.end());
  }
  return m;
}

// The 1-minute load average: other work on this shared machine.
double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double l = -1;
  in >> l;
  return l;
}

absl::StatusOr<PoolResult> Predict(const Config& c, double bwd, double fwd,
                                   double latency, Kernels& dev) {
  const auto table = Table();
  const int layers = absl::GetFlag(FLAGS_layers);
  SessionSpec spec;
  spec.params = table;
  const std::vector<int> owners = c.daemons == 1
                                      ? std::vector<int>(table.size(), 0)
                                      : Client::PlanPool(spec, c.daemons);
  std::map<Key, int> keys;
  std::vector<Task> tasks;
  for (size_t i = 0; i < table.size(); ++i) {
    const Key k{table[i].rows, table[i].cols};
    const Stat& st = dev[{k, c.world, c.daemons}];
    Task t;
    t.segment = static_cast<int>(i / 4);
    t.owner = owners[i];
    t.shape_key = keys.emplace(k, static_cast<int>(keys.size())).first->second;
    t.kernel_s = st.Median();
    t.reduce = t.broadcast = {0.0, latency};
    tasks.push_back(t);
  }
  Timeline tl;
  tl.forward_s.assign(layers, fwd / layers);
  tl.backward_s.assign(layers, bwd / layers);
  return SimulatePool(tl, tasks, {c.daemons, Placement::kDedicated, 16});
}

absl::Status Run(nlohmann::json& out) {
  kernels::SetCpuThreads(1);
  const auto table = Table();
  // Kernel passes interleave with the configurations (before the first,
  // then after each), and each configuration is predicted from the two
  // passes around it: the machine is shared, so its load drifts.
  out["kernels"] = nlohmann::json::array();
  std::vector<Kernels> passes;
  auto pass = [&]() -> absl::Status {
    nlohmann::json log;
    auto k = MeasurePass(log);
    if (!k.ok()) return k.status();
    passes.push_back(*k);
    out["kernels"].push_back(log);
    return absl::OkStatus();
  };
  if (auto st = pass(); !st.ok()) return st;

  // Each on 127.0.0.1 with a free port and one BLAS thread.
  bench::DaemonProcess daemons[2];
  for (auto& d : daemons) {
    if (auto st = d.Start(
            absl::GetFlag(FLAGS_dmuond),
            {"--log-level=warn", "--summary-every-secs=0", "--cpu-threads=1"});
        !st.ok()) {
      return st;
    }
  }
  auto rt = RoundTrip(daemons[0].address());
  if (!rt.ok()) return rt.status();
  auto tiny = DeviceSeconds({8, 8}, 1, 20);
  if (!tiny.ok()) return tiny.status();
  const double latency = std::max(0.0, (*rt - bench::Median(*tiny)) / 2);
  out["round_trip_s"] = *rt;
  out["latency_s"] = latency;
  std::printf("daemon round trip %.3f ms -> latency %.3f ms each way\n",
              *rt * 1e3, latency * 1e3);

  const std::vector<Config> configs = {
      {"1 daemon, 1 rank", 1, 1, false},
      {"2 daemons, 1 rank", 2, 1, false},
      {"2 daemons, 2 ranks", 2, 2, false},
      {"1 daemon, 1 rank, overlapped", 1, 1, true},
      {"2 daemons, 2 ranks, overlapped", 2, 2, true},
  };
  struct Done {
    Config c;
    std::vector<double> samples;
    double phase;
    double load;
  };
  std::vector<Done> runs;
  const int layers = absl::GetFlag(FLAGS_layers);
  for (const Config& c : configs) {
    // The emulated trainer's backward and forward: a fixed share of the
    // per-daemon kernel seconds (as measured just before).
    double total = 0;
    for (const auto& p : table)
      total += passes.back()[{{p.rows, p.cols}, c.world, c.daemons}].Median();
    const double phase =
        c.trainer ? absl::GetFlag(FLAGS_overlap) * total / c.daemons : 0.0;
    std::vector<std::string> addr;
    for (int d = 0; d < c.daemons; ++d) addr.push_back(daemons[d].address());
    const auto t0 = Clock::now();
    auto samples =
        RunSteps(addr, absl::StrCat("val-", runs.size()), table, c.world,
                 absl::GetFlag(FLAGS_steps), phase / layers, phase / layers);
    if (!samples.ok()) return samples.status();
    std::printf("ran %-34s %.1f s\n", c.name.c_str(), Since(t0));
    std::fflush(stdout);
    std::sort(samples->begin(), samples->end());
    runs.push_back({c, *samples, phase, LoadAverage()});
    if (auto st = pass(); !st.ok()) return st;
  }

  std::printf(
      "\nmedian step vs the simulator fed with this run's median kernel "
      "times and latency\n%-32s %9s %9s %8s %15s %10s %10s\n",
      "configuration", "median_s", "predicted", "residual", "range_s",
      "exposed_ms", "predicted");
  out["rows"] = nlohmann::json::array();
  for (size_t i = 0; i < runs.size(); ++i) {
    const Done& r = runs[i];
    Kernels dev = Merge(passes[i], passes[i + 1]);
    auto p = Predict(r.c, r.phase, r.phase, latency, dev);
    if (!p.ok()) return p.status();
    const double med = bench::Median(r.samples);
    const double residual = (med - p->forward_end) / p->forward_end;
    std::printf("%-32s %9.3f %9.3f %+7.1f%% %7.3f-%-7.3f %10.1f %10.1f\n",
                r.c.name.c_str(), med, p->forward_end, 100 * residual,
                r.samples.front(), r.samples.back(),
                (med - p->baseline_end) * 1e3, p->exposed * 1e3);
    out["rows"].push_back({{"config", r.c.name},
                           {"daemons", r.c.daemons},
                           {"world", r.c.world},
                           {"trainer_backward_s", r.phase},
                           {"trainer_forward_s", r.phase},
                           {"samples", r.samples},
                           {"measured_step_s", med},
                           {"predicted_step_s", p->forward_end},
                           {"residual", residual},
                           {"measured_exposed_s", med - p->baseline_end},
                           {"predicted_exposed_s", p->exposed},
                           {"predicted_device_busy_s", p->device_busy},
                           {"load_average_1m_after", r.load}});
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dmuon::scaling

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Other work on a shared machine disturbs the timings less at a higher
  // priority; the daemons inherit it. Needs root; ignored otherwise.
  const int nice = absl::GetFlag(FLAGS_nice);
  if (nice != 0 && setpriority(PRIO_PROCESS, 0, nice) != 0) {
    std::printf("validate: could not set priority %d (%s); running as is\n",
                nice, std::strerror(errno));
  }
  nlohmann::json out;
  if (absl::Status st = dmuon::scaling::Run(out); !st.ok()) {
    std::fprintf(stderr, "validate: %s\n", st.ToString().c_str());
    return 1;
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  out["benchmark"] = "scaling-validation";
  out["date"] = date;
  out["machine"] = dmuon::bench::CpuMachine();
  out["command"] = "./dmuon bench scaling";
  out["nice"] = getpriority(PRIO_PROCESS, 0);
  out["table"] = absl::StrCat("gpt2-small/", absl::GetFlag(FLAGS_scale), ", ",
                              absl::GetFlag(FLAGS_layers),
                              " layers x 4 matrices, unreduced gradients");
  const std::string path = absl::GetFlag(FLAGS_out);
  if (path.empty()) return 0;
  std::ofstream f(path + ".tmp");
  f << out.dump(2) << "\n";
  f.close();
  if (!f || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "validate: cannot write %s\n", path.c_str());
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}
