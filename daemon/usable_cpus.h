// The cores this process may use: what "0: every core" means for
// --cpu-threads.
//
// std::thread::hardware_concurrency() counts the machine's online CPUs. A
// dmuond pinned to a few cores (taskset, a cpuset cgroup, Kubernetes' static
// CPU manager) or limited by a CFS quota (a pod's CPU limit) would then start
// as many OpenBLAS threads as the node has cores on the few it may run on:
// they spin and preempt each other, and a daemon given one core beside a
// trainer runs its Newton–Schulz several times slower. UsableCpus() counts
// the affinity mask and caps it by the cgroup's CPU quota, rounded up.

#ifndef DMUON_DAEMON_USABLE_CPUS_H_
#define DMUON_DAEMON_USABLE_CPUS_H_

#include <optional>
#include <string>

namespace dmuon {

// The cores of the affinity mask, capped by the CPU quota of the cgroup (v2
// cpu.max, else v1 cpu.cfs_quota_us / cpu.cfs_period_us), at least 1.
int UsableCpus();

// A quota in cores, rounded up, from cgroup v2's cpu.max ("max 100000" or
// "150000 100000"); nullopt for no limit or text it cannot read.
std::optional<int> QuotaCoresV2(const std::string& cpu_max);
// The same from cgroup v1's cpu.cfs_quota_us ("-1": none) and
// cpu.cfs_period_us.
std::optional<int> QuotaCoresV1(const std::string& quota_us,
                                const std::string& period_us);

}  // namespace dmuon

#endif  // DMUON_DAEMON_USABLE_CPUS_H_
