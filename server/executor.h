// Executors: one per optimizer device. An executor turns gathered gradients
// into updates, lr_scale * NS(momentum step(G)), for a batch of same-shape
// matrices with the same Muon hyperparameters. The CPU executor runs the
// kernels library's OpenBLAS path; the CUDA executor (GPU issue) implements
// the same interface.

#ifndef DMUON_SERVER_EXECUTOR_H_
#define DMUON_SERVER_EXECUTOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"
#include "server/table.h"

namespace dmuon::server {

// One matrix's work. `grad` is the whole gathered fp32 gradient; `momentum`
// the job's fp32 state for it (updated in place); `update` receives
// lr_scale * NS(U). Buffers are shape.elements() long; `update` may alias
// `grad`.
struct ComputeTask {
  const float* grad = nullptr;
  float* momentum = nullptr;
  float* update = nullptr;
  kernels::Shape shape;
  const MuonParams* muon = nullptr;
  double lr_scale = 1.0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string device() const = 0;
  // Every task of `batch` has the same shape and hyperparameters. Inputs are
  // finite and shapes valid (the caller checked), so a failure is internal;
  // momentum may then have advanced.
  virtual absl::Status Compute(absl::Span<const ComputeTask> batch) = 0;
};

// `threads` OpenBLAS threads for this executor's products (0: all cores).
std::unique_ptr<Executor> NewCpuExecutor(int index, int threads);

// True when two tasks can share one batched launch.
bool SameBatchKey(const ComputeTask& a, const ComputeTask& b);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_EXECUTOR_H_
