#include "daemon/usable_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace dmuon {
namespace {

std::optional<std::string> ReadSmall(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::optional<int> Cores(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  return std::max(1, static_cast<int>(std::ceil(quota / period)));
}

int AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// The ancestors of `path` ("/a/b": "/a/b", "/a", ""), nearest first.
std::vector<std::string> UpFrom(absl::string_view path) {
  std::vector<std::string> dirs;
  std::string p(absl::StripSuffix(path, "/"));
  while (true) {
    dirs.push_back(p);
    const size_t slash = p.rfind('/');
    if (p.empty() || slash == std::string::npos) break;
    p.resize(slash);
  }
  return dirs;
}

std::optional<int> Tighter(std::optional<int> a, std::optional<int> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

std::optional<int> QuotaV2(const std::string& root, absl::string_view path) {
  std::optional<int> cores;
  for (const std::string& dir : UpFrom(path)) {
    if (auto max = ReadSmall(root + dir + "/cpu.max")) {
      cores = Tighter(cores, QuotaCoresV2(*max));
    }
  }
  return cores;
}

std::optional<int> QuotaV1(const std::string& root, absl::string_view mount,
                           absl::string_view path) {
  std::optional<int> cores;
  const std::string base = absl::StrCat(root, "/", mount);
  for (const std::string& dir : UpFrom(path)) {
    auto q = ReadSmall(base + dir + "/cpu.cfs_quota_us");
    auto p = ReadSmall(base + dir + "/cpu.cfs_period_us");
    if (q && p) cores = Tighter(cores, QuotaCoresV1(*q, *p));
  }
  return cores;
}

}  // namespace

std::optional<int> QuotaCoresOnPath(const std::string& cgroup_root,
                                    const std::string& proc_self_cgroup) {
  // v2 first: on a hybrid host the v1 cpu controller, if mounted, is the one
  // that applies only when v2 has no cpu.max along the path.
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n')) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() == 3 && f[0] == "0" && f[1].empty()) {
      if (auto cores = QuotaV2(cgroup_root, f[2])) return cores;
    }
  }
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n')) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    std::vector<absl::string_view> controllers = absl::StrSplit(f[1], ',');
    if (std::find(controllers.begin(), controllers.end(), "cpu") ==
        controllers.end()) {
      continue;
    }
    for (absl::string_view mount : {f[1], absl::string_view("cpu")}) {
      if (auto cores = QuotaV1(cgroup_root, mount, f[2])) return cores;
    }
  }
  return std::nullopt;
}

std::optional<int> QuotaCoresV2(const std::string& cpu_max) {
  std::vector<absl::string_view> f = absl::StrSplit(
      absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  double quota = 0, period = 0;
  if (f.size() != 2 || f[0] == "max" || !absl::SimpleAtod(f[0], &quota) ||
      !absl::SimpleAtod(f[1], &period)) {
    return std::nullopt;
  }
  return Cores(quota, period);
}

std::optional<int> QuotaCoresV1(const std::string& quota_us,
                                const std::string& period_us) {
  double quota = 0, period = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(quota_us), &quota) ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(period_us), &period)) {
    return std::nullopt;
  }
  return Cores(quota, period);
}

int UsableCpus() {
  const int affinity = AffinityCpus();
  const std::optional<int> quota = QuotaCoresOnPath(
      "/sys/fs/cgroup", ReadSmall("/proc/self/cgroup").value_or(""));
  return quota ? std::min(affinity, *quota) : affinity;
}

}  // namespace dmuon
