// The CUDA executor: one per GPU, on the kernels' CUDA implementation
// (kernels/cuda/cuda_kernels.h) with its own Context and stream. Built only
// with --config=cuda (//server/cuda:cuda_executor); no CUDA type appears here.
//
// Per batch of same-shape tasks (executor.h): gradients are staged into one
// contiguous fp32 device buffer (copied from host memory, or gathered from
// GPU transports' device memory with peer copies when another GPU holds
// them, and checked for NaN/Inf there); the momentum step runs against the
// device-resident momentum pool; Newton–Schulz runs batched (launches of
// power-of-two sizes, see SplitBatch, each a cached plan replayed as a CUDA
// graph) in bf16 with fp32 accumulation (Gram: fp16, its published stable
// precision); lr_scale is applied in fp32; the update goes back to host
// memory or straight into the transports' update buffers.
//
// Momentum lives in device memory, one buffer per StateKey (the job
// parameter), initialized from the task's host momentum on first use: fp32,
// or bf16 with `bf16_momentum` — half the memory, and it CHANGES THE NUMBERS
// (the momentum is rounded to bf16 every step, as torch does with a bf16
// buffer), so it is off by default. Each buffer has a second one of its size
// and type, its step-start copy (executor.h keeps_step_start): every batch
// first copies each task's momentum there (device to device), so that a
// step voided mid-step (a rank left, shutdown) goes back to the last
// completed step and a snapshot mid-step holds it. This doubles the
// momentum's device memory (counted in memory_bytes()).
//
// Failures: a failed batch (or WriteState) first waits for the executor's
// stream, so nothing it enqueued still touches the tasks' buffers when the
// caller learns of the failure (cuda_executor_logic.h FinishOnError). Every
// CUDA error fails the batch with a status naming the
// device, the batch and the call (RESOURCE_EXHAUSTED for out of memory) and
// marks the executor unhealthy (gpu_logic.h Health): out of memory until a
// batch succeeds, any other error for good — its later batches then fail at
// once with UNAVAILABLE, and the daemon keeps serving jobs on the others.
// Except a failed CUDA graph: when a plan's graph capture (or replay) fails
// and the same launch then succeeds eagerly, that plan runs eagerly from
// then on, the batch succeeds, the executor stays healthy, the daemon logs a
// warning once per cause and Status/metrics count the plan
// (graph_fallbacks; gpu_logic.h GraphFallback).

#ifndef DMUON_SERVER_CUDA_CUDA_EXECUTOR_H_
#define DMUON_SERVER_CUDA_CUDA_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_kernels.h"
#include "server/executor.h"

namespace dmuon::server {

struct CudaExecutorOptions {
  bool bf16_momentum = false;  // see the header comment: changes the numbers
  bool use_graphs = true;      // replay each NS plan as a CUDA graph
  // dmuond --strict: a failed CUDA graph fails its batch instead of running
  // it eagerly (gpu_logic.h GraphFallback).
  bool strict = false;
  int max_launch = 16;  // most matrices per NS launch (power of two)
  // Cap on the device bytes of cached NS plans (kernels::cuda::
  // ContextOptions; 0: a quarter of the GPU's memory). Plans are referenced
  // by the jobs of the batches that use them and freed when DropJob
  // releases the last; plans of open jobs are never evicted, so they can
  // exceed the cap: the executor then warns once.
  uint64_t plan_cache_bytes = 0;
};

// The options the executor runs Newton–Schulz with for a batch whose
// parameters have `ns`: the direct method in bf16, Gram in fp16 (its
// published stable precision), products accumulating in fp32. The
// autotuner's CUDA backend (cuda_tuning.h) measures with the same.
kernels::cuda::CudaNsOptions ExecutorNsOptions(
    const kernels::NsOptions& ns, const CudaExecutorOptions& options);

// The executor of CUDA ordinal `device`.
absl::StatusOr<std::unique_ptr<Executor>> NewCudaExecutor(
    int device, const CudaExecutorOptions& options);

// One executor per GPU of a --devices spec: "cuda" or "auto" (every GPU),
// "cuda:0,1" (those). "auto" without a usable GPU returns no executors and,
// when `why` is not null, the reason in it (the caller falls back to the
// CPU); "cuda..." without one is FAILED_PRECONDITION with the reason.
absl::StatusOr<std::vector<std::unique_ptr<Executor>>> NewCudaExecutors(
    const std::string& devices, const CudaExecutorOptions& options,
    std::string* why = nullptr);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_CUDA_CUDA_EXECUTOR_H_
