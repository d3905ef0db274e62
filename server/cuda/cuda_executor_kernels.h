// Device kernels of the CUDA executor (cuda_executor.cc) beyond those of
// kernels/cuda: scaling, the unreduced-gradient sum, the finiteness check
// of gathered gradients, and the bf16-momentum step. Each launcher enqueues
// on `stream` and returns cudaGetLastError(); none synchronizes.

#ifndef DMUON_SERVER_CUDA_CUDA_EXECUTOR_KERNELS_H_
#define DMUON_SERVER_CUDA_CUDA_EXECUTOR_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dmuon::server::gpu {

// out[i] = in[i] * scale in fp32 (out may equal in).
cudaError_t LaunchScale(const float* in, float* out, int64_t n, float scale,
                        cudaStream_t stream);

// acc[i] += in[i] in fp32.
cudaError_t LaunchAccumulate(const float* in, float* acc, int64_t n,
                             cudaStream_t stream);

// *flag = 1 when any of the n elements is NaN or Inf (never clears it).
cudaError_t LaunchFlagNonFinite(const float* in, int64_t n, int* flag,
                                cudaStream_t stream);

// The Muon momentum step with bf16 momentum (uint16 storage of bf16): torch's
// lerp as in kernels/cuda (every operation rounded separately), the new
// momentum rounded to bf16 and that rounded value used for the Nesterov
// blend, as torch does with a bf16 momentum buffer. update: fp32, may alias
// grad.
cudaError_t LaunchMomentumBf16(const float* grad, uint16_t* momentum,
                               float* update, int64_t n, float w_grad,
                               float w_mom, bool nesterov, cudaStream_t stream);

// fp32 -> bf16 (round to nearest even) and back, for state in and out.
cudaError_t LaunchToBf16(const float* in, uint16_t* out, int64_t n,
                         cudaStream_t stream);
cudaError_t LaunchFromBf16(const uint16_t* in, float* out, int64_t n,
                           cudaStream_t stream);

}  // namespace dmuon::server::gpu

#endif  // DMUON_SERVER_CUDA_CUDA_EXECUTOR_KERNELS_H_
