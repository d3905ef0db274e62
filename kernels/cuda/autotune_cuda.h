// The CUDA backend of the autotuner (kernels/autotune.h): times the batched
// Orthogonalize of a Context for each method and measures its error against
// the CPU fp32 path on the same input.

#ifndef DMUON_KERNELS_CUDA_AUTOTUNE_CUDA_H_
#define DMUON_KERNELS_CUDA_AUTOTUNE_CUDA_H_

#include <string>

#include "kernels/autotune.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dmuon::kernels::cuda {

// `ctx` must outlive the returned function. Inputs are `batch` random
// matrices of `shape` in options.compute's dtype; the time is the median of
// `reps` graph-replayed calls after a warm-up.
Autotuner::MeasureFn CudaMeasure(Context* ctx, Shape shape, int64_t batch,
                                 const CudaNsOptions& options, int reps = 5);

// "cuda:<device description>" for TuneKey::device.
std::string CudaDeviceName(const Context& ctx);

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_AUTOTUNE_CUDA_H_
