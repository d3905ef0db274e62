// Device kernels of kernels/cuda/ns_kernels.h.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/ns_kernels.h"

namespace dmuon::kernels::cuda::device {
namespace {

constexpr int kThreads = 256;  // 1-D kernels
constexpr int kTile = 32;      // 2-D tiles: 32 x 32 elements, 32 x 8 threads
constexpr int kTileRows = 8;
constexpr int64_t kMaxBlocks = 1 << 20;
constexpr int64_t kMaxGridYZ = 65535;

__device__ __forceinline__ float Load(const float* p, int64_t i) {
  return p[i];
}
__device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float Load(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ void Store(float* p, int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void Store(__half* p, int64_t i, float v) {
  p[i] = __float2half_rn(v);
}

// The NS normalization divisor of matrix b, as the CPU path computes it.
__device__ __forceinline__ float Divisor(const float* norms, int64_t b,
                                         double safety, double eps) {
  return static_cast<float>(fmax(static_cast<double>(norms[b]) * safety, eps));
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) for the C++ type of `e`.
template <typename F>
cudaError_t Dispatch(Elem e, F&& f) {
  switch (e) {
    case Elem::kF32:
      return f(Tag<float>{});
    case Elem::kBF16:
      return f(Tag<__nv_bfloat16>{});
    case Elem::kF16:
      return f(Tag<__half>{});
  }
  return cudaErrorInvalidValue;
}

unsigned Blocks1D(int64_t n) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

unsigned GridYZ(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>(n, 1, kMaxGridYZ));
}

// Sum over the block (every thread must call it); the result is valid in
// thread 0. Fixed reduction order.
__device__ double BlockSum(double v) {
  __shared__ double warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

template <typename T>
__global__ void SumSquaresKernel(const T* in, int64_t elements, int64_t batch,
                                 double* partials) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const T* x = in + b * elements;
    double s = 0;
    for (int64_t i =
             static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < elements; i += stride) {
      const double v = Load(x, i);
      s += v * v;
    }
    s = BlockSum(s);
    if (threadIdx.x == 0) partials[b * gridDim.x + blockIdx.x] = s;
  }
}

__global__ void FinishNormKernel(const double* partials, int blocks,
                                 int64_t batch, float* norms, int* nonfinite) {
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b < batch; b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s = 0;
    for (int i = 0; i < blocks; ++i) s += partials[b * blocks + i];
    norms[b] = static_cast<float>(sqrt(s));
    if (!isfinite(s)) *nonfinite = 1;
  }
}

template <typename Tin, typename Tout>
__global__ void CastKernel(const Tin* in, Tout* out, int64_t elements,
                           int64_t batch, const float* norms, double safety,
                           double eps) {
  const int64_t total = elements * batch;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = Load(in, i);
    if (norms != nullptr) v = v / Divisor(norms, i / elements, safety, eps);
    Store(out, i, v);
  }
}

// out (cols x rows) = in^T (rows x cols) per matrix, through a shared tile
// so that reads and writes are both coalesced.
template <typename Tin, typename Tout>
__global__ void TransposeKernel(const Tin* in, Tout* out, int64_t rows,
                                int64_t cols, int64_t batch, const float* norms,
                                double safety, double eps) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t tiles_x = (cols + kTile - 1) / kTile;
  const int64_t tiles_y = (rows + kTile - 1) / kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const Tin* src = in + b * rows * cols;
    Tout* dst = out + b * rows * cols;
    const float div = norms != nullptr ? Divisor(norms, b, safety, eps) : 1.0f;
    for (int64_t by = blockIdx.y; by < tiles_y; by += gridDim.y) {
      for (int64_t bx = blockIdx.x; bx < tiles_x; bx += gridDim.x) {
        const int64_t c = bx * kTile + tx;
        for (int j = ty; j < kTile; j += kTileRows) {
          const int64_t r = by * kTile + j;
          if (r < rows && c < cols) tile[j][tx] = Load(src, r * cols + c);
        }
        __syncthreads();
        const int64_t r_out = by * kTile + tx;  // column of out
        for (int j = ty; j < kTile; j += kTileRows) {
          const int64_t c_out = bx * kTile + j;  // row of out
          if (r_out < rows && c_out < cols) {
            float v = tile[tx][j];
            if (norms != nullptr) v = v / div;
            Store(dst, c_out * rows + r_out, v);
          }
        }
        __syncthreads();
      }
    }
  }
}

