// Helpers of the GPU check's tools: a dmuond_cuda child process, and the
// bf16 GEMM rate that floors are measured against.

#ifndef DMUON_BENCHMARKS_GPU_GPU_TOOL_H_
#define DMUON_BENCHMARKS_GPU_GPU_TOOL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dmuon::bench {

// A daemon started for the tool's lifetime; SIGTERM and reaped on
// destruction.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  // Runs `binary` with `args` plus a loopback --listen and a --port-file;
  // waits (60 s at most) until it serves. UNAVAILABLE when it exits first.
  absl::Status Start(const std::string& binary, std::vector<std::string> args);
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = -1;
  std::string address_;
};

// The best of a few timed runs of an 8192^3 bf16 GEMM (cuBLASLt, fp32
// accumulation) on CUDA ordinal `device`, in flop/s, on random operands.
absl::StatusOr<double> Bf16GemmRate(int device);

}  // namespace dmuon::bench

#endif  // DMUON_BENCHMARKS_GPU_GPU_TOOL_H_
