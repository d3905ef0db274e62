// The daemon's step-timeline recorder (base/trace.h), alone: the cost of
// recording one event as server/step_trace.h records a matrix's stage (a
// name, seven args), per thread, and of formatting it when taken. Prints
// nanoseconds per event; the step timeline's cost per step is this times
// the events a step records (five per matrix): benchmarks/README.md, "Step
// timeline".
//
//   bazel run -c opt //benchmarks:trace_bench -- [--events=N] [--threads=T]

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/trace.h"

ABSL_FLAG(int, events, 60000, "events per thread per round (below the cap)");
ABSL_FLAG(int, threads, 2, "recording threads");
ABSL_FLAG(int, rounds, 5, "rounds; the fastest is reported");

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

void RecordMany(dmuon::TraceRecorder& r, int n) {
  const std::string job = "vm-1234-0123456789ab", name = "blocks.0.attn.qkv";
  for (int k = 0; k < n; ++k) {
    dmuon::TraceEvent e;
    e.name = "ns " + name;
    e.category = "step";
    e.ts_ns = dmuon::TraceNowNs();
    e.dur_ns = 1000;
    e.args = {{"stage", "ns"},  {"job", job},   {"step", int64_t{k}},
              {"param", 3},     {"name", name}, {"shape", "384x1152"},
              {"batch_size", 1}};
    r.Record(std::move(e));
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_events);
  const int threads = absl::GetFlag(FLAGS_threads);
  double best_record = 1e30, best_format = 1e30;
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    dmuon::TraceRecorder r("bench");
    r.Start();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&] { RecordMany(r, n); });
    for (auto& t : ts) t.join();
    best_record = std::min(best_record, Seconds(t0) / n);  // per thread's event
    const auto t1 = std::chrono::steady_clock::now();
    const std::string json = r.TakeEventsJson(getpid(), true);
    best_format =
        std::min(best_format, Seconds(t1) / (static_cast<double>(n) * threads));
    if (r.dropped() != 0) std::fprintf(stderr, "dropped %lu\n", r.dropped());
  }
  std::printf(
      "record: %.0f ns per event per thread (%d threads at once); "
      "format when taken: %.0f ns per event\n",
      best_record * 1e9, threads, best_format * 1e9);
  return 0;
}
