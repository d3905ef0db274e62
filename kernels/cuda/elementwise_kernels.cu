// Device kernels of kernels/cuda/elementwise_kernels.h.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/elementwise_kernels.h"

namespace dmuon::kernels::cuda::device {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;

unsigned Blocks(int64_t n) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

__device__ __forceinline__ int64_t First() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t Stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

__global__ void ScaleKernel(const float* in, float* out, int64_t n,
                            float scale) {
  for (int64_t i = First(); i < n; i += Stride())
    out[i] = __fmul_rn(in[i], scale);
}

__global__ void AccumulateKernel(const float* in, float* acc, int64_t n) {
  for (int64_t i = First(); i < n; i += Stride())
    acc[i] = __fadd_rn(acc[i], in[i]);
}

__global__ void FlagNonFiniteKernel(const float* in, int64_t n, int* flag) {
  bool bad = false;
  for (int64_t i = First(); i < n; i += Stride()) bad |= !isfinite(in[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

}  // namespace

cudaError_t LaunchScale(const float* in, float* out, int64_t n, float scale,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n, scale);
  return cudaGetLastError();
}

cudaError_t LaunchAccumulate(const float* in, float* acc, int64_t n,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AccumulateKernel<<<Blocks(n), kThreads, 0, stream>>>(in, acc, n);
  return cudaGetLastError();
}

cudaError_t LaunchFlagNonFinite(const float* in, int64_t n, int* flag,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FlagNonFiniteKernel<<<Blocks(n), kThreads, 0, stream>>>(in, n, flag);
  return cudaGetLastError();
}

}  // namespace dmuon::kernels::cuda::device
