#include "daemon/usable_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
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

std::optional<int> QuotaCores() {
  // The process's own cgroup is the namespace's root inside a container
  // (cgroup v2 with a private cgroup namespace, as Kubernetes and podman
  // set up); outside one, the mount root shows the machine's, which has no
  // quota: either way /sys/fs/cgroup/ is the one that limits this process
  // or a parent that does not.
  if (auto v2 = ReadSmall("/sys/fs/cgroup/cpu.max")) return QuotaCoresV2(*v2);
  auto q = ReadSmall("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  auto p = ReadSmall("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  if (q && p) return QuotaCoresV1(*q, *p);
  return std::nullopt;
}

}  // namespace

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
  const std::optional<int> quota = QuotaCores();
  return quota ? std::min(affinity, *quota) : affinity;
}

}  // namespace dmuon
