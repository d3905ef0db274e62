#include "benchmarks/gpu/gpu_tool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dmuon::bench {

absl::StatusOr<double> Bf16GemmRate(int device) {
  namespace cu = kernels::cuda;
  auto ctx = cu::Context::Create(device);
  if (!ctx.ok()) return ctx.status();
  const int64_t n = 8192;
  // A and B random (zeros run about 12% faster on an H200): one host array,
  // B read from it at an offset so that B is not A.
  const int64_t shift = 4099;
  std::vector<float> host(n * n + shift);
  FillRandom(7, absl::MakeSpan(host));
  std::vector<void*> buf;
  for (int i = 0; i < 3; ++i) {
    auto p = (*ctx)->Allocate(n * n * 2);
    if (!p.ok()) return p.status();
    buf.push_back(*p);
  }
  for (int i = 0; i < 3; ++i) {  // C too: no product starts from zeros
    if (auto st = (*ctx)->Upload(host.data() + (i == 1 ? shift : 0), n * n,
                                 buf[i], cu::DType::kBF16);
        !st.ok())
      return st;
  }
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 5; ++k) {
      if (auto st = (*ctx)->Gemm(buf[0], buf[1], buf[2], cu::DType::kBF16, n, n,
                                 n, 1);
          !st.ok())
        return st;
    }
    if (auto st = (*ctx)->Synchronize(); !st.ok()) return st;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (rep > 0) best = std::max(best, 5 * 2.0 * n * n * n / s);  // warm-up
  }
  for (void* p : buf) (void)(*ctx)->Free(p);
  return best;
}

absl::StatusOr<double> DeviceCopyRate(int device) {
  namespace cu = kernels::cuda;
  auto ctx = cu::Context::Create(device);
  if (!ctx.ok()) return ctx.status();
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::InternalError(
        absl::StrCat("cudaSetDevice: ", cudaGetErrorString(e)));
  const size_t bytes = size_t{1} << 30;
  DeviceBuffers buf{ctx->get(), {}};
  auto src = buf.Get(bytes), dst = buf.Get(bytes);
  for (auto* p : {&src, &dst})
    if (!p->ok()) return p->status();
  // Written once: a never-touched page may read faster than a real one.
  if (const cudaError_t e = cudaMemset(*src, 0x5a, bytes); e != cudaSuccess)
    return absl::InternalError(
        absl::StrCat("cudaMemset: ", cudaGetErrorString(e)));
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 4; ++k) {
      if (const cudaError_t e =
              cudaMemcpy(*dst, *src, bytes, cudaMemcpyDeviceToDevice);
          e != cudaSuccess)
        return absl::InternalError(
            absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
    }
    if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
      return absl::InternalError(cudaGetErrorString(e));
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (rep > 0) best = std::max(best, 4 * 2.0 * bytes / s);  // warm-up
  }
  return best;
}

}  // namespace dmuon::bench