// Destination tile (row tile R = blockIdx.y, column tile C = blockIdx.x) on
// or below the diagonal takes the transpose of source tile (C, R).
template <typename Bits>
__global__ void MirrorKernel(Bits* a, int64_t m, int64_t batch) {
  __shared__ Bits tile[kTile][kTile + 1];
  const int64_t R = blockIdx.y, C = blockIdx.x;
  if (C > R) return;  // whole block: no barrier is skipped by some threads
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    Bits* s = a + b * m * m;
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t sr = C * kTile + j, sc = R * kTile + tx;
      if (sr < m && sc < m) tile[j][tx] = s[sr * m + sc];
    }
    __syncthreads();
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t dr = R * kTile + j, dc = C * kTile + tx;
      // a[dr][dc] = a[dc][dr] = tile[dc - C*32][dr - R*32], strictly lower.
      if (dr < m && dc < dr) s[dr * m + dc] = tile[tx][j];
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void AddDiagonalCopyKernel(const T* src, T* dst, int64_t m,
                                      int64_t batch, float value) {
  const int64_t mm = m * m, total = mm * batch;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i % mm;
    float v = Load(src, i);
    if (r / m == r % m) v += value;
    Store(dst, i, v);
  }
}

template <typename T>
__global__ void AddDiagonalInPlaceKernel(T* a, int64_t m, int64_t batch,
                                         float value) {
  const int64_t total = m * batch;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / m, d = i % m;
    const int64_t idx = b * m * m + d * (m + 1);
    Store(a, idx, Load(a, idx) + value);
  }
}

// torch's at::native lerp, every operation rounded separately (no FMA).
__device__ __forceinline__ float Lerp(float s, float e, float w) {
  const float diff = __fsub_rn(e, s);
  return fabsf(w) < 0.5f ? __fadd_rn(s, __fmul_rn(w, diff))
                         : __fsub_rn(e, __fmul_rn(diff, __fsub_rn(1.0f, w)));
}

// v as the dtype T stores it (identity for fp32).
template <typename T>
__device__ __forceinline__ float Rounded(float v) {
  return v;
}
template <>
__device__ __forceinline__ float Rounded<__nv_bfloat16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
template <>
__device__ __forceinline__ float Rounded<__half>(float v) {
  return __half2float(__float2half_rn(v));
}

// The momentum is stored as Tm and that stored value feeds the Nesterov
// blend, as torch does with a momentum buffer of that dtype.
template <typename Tm, typename Tu>
__global__ void MomentumKernel(const float* grad, Tm* momentum, Tu* update,
                               int64_t n, float w_grad, float w_mom,
                               bool nesterov) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grad[i];
    const float m = Rounded<Tm>(Lerp(Load(momentum, i), g, w_grad));
    Store(momentum, i, m);
    Store(update, i, nesterov ? Lerp(g, m, w_mom) : m);
  }
}

}  // namespace

int NormBlocks(int64_t elements) {
  // About 16 elements per thread, at most 512 blocks per matrix.
  const int64_t per_block = static_cast<int64_t>(kThreads) * 16;
  return static_cast<int>(
      std::clamp<int64_t>((elements + per_block - 1) / per_block, 1, 512));
}

cudaError_t LaunchSumSquares(const void* in, Elem type, int64_t elements,
                             int64_t batch, double* partials,
                             cudaStream_t stream) {
  if (elements <= 0 || batch <= 0) return cudaSuccess;
  const dim3 grid(NormBlocks(elements), GridYZ(batch));
  return Dispatch(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    SumSquaresKernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(in), elements, batch, partials);
    return cudaGetLastError();
  });
}

cudaError_t LaunchFinishNorm(const double* partials, int64_t elements,
                             int64_t batch, float* norms, int* nonfinite,
                             cudaStream_t stream) {
  if (elements <= 0 || batch <= 0) return cudaSuccess;
  FinishNormKernel<<<Blocks1D(batch), kThreads, 0, stream>>>(
      partials, NormBlocks(elements), batch, norms, nonfinite);
  return cudaGetLastError();
}

