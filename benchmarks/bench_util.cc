#include "benchmarks/bench_util.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

extern "C" char* openblas_get_config(void);
extern "C" int openblas_get_num_threads(void);

extern char** environ;

namespace dmuon::bench {

absl::StatusOr<std::vector<double>> Time(
    const std::function<absl::Status()>& fn, int reps) {
  if (absl::Status st = fn(); !st.ok()) return st;
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status st = fn(); !st.ok()) return st;
    t.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  std::sort(t.begin(), t.end());
  return t;
}

double Median(const std::vector<double>& s) {
  if (s.empty()) return 0;
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

absl::StatusOr<std::vector<kernels::Shape>> ParseShapes(
    const std::string& list) {
  std::vector<kernels::Shape> shapes;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> rc = absl::StrSplit(item, 'x');
    kernels::Shape s;
    if (rc.size() != 2 || !absl::SimpleAtoi(rc[0], &s.rows) ||
        !absl::SimpleAtoi(rc[1], &s.cols) || s.rows <= 0 || s.cols <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shapes: '", item, "' is not ROWSxCOLS"));
    }
    shapes.push_back(s);
  }
  return shapes;
}

void PrintTable(const std::vector<Row>& rows) {
  std::printf("%-12s %5s %-14s %12s %10s %10s %7s %9s\n", "shape", "batch",
              "method", "median_s", "GFLOP/s", "peak", "ratio", "error");
  for (const Row& r : rows) {
    std::printf("%-12s %5lld %-14s %12.6f %10.1f %10.1f %7.3f %9.2e\n",
                r.shape.c_str(), static_cast<long long>(r.batch),
                r.method.c_str(), r.seconds, r.gflops, r.peak_gflops, r.ratio,
                r.error);
  }
  std::fflush(stdout);
}

void FillRandom(uint64_t seed, absl::Span<float> out) {
  uint64_t x = seed;
  for (float& v : out) {
    // splitmix64, the top 24 bits as a float in [-1, 1)
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    v = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
}

absl::Status WriteJson(const std::string& path, const std::string& name,
                       const nlohmann::json& machine,
                       const std::string& command, const std::vector<Row>& rows,
                       const nlohmann::json& extra) {
  if (path.empty()) return absl::OkStatus();
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json j;
  j["benchmark"] = name;
  j["date"] = date;
  j["machine"] = machine;
  j["command"] = command;
  j["rows"] = nlohmann::json::array();
  for (const Row& r : rows) {
    nlohmann::json o = {{"shape", r.shape},   {"batch", r.batch},
                        {"method", r.method}, {"seconds", r.seconds},
                        {"gflops", r.gflops}, {"peak_gflops", r.peak_gflops},
                        {"ratio", r.ratio},   {"samples", r.samples}};
    if (r.error >= 0) o["error"] = r.error;
    j["rows"].push_back(o);
  }
  if (extra.is_object())
    for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = *it;
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

nlohmann::json CpuMachine() {
  nlohmann::json m;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      m["cpu"] = line.substr(line.find(':') + 2);
      break;
    }
  }
  m["cores"] = std::thread::hardware_concurrency();
  m["blas"] = openblas_get_config();
  m["blas_threads"] = openblas_get_num_threads();
  for (const char* var : {"OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) m["env"][var] = v;
  }
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  m["host"] = host;
  return m;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
}

absl::Status DaemonProcess::Start(const std::string& binary,
                                  std::vector<std::string> args) {
  static std::atomic<int> started{0};
  const std::string pf =
      absl::StrCat("/tmp/dmuon-bench-port.", getpid(), ".", started++);
  std::remove(pf.c_str());
  args.insert(args.begin(), binary);
  args.push_back("--listen=127.0.0.1:0");
  args.push_back("--port-file=" + pf);
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0)
    return absl::NotFoundError(absl::StrCat("cannot start ", binary));
  for (int i = 0; i < 1200; ++i) {
    std::ifstream in(pf);
    int port = 0;
    if (in >> port && port > 0) {
      address_ = absl::StrCat("127.0.0.1:", port);
      std::remove(pf.c_str());
      return absl::OkStatus();
    }
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat(binary, " exited at start (its message is above)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::UnavailableError(absl::StrCat(binary, " did not start in 60 s"));
}

}  // namespace dmuon::bench
