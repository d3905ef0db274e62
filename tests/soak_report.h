// The soak's figures (tests/soak_test.cc, tests/soak_attack.h): step
// latency percentiles of a phase (reported, never asserted: timing is not
// a test's business, docs/testing.md), the daemon's samples and each
// phase's leak-check window, and what the JSON file needs (quoted strings,
// the machine it ran on).

#ifndef DMUON_TESTS_SOAK_REPORT_H_
#define DMUON_TESTS_SOAK_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tests/proc_stats.h"

namespace dmuon::testing {

// Per-step latencies of one phase, in milliseconds.
struct Latency {
  int64_t steps = 0;
  double p50 = 0, p99 = 0, mean = 0, max = 0;
};
Latency Summarize(std::vector<double> ms);
// {"steps": N, "p50_ms": ..., "p99_ms": ..., "mean_ms": ..., "max_ms": ...}
std::string LatencyJson(const Latency& l);
// "p50 12.3 ms, p99 45.6 ms (N steps)"
std::string Describe(const Latency& l);

// One sample of the daemon (tests/proc_stats.h) during the soak.
struct Sample {
  double t = 0;  // seconds since the sessions started
  ProcStats stats;
  int sessions = -1;  // open, per the daemon's Status
  int64_t steps = 0;  // session steps so far (the soak's count)
};
std::string SampleJson(const Sample& s);

// The leak check's slack over a warm-up's maximum.
inline constexpr int64_t kRssSlackKb = 32 * 1024;
inline constexpr double kRssSlackFraction = 0.25;
inline constexpr int kFdSlack = 16;
inline constexpr int kThreadSlack = 8;

// One phase's leak check: the maximum of its warm-up's samples, then each
// later sample against it plus the slack.
struct Window {
  const char* name = "";
  double start = 0, warmup = 0;  // seconds since the sessions started
  ProcStats warm;                // the warm-up's maximum of each figure
  bool warmed = false;
  int64_t rss_max_after = 0;  // the largest RSS after the warm-up
  int64_t rss_last = 0;

  // Takes `s` into the warm-up, or checks it (what grew past the slack
  // goes to `growth`).
  void Add(const Sample& s, std::vector<std::string>* growth);
  std::string Json() const;
};
Window MakeWindow(const char* name, double start, double warmup);

// `s` as a JSON string.
std::string JsonQuoted(const std::string& s);
// {"cpu": ..., "cores": ..., "os": ...} of this machine.
std::string MachineJson();

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_SOAK_REPORT_H_