cudaError_t LaunchConvert(const void* in, Elem in_type, void* out,
                          Elem out_type, int64_t rows, int64_t cols,
                          int64_t batch, bool transpose, const float* norms,
                          double safety, double eps, cudaStream_t stream) {
  const int64_t elements = rows * cols;
  if (elements <= 0 || batch <= 0) return cudaSuccess;
  if (!transpose && norms == nullptr && in_type == out_type) {
    const size_t bytes =
        static_cast<size_t>(elements * batch) * (in_type == Elem::kF32 ? 4 : 2);
    return cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  return Dispatch(in_type, [&](auto in_tag) {
    using Tin = typename decltype(in_tag)::type;
    return Dispatch(out_type, [&](auto out_tag) {
      using Tout = typename decltype(out_tag)::type;
      const Tin* src = static_cast<const Tin*>(in);
      Tout* dst = static_cast<Tout*>(out);
      if (transpose) {
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(
                            (cols + kTile - 1) / kTile, kMaxBlocks)),
                        GridYZ((rows + kTile - 1) / kTile), GridYZ(batch));
        TransposeKernel<Tin, Tout><<<grid, dim3(kTile, kTileRows), 0, stream>>>(
            src, dst, rows, cols, batch, norms, safety, eps);
      } else {
        CastKernel<Tin, Tout>
            <<<Blocks1D(elements * batch), kThreads, 0, stream>>>(
                src, dst, elements, batch, norms, safety, eps);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchCast(const void* in, Elem in_type, void* out, Elem out_type,
                       int64_t n, cudaStream_t stream) {
  return LaunchConvert(in, in_type, out, out_type, 1, n, 1, false, nullptr, 1.0,
                       0.0, stream);
}

cudaError_t LaunchMirrorUpper(void* a, Elem type, int64_t m, int64_t batch,
                              cudaStream_t stream) {
  if (m <= 1 || batch <= 0) return cudaSuccess;
  const int64_t tiles = (m + kTile - 1) / kTile;
  if (tiles > kMaxGridYZ) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(tiles),
                  GridYZ(batch));
  const dim3 block(kTile, kTileRows);
  if (type == Elem::kF32) {
    MirrorKernel<uint32_t>
        <<<grid, block, 0, stream>>>(static_cast<uint32_t*>(a), m, batch);
  } else {
    MirrorKernel<uint16_t>
        <<<grid, block, 0, stream>>>(static_cast<uint16_t*>(a), m, batch);
  }
  return cudaGetLastError();
}

cudaError_t LaunchAddDiagonal(const void* src, void* dst, Elem type, int64_t m,
                              int64_t batch, float value, cudaStream_t stream) {
  if (m <= 0 || batch <= 0) return cudaSuccess;
  return Dispatch(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (src == dst) {
      AddDiagonalInPlaceKernel<T><<<Blocks1D(m * batch), kThreads, 0, stream>>>(
          static_cast<T*>(dst), m, batch, value);
    } else {
      AddDiagonalCopyKernel<T>
          <<<Blocks1D(m * m * batch), kThreads, 0, stream>>>(
              static_cast<const T*>(src), static_cast<T*>(dst), m, batch,
              value);
    }
    return cudaGetLastError();
  });
}

cudaError_t LaunchMomentum(const float* grad, void* momentum,
                           Elem momentum_type, void* update, Elem update_type,
                           int64_t n, float w_grad, float w_mom, bool nesterov,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return Dispatch(momentum_type, [&](auto m_tag) {
    using Tm = typename decltype(m_tag)::type;
    return Dispatch(update_type, [&](auto u_tag) {
      using Tu = typename decltype(u_tag)::type;
      MomentumKernel<Tm, Tu><<<Blocks1D(n), kThreads, 0, stream>>>(
          grad, static_cast<Tm*>(momentum), static_cast<Tu*>(update), n, w_grad,
          w_mom, nesterov);
      return cudaGetLastError();
    });
  });
}

}  // namespace dmuon::kernels::cuda::device
