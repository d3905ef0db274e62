// The body of dmuond, shared by the CPU build (dmuond.cc) and the CUDA build
// (dmuond_cuda.cc), which differ only in the GpuSupport they pass: flags,
// logging, the service, the gRPC server, metrics, signals and drain.

#ifndef DMUON_DAEMON_DAEMON_MAIN_H_
#define DMUON_DAEMON_DAEMON_MAIN_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/device_transport.h"
#include "server/executor.h"
#include "server/service.h"

namespace dmuon::server {

struct GpuSupport {
  // Executors for a --devices spec other than 'cpu' ('auto', 'cuda',
  // 'cuda:N,...'). 'auto' without a usable GPU: no executors, the reason in
  // *why (the daemon then runs on the CPU). strict: --strict (their
  // CUDA-graph fallback refused, gpu_logic.h GraphFallback).
  std::function<absl::StatusOr<std::vector<std::unique_ptr<Executor>>>(
      const std::string& devices, bool bf16_momentum, bool strict,
      std::string* why)>
      executors;
  // The GPU transports served along with those executors, given their
  // device names (may be empty).
  std::function<std::shared_ptr<DeviceTransports>(
      const std::vector<std::string>& devices)>
      transports;
  // The autotuner's backend for those executors (with --autotune-cache),
  // given their device names; an error disables the autotuner (the cost
  // model decides) with a warning. Null: measured on the CPU.
  std::function<absl::StatusOr<Tuning>(const std::vector<std::string>& devices)>
      tuning;
};

// Runs the daemon until SIGTERM/SIGINT; returns the exit code. `gpu` null:
// a CPU-only build, which refuses --devices=cuda... with a message naming
// dmuond_cuda, and treats --devices=auto as the CPU.
int DaemonMain(int argc, char** argv, const GpuSupport* gpu);

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_DAEMON_MAIN_H_
