// The autotuner's CUDA backend for dmuond_cuda (service.h Tuning): with
// --autotune-cache, a GPU daemon measures direct and Gram on a GPU, as its
// CUDA executors run them (ExecutorNsOptions: bf16 direct, fp16 Gram), so
// method "auto" picks the faster one there and the planner balances GPU
// seconds. Built only with --config=cuda; no CUDA type appears here.
//
// Contexts: each measured (shape, batch) gets its own kernels::cuda Context,
// created at its first measurement and freed when the measurement function
// is (after Autotuner::Choose). Keeping one Context for the daemon's life
// would keep its plan cache (its measurements' plans, in no job's use, up
// to the cache's cap: a quarter of the GPU's memory) and workspace on an
// executor's GPU, next to the momentum state; a Context
// costs a stream, a cuBLASLt handle and a 32 MiB workspace, little next to a
// measurement (graph capture, warm-up and timed runs of both methods and a
// CPU reference), which runs only on a cache miss. One Context per function
// also keeps the Context single-threaded, as it must be.

#ifndef DMUON_SERVER_CUDA_CUDA_TUNING_H_
#define DMUON_SERVER_CUDA_CUDA_TUNING_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/cuda/cuda_executor.h"
#include "server/service.h"

namespace dmuon::server {

// Relative error (against the CPU fp32 direct method) a method may have on
// the GPU and still be chosen. A selection threshold, not the accuracy bound
// of kernels/cuda/testing/accuracy.h: at the job's shapes direct bf16 emulates
// at 0.9-1.3e-2 and Gram (fp16) at 1.5-2.6e-3 (docs/kernels.md), so both pass
// and a broken kernel does not.
inline constexpr double kCudaTuneTolerance = 2e-2;

// Measures on the first of `devices` (executor names "cuda:<ordinal>", in
// order) whose Context can be created now; Tuning::device is that GPU's
// kernels::cuda::CudaDeviceName ("cuda:NVIDIA H200 (sm_90, 132 SMs)"), the
// name CudaMeasure's results are keyed by. A later measurement uses the
// first of `devices` that still opens and has that same name (a GPU that
// lost its context is skipped). FAILED_PRECONDITION when none opens now;
// INVALID_ARGUMENT for a name that is not "cuda:<ordinal>".
absl::StatusOr<Tuning> NewCudaTuning(const std::vector<std::string>& devices,
                                     const CudaExecutorOptions& options);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_CUDA_CUDA_TUNING_H_
