#include "tests/soak_report.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <thread>

namespace dmuon::testing {
namespace {

// The value of the first line of `file` starting with `key` ("key: v",
// "key=v", quotes dropped).
std::string FirstLineWith(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    std::string v = line.substr(line.find_first_of(":=") + 1);
    v.erase(0, v.find_first_not_of(" \t\""));
    while (!v.empty() && (v.back() == '"' || v.back() == ' ')) v.pop_back();
    return v;
  }
  return "";
}

}  // namespace

Latency Summarize(std::vector<double> ms) {
  Latency l;
  if (ms.empty()) return l;
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  l.steps = static_cast<int64_t>(n);
  l.p50 = ms[n / 2];
  l.p99 = ms[std::min(n - 1, n * 99 / 100)];
  l.mean = std::accumulate(ms.begin(), ms.end(), 0.0) / n;
  l.max = ms.back();
  return l;
}

std::string LatencyJson(const Latency& l) {
  char b[200];
  std::snprintf(b, sizeof(b),
                "{\"steps\": %lld, \"p50_ms\": %.2f, \"p99_ms\": %.2f, "
                "\"mean_ms\": %.2f, \"max_ms\": %.2f}",
                static_cast<long long>(l.steps), l.p50, l.p99, l.mean, l.max);
  return b;
}

std::string Describe(const Latency& l) {
  char b[160];
  std::snprintf(b, sizeof(b),
                "p50 %.1f ms, p99 %.1f ms, mean %.1f ms, max %.1f ms (%lld "
                "steps)",
                l.p50, l.p99, l.mean, l.max, static_cast<long long>(l.steps));
  return b;
}

std::string JsonQuoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string MachineJson() {
  std::ostringstream o;
  o << "{\"cpu\": " << JsonQuoted(FirstLineWith("/proc/cpuinfo", "model name"))
    << ", \"cores\": " << std::thread::hardware_concurrency() << ", \"os\": "
    << JsonQuoted(FirstLineWith("/etc/os-release", "PRETTY_NAME")) << "}";
  return o.str();
}

std::string SampleJson(const Sample& s) {
  std::ostringstream o;
  o << "{\"t\": " << static_cast<int64_t>(s.t)
    << ", \"rss_kb\": " << s.stats.rss_kb << ", \"fds\": " << s.stats.fds
    << ", \"threads\": " << s.stats.threads
    << ", \"shm_maps\": " << s.stats.shm_maps
    << ", \"sessions\": " << s.sessions << ", \"steps\": " << s.steps << "}";
  return o.str();
}

void Window::Add(const Sample& s, std::vector<std::string>* growth) {
  rss_last = s.stats.rss_kb;
  if (s.t <= start + warmup) {
    warm.rss_kb = std::max(warm.rss_kb, s.stats.rss_kb);
    warm.fds = std::max(warm.fds, s.stats.fds);
    warm.threads = std::max(warm.threads, s.stats.threads);
    warmed = true;
    return;
  }
  rss_max_after = std::max(rss_max_after, s.stats.rss_kb);
  const std::string at =
      std::string(name) + " t=" + std::to_string(int(s.t)) + "s ";
  const int64_t rss_limit =
      warm.rss_kb +
      std::max<int64_t>(kRssSlackKb, warm.rss_kb * kRssSlackFraction);
  if (s.stats.rss_kb > rss_limit)
    growth->push_back(at + "rss " + std::to_string(s.stats.rss_kb) + " kB > " +
                      std::to_string(rss_limit));
  if (s.stats.fds > warm.fds + kFdSlack)
    growth->push_back(at + "fds " + std::to_string(s.stats.fds) + " > " +
                      std::to_string(warm.fds + kFdSlack));
  if (s.stats.threads > warm.threads + kThreadSlack)
    growth->push_back(at + "threads " + std::to_string(s.stats.threads) +
                      " > " + std::to_string(warm.threads + kThreadSlack));
}

std::string Window::Json() const {
  std::ostringstream o;
  o << "{\"start_s\": " << static_cast<int64_t>(start)
    << ", \"warmup_s\": " << warmup
    << ", \"warmup_max\": {\"rss_kb\": " << warm.rss_kb
    << ", \"fds\": " << warm.fds << ", \"threads\": " << warm.threads
    << "}, \"rss_max_after_warmup_kb\": " << rss_max_after
    << ", \"rss_last_kb\": " << rss_last << "}";
  return o.str();
}

Window MakeWindow(const char* name, double start, double warmup) {
  Window w;
  w.name = name;
  w.start = start;
  w.warmup = warmup;
  return w;
}

}  // namespace dmuon::testing
