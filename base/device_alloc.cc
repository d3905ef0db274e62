// MallocZeroed (device_alloc.h).

#include "base/device_alloc.h"

#include <cuda_runtime_api.h>

#include "base/cuda_status.h"

namespace dmuon::base {

absl::StatusOr<void*> MallocZeroed(size_t bytes) {
  void* p = nullptr;
  DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  cudaError_t e = cudaMemsetAsync(p, 0, bytes, cudaStreamPerThread);
  if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamPerThread);
  if (e != cudaSuccess) {
    (void)cudaFree(p);
    DMUON_CUDA_RETURN_IF_ERROR(e);
  }
  return p;
}

}  // namespace dmuon::base
