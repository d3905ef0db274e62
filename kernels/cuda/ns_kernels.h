// The custom device kernels of the CUDA Newton–Schulz path (element-wise and
// layout work; the products go through cuBLASLt). Each launcher enqueues on
// `stream` and returns cudaGetLastError(); none synchronizes, allocates or
// reads host memory, so all of them can be captured into a CUDA graph.
// Matrices are row-major and dense; a batch is contiguous with a stride of
// one matrix. Indices are 64-bit.

#ifndef DMUON_KERNELS_CUDA_NS_KERNELS_H_
#define DMUON_KERNELS_CUDA_NS_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dmuon::kernels::cuda::device {

// Element types (the values are those of cuda::DType).
enum class Elem : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Blocks per matrix of the sum-of-squares pass; `partials` of
// LaunchSumSquares must hold batch * NormBlocks(elements) doubles.
int NormBlocks(int64_t elements);

// partials[b * blocks + i] = partial sum of squares (accumulated in double,
// fixed order: deterministic) of matrix b, for blocks == NormBlocks(elements).
cudaError_t LaunchSumSquares(const void* in, Elem type, int64_t elements,
                             int64_t batch, double* partials,
                             cudaStream_t stream);
// norms[b] = sqrt(sum of matrix b's partials) as float; sets *nonfinite = 1
// (never clears it) if some matrix's sum is not finite.
cudaError_t LaunchFinishNorm(const double* partials, int64_t elements,
                             int64_t batch, float* norms, int* nonfinite,
                             cudaStream_t stream);

// out = op(in) converted to out_type, for a batch of rows x cols matrices;
// op transposes (out is cols x rows) when `transpose`. With `norms`, every
// element of matrix b is divided (in fp32) by
// float(max(double(norms[b]) * safety, eps)) — the NS normalization.
cudaError_t LaunchConvert(const void* in, Elem in_type, void* out,
                          Elem out_type, int64_t rows, int64_t cols,
                          int64_t batch, bool transpose, const float* norms,
                          double safety, double eps, cudaStream_t stream);

// Element-wise conversion of n elements (round to nearest even): host
// staging for Upload/Download, momentum state in and out of bf16.
cudaError_t LaunchCast(const void* in, Elem in_type, void* out, Elem out_type,
                       int64_t n, cudaStream_t stream);

// For each m x m matrix: a[i][j] = a[j][i] for every j < i (the lower
// triangle becomes the mirror of the upper one). A pure copy.
cudaError_t LaunchMirrorUpper(void* a, Elem type, int64_t m, int64_t batch,
                              cudaStream_t stream);

// dst = src + value * I for each m x m matrix (sum in fp32, rounded once);
// dst may equal src (then only the diagonal is touched).
cudaError_t LaunchAddDiagonal(const void* src, void* dst, Elem type, int64_t m,
                              int64_t batch, float value, cudaStream_t stream);

// The Muon momentum step on n elements, torch's lerp exactly (every
// operation rounded separately, no FMA contraction):
//   momentum = lerp(momentum, grad, w_grad), stored as momentum_type;
//   update = nesterov ? lerp(grad, momentum, w_mom) : momentum, stored as
//   update_type;
// where the blend reads the momentum as stored (rounded to momentum_type),
// as torch does with a bf16 momentum buffer. grad is fp32; `update` may
// alias `grad` when update_type is kF32.
cudaError_t LaunchMomentum(const float* grad, void* momentum,
                           Elem momentum_type, void* update, Elem update_type,
                           int64_t n, float w_grad, float w_mom, bool nesterov,
                           cudaStream_t stream);

}  // namespace dmuon::kernels::cuda::device

#endif  // DMUON_KERNELS_CUDA_NS_KERNELS_H_
