// Device kernels of server/cuda/cuda_executor_kernels.h.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "server/cuda/cuda_executor_kernels.h"

namespace dmuon::server::gpu {
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

// torch's at::native lerp, every operation rounded separately (no FMA), as
// kernels/cuda/ns_kernels.cu computes it.
__device__ __forceinline__ float Lerp(float s, float e, float w) {
  const float diff = __fsub_rn(e, s);
  return fabsf(w) < 0.5f ? __fadd_rn(s, __fmul_rn(w, diff))
                         : __fsub_rn(e, __fmul_rn(diff, __fsub_rn(1.0f, w)));
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t v) {
  return __uint_as_float(static_cast<unsigned>(v) << 16);
}
__device__ __forceinline__ uint16_t FloatToBf16(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
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

__global__ void MomentumBf16Kernel(const float* grad, uint16_t* momentum,
                                   float* update, int64_t n, float w_grad,
                                   float w_mom, bool nesterov) {
  for (int64_t i = First(); i < n; i += Stride()) {
    const float g = grad[i];
    const uint16_t stored =
        FloatToBf16(Lerp(Bf16ToFloat(momentum[i]), g, w_grad));
    momentum[i] = stored;
    const float m = Bf16ToFloat(stored);
    update[i] = nesterov ? Lerp(g, m, w_mom) : m;
  }
}

__global__ void ToBf16Kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = First(); i < n; i += Stride()) out[i] = FloatToBf16(in[i]);
}

__global__ void FromBf16Kernel(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = First(); i < n; i += Stride()) out[i] = Bf16ToFloat(in[i]);
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

cudaError_t LaunchMomentumBf16(const float* grad, uint16_t* momentum,
                               float* update, int64_t n, float w_grad,
                               float w_mom, bool nesterov,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MomentumBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(
      grad, momentum, update, n, w_grad, w_mom, nesterov);
  return cudaGetLastError();
}

cudaError_t LaunchToBf16(const float* in, uint16_t* out, int64_t n,
                         cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchFromBf16(const uint16_t* in, float* out, int64_t n,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FromBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

}  // namespace dmuon::server::gpu
