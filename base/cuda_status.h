// CUDA runtime errors as absl::Status, for any code that calls the CUDA
// runtime (kernels, transports, executors, client GPU regions); the cuBLAS
// half of the kernels' checks is in kernels/cuda/check.h.
//   DMUON_CUDA_RETURN_IF_ERROR(expr)  expr is a cudaError_t
// On failure the enclosing function (returning absl::Status or
// absl::StatusOr<T>) returns CudaErrorStatus: RESOURCE_EXHAUSTED for
// out-of-memory and INTERNAL otherwise, with file, line, the expression and
// CUDA's error name and string in the message.

#ifndef DMUON_BASE_CUDA_STATUS_H_
#define DMUON_BASE_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace dmuon::base {

// `e` (not cudaSuccess), returned by `expr` at file:line, as a status.
absl::Status CudaErrorStatus(cudaError_t e, const char* expr, const char* file,
                             int line);

// Clears the calling thread's last CUDA error, after a failed call whose
// error (not sticky: out of memory, an invalid handle) was handled, so that
// a later cudaGetLastError does not report it again.
void ClearLastCudaError();

}  // namespace dmuon::base

#define DMUON_CUDA_RETURN_IF_ERROR(expr)                              \
  do {                                                                \
    const cudaError_t dmuon_cuda_error_ = (expr);                     \
    if (dmuon_cuda_error_ != cudaSuccess) {                           \
      return ::dmuon::base::CudaErrorStatus(dmuon_cuda_error_, #expr, \
                                            __FILE__, __LINE__);      \
    }                                                                 \
  } while (0)

#endif  // DMUON_BASE_CUDA_STATUS_H_
