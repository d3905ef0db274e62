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

// The cores of the affinity mask, capped by the CPU quota of the process's
// cgroup or any cgroup above it (v2 cpu.max, else v1 cpu.cfs_quota_us /
// cpu.cfs_period_us), at least 1.
int UsableCpus();

// The tightest quota in cores on the path from the process's cgroup up to
// the hierarchy's root, under `cgroup_root` (/sys/fs/cgroup), given the text
// of /proc/self/cgroup: the v2 line ("0::/a/b") reads cpu.max in
// root/a/b, root/a and root; else the v1 line whose controllers include
// "cpu" ("4:cpu,cpuacct:/a") reads cpu.cfs_* in root/cpu,cpuacct/a ... (or
// root/cpu/a ...). A limit set on a parent caps every child (systemd slices,
// a pod's cgroup above its container's), and a cgroup namespace makes the
// process's own cgroup "/": both cases are covered. nullopt: no quota.
std::optional<int> QuotaCoresOnPath(const std::string& cgroup_root,
                                    const std::string& proc_self_cgroup);

// A quota in cores, rounded up, from cgroup v2's cpu.max ("max 100000" or
// "150000 100000"); nullopt for no limit or text it cannot read.
std::optional<int> QuotaCoresV2(const std::string& cpu_max);
// The same from cgroup v1's cpu.cfs_quota_us ("-1": none) and
// cpu.cfs_period_us.
std::optional<int> QuotaCoresV1(const std::string& quota_us,
                                const std::string& period_us);

}  // namespace dmuon

#endif  // DMUON_DAEMON_USABLE_CPUS_H_
