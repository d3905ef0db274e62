#include "tests/proc_stats.h"

#include <dirent.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

namespace dmuon::testing {
namespace {

// "/dev/shm/dmuon-<hex>" in a maps line: the segment's name, else "".
std::string SegmentOf(const std::string& line) {
  const std::string::size_type at = line.find("/dev/shm/dmuon-");
  if (at == std::string::npos) return "";
  std::string name = line.substr(at + 9);  // past "/dev/shm/"
  const std::string::size_type end = name.find(' ');
  return end == std::string::npos ? name : name.substr(0, end);
}

}  // namespace

ProcStats ReadProcStats(pid_t pid) {
  ProcStats s;
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream status(dir + "/status");
  if (!status) return s;
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::stoll(line.substr(6));
    if (line.rfind("VmHWM:", 0) == 0) s.hwm_kb = std::stoll(line.substr(6));
    if (line.rfind("Threads:", 0) == 0) s.threads = std::stoi(line.substr(8));
  }
  if (DIR* d = opendir((dir + "/fd").c_str())) {
    while (dirent* e = readdir(d)) s.fds += e->d_name[0] != '.';
    closedir(d);
  } else {
    return s;
  }
  std::ifstream maps(dir + "/maps");
  std::set<std::string> segments;
  while (std::getline(maps, line)) {
    const std::string name = SegmentOf(line);
    if (!name.empty()) segments.insert(name);
  }
  s.shm_maps = static_cast<int>(segments.size());
  s.ok = s.threads > 0;
  return s;
}

std::string Describe(const ProcStats& s) {
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "rss %.1f MiB, %d fds, %d threads, %d shm segments mapped",
                s.rss_kb / 1024.0, s.fds, s.threads, s.shm_maps);
  return buf;
}

std::vector<std::string> ShmSegmentNames() {
  std::vector<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("dmuon-", 0) == 0) names.push_back(n);
    }
    closedir(d);
  }
  return names;
}

std::string MappedShmSegment() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const std::string name = SegmentOf(line);
    if (!name.empty()) return name;
  }
  return "";
}

}  // namespace dmuon::testing
