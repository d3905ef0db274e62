// The physical floor of one optimizer step through dmuond_cuda, counted from
// what the code executes (no CUDA: built and tested everywhere).
//
// Per matrix, two terms:
//   - the GEMM flops the Newton-Schulz plan executes (plan_logic.h's
//     BuildOps for the call the CUDA executor makes: the method resolved as
//     the daemon resolves it, triangle panels where results are symmetric);
//   - the bytes the memory-bound passes read and write: the CUDA executor's
//     own (server/cuda/cuda_executor.cc, ComputeLocked: the step-start copy
//     of the momentum, the gradient gathered from the trainer's memory, the
//     non-finite scan, the momentum update, the lr scale when it is not 1,
//     the update scattered back) and the plan's non-GEMM operations (norm,
//     normalize with the cast to the compute dtype, mirrors, diagonal adds,
//     the output cast).
// The floor is gemm_flops / (a measured bf16 GEMM rate) + bytes / (a
// measured device-to-device copy rate, read plus write bytes per second):
// the step at those two rates, with nothing overlapped and nothing else
// (launches, hand-over, scheduling) costing time.

#ifndef DMUON_BENCHMARKS_GPU_STEP_FLOOR_H_
#define DMUON_BENCHMARKS_GPU_STEP_FLOOR_H_

#include "kernels/kernels.h"

namespace dmuon::bench {

struct StepWork {
  double gemm_flops = 0;  // executed by the NS plan's GEMMs
  double bytes = 0;       // read + written by the memory-bound passes
  StepWork& operator+=(const StepWork& o) {
    gemm_flops += o.gemm_flops;
    bytes += o.bytes;
    return *this;
  }
};

// One matrix of `shape` in one step of the CUDA executor with fp32 momentum
// (its default), NS method `method` (kAuto resolves as the daemon does
// without an autotuner: kernels::CheapestMethod) under `ns`, computing in
// bf16 (fp16 for Gram) with triangle panels, its update scaled by
// `lr_scale`.
StepWork MatrixStepWork(kernels::Shape shape, kernels::Method method,
                        const kernels::NsOptions& ns, double lr_scale);

// gemm_flops / gemm_flops_per_second + bytes / copy_bytes_per_second.
double FloorSeconds(const StepWork& work, double gemm_flops_per_second,
                    double copy_bytes_per_second);

}  // namespace dmuon::bench

#endif  // DMUON_BENCHMARKS_GPU_STEP_FLOOR_H_
