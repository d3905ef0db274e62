// One status macro per foreign library the CUDA kernels call:
//   DMUON_CUDA_RETURN_IF_ERROR(expr)    expr is a cudaError_t
//                                       (base/cuda_status.h)
//   DMUON_CUBLAS_RETURN_IF_ERROR(expr)  expr is a cublasStatus_t (cuBLASLt)
// On failure the enclosing function (returning absl::Status or
// absl::StatusOr<T>) returns RESOURCE_EXHAUSTED for out-of-memory,
// UNIMPLEMENTED for CUBLAS_STATUS_NOT_SUPPORTED (a configuration the library
// refuses; algo_fallback.h tries another algorithm on it) and INTERNAL
// otherwise, with file, line, the expression and the library's
// error string in the message. Code that calls the CUDA runtime but not
// cuBLAS includes base/cuda_status.h alone.

#ifndef DMUON_KERNELS_CUDA_CHECK_H_
#define DMUON_KERNELS_CUDA_CHECK_H_

#include <cublasLt.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"

namespace dmuon::kernels::cuda::internal {

inline absl::Status CublasErrorStatus(cublasStatus_t s, const char* expr,
                                      const char* file, int line) {
  std::string msg = absl::StrCat(file, ":", line, ": ", expr,
                                 " failed: ", cublasLtGetStatusName(s), " (",
                                 cublasLtGetStatusString(s), ")");
  if (s == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(std::move(msg));
  }
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
    return absl::UnimplementedError(std::move(msg));
  }
  return absl::InternalError(std::move(msg));
}

}  // namespace dmuon::kernels::cuda::internal

#define DMUON_CUBLAS_RETURN_IF_ERROR(expr)                        \
  do {                                                            \
    const cublasStatus_t dmuon_cublas_status_ = (expr);           \
    if (dmuon_cublas_status_ != CUBLAS_STATUS_SUCCESS) {          \
      return ::dmuon::kernels::cuda::internal::CublasErrorStatus( \
          dmuon_cublas_status_, #expr, __FILE__, __LINE__);       \
    }                                                             \
  } while (0)

#endif  // DMUON_KERNELS_CUDA_CHECK_H_
