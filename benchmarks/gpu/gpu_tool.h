// Helpers of the GPU check's tools (bench_util.h's DaemonProcess runs the
// dmuond_cuda child): the bf16 GEMM rate and the device copy rate that
// floors are measured against, and device buffers freed on every path.

#ifndef DMUON_BENCHMARKS_GPU_GPU_TOOL_H_
#define DMUON_BENCHMARKS_GPU_GPU_TOOL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "benchmarks/bench_util.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dmuon::bench {

// The best of a few timed runs of an 8192^3 bf16 GEMM (cuBLASLt, fp32
// accumulation) on CUDA ordinal `device`, in flop/s, on random operands.
absl::StatusOr<double> Bf16GemmRate(int device);

// The best of a few timed device-to-device copies of 1 GiB (cudaMemcpy on
// CUDA ordinal `device`) in bytes moved per second: read plus written, so
// twice the bytes copied. The memory-bound term of the step floor.
absl::StatusOr<double> DeviceCopyRate(int device);

// Device allocations of one Context, all freed when this goes out of scope.
struct DeviceBuffers {
  kernels::cuda::Context* ctx;
  std::vector<void*> ptrs;
  ~DeviceBuffers() {
    for (void* p : ptrs) (void)ctx->Free(p);
  }
  absl::StatusOr<void*> Get(size_t bytes) {
    auto p = ctx->Allocate(bytes);
    if (p.ok()) ptrs.push_back(*p);
    return p;
  }
};

}  // namespace dmuon::bench

#endif  // DMUON_BENCHMARKS_GPU_GPU_TOOL_H_
