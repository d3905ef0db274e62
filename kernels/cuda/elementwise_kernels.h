// Element-wise fp32 device kernels around the Newton–Schulz path: scaling,
// summing and checking gradients gathered on the device (the CUDA executor,
// server/cuda, reduces a gradient's parts and scales updates with them).
// Each launcher enqueues on `stream` and returns cudaGetLastError(); none
// synchronizes, allocates or reads host memory. Indices are 64-bit.

#ifndef DMUON_KERNELS_CUDA_ELEMENTWISE_KERNELS_H_
#define DMUON_KERNELS_CUDA_ELEMENTWISE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dmuon::kernels::cuda::device {

// out[i] = in[i] * scale in fp32 (out may equal in).
cudaError_t LaunchScale(const float* in, float* out, int64_t n, float scale,
                        cudaStream_t stream);

// acc[i] += in[i] in fp32.
cudaError_t LaunchAccumulate(const float* in, float* acc, int64_t n,
                             cudaStream_t stream);

// *flag = 1 when any of the n elements is NaN or Inf (never clears it).
cudaError_t LaunchFlagNonFinite(const float* in, int64_t n, int* flag,
                                cudaStream_t stream);

}  // namespace dmuon::kernels::cuda::device

#endif  // DMUON_KERNELS_CUDA_ELEMENTWISE_KERNELS_H_
