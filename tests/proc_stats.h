// What a process holds, from /proc/<pid>: resident memory (now and its
// peak), open file descriptors, threads, and mappings of dmuon shm
// segments. For the leak checks of the soak and fault tests and the memory
// bound of a restart (Linux only).

#ifndef DMUON_TESTS_PROC_STATS_H_
#define DMUON_TESTS_PROC_STATS_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon::testing {

struct ProcStats {
  bool ok = false;     // /proc/<pid> was readable
  int64_t rss_kb = 0;  // VmRSS of /proc/<pid>/status
  int64_t hwm_kb = 0;  // VmHWM: the peak of VmRSS over the process's life
  int fds = 0;         // entries of /proc/<pid>/fd
  int threads = 0;     // Threads of /proc/<pid>/status
  int shm_maps = 0;    // distinct /dev/shm/dmuon-* files in /proc/<pid>/maps
};

ProcStats ReadProcStats(pid_t pid);

// "rss 41.2 MiB, 23 fds, 31 threads, 0 shm segments mapped"
std::string Describe(const ProcStats& s);

// The names (without /dev/shm/) of the dmuon-* entries of /dev/shm.
std::vector<std::string> ShmSegmentNames();

// The dmuon shm segment this process maps ("dmuon-<hex>"; the first one
// found in /proc/self/maps), or "" if none.
std::string MappedShmSegment();

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_PROC_STATS_H_
