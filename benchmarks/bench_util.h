// Shared by the benchmark programs: medians, result rows, the printed table
// and the JSON file (benchmarks/results/*.json), so every benchmark reports
// in the same conventions.

#ifndef DMUON_BENCHMARKS_BENCH_UTIL_H_
#define DMUON_BENCHMARKS_BENCH_UTIL_H_

#include <sys/types.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"

namespace dmuon::bench {

// One timed configuration. `gflops` counts the dense-equivalent flops of the
// direct method (cost_model.h) so methods compare on one scale; `ratio` is
// gflops / peak_gflops, the peak measured in the same run.
struct Row {
  std::string shape;  // "RxC"
  int64_t batch = 1;
  std::string method;
  double seconds = 0;  // median
  double gflops = 0;
  double peak_gflops = 0;
  double ratio = 0;
  double error = -1;  // relative error vs a reference, when measured
  std::vector<double> samples;
};

// ||got - want||_F / ||want||_F in double; infinite when `got` holds a
// NaN/Inf, so a broken result never looks accurate.
template <typename A, typename B>
double RelativeError(const std::vector<A>& got, const std::vector<B>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    num += d * d;
    den += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  if (!std::isfinite(num)) return INFINITY;
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

// Fills `out` with values uniform in [-1, 1) from `seed` (splitmix64: fast
// enough for gigabytes of benchmark operands, unlike
// std::normal_distribution). GPU rates are measured on such data: products
// of zeros run faster (about 12% on an H200).
void FillRandom(uint64_t seed, absl::Span<float> out);

// Runs `fn` once to warm up, then `reps` times; returns the sorted samples.
absl::StatusOr<std::vector<double>> Time(
    const std::function<absl::Status()>& fn, int reps);
double Median(const std::vector<double>& sorted);

// "1024x4096" -> {1024, 4096}.
absl::StatusOr<std::vector<kernels::Shape>> ParseShapes(
    const std::string& list);

// Prints the table to stdout.
void PrintTable(const std::vector<Row>& rows);

// {"benchmark": name, "date": ..., "machine": machine, "command": ...,
//  "rows": [...]} written atomically to `path` (skipped when empty), plus
// the keys of `extra` (an object, or null for none).
absl::Status WriteJson(const std::string& path, const std::string& name,
                       const nlohmann::json& machine,
                       const std::string& command, const std::vector<Row>& rows,
                       const nlohmann::json& extra = nullptr);

// CPU model, core count, OpenBLAS build, relevant environment.
nlohmann::json CpuMachine();

// A dmuond started for a benchmark; SIGTERM and reaped on destruction.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  // Runs `binary` with `args` plus a loopback --listen and a --port-file;
  // waits (60 s at most) until it serves. UNAVAILABLE when it exits first.
  // The child inherits this thread's CPU affinity.
  absl::Status Start(const std::string& binary, std::vector<std::string> args);
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  std::string address_;
};

}  // namespace dmuon::bench

#endif  // DMUON_BENCHMARKS_BENCH_UTIL_H_
