#include "base/cuda_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::base {

absl::Status CudaErrorStatus(cudaError_t e, const char* expr, const char* file,
                             int line) {
  std::string msg = absl::StrCat(file, ":", line, ": ", expr,
                                 " failed: ", cudaGetErrorName(e), " (",
                                 cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(std::move(msg));
  }
  return absl::InternalError(std::move(msg));
}

void ClearLastCudaError() { (void)cudaGetLastError(); }

}  // namespace dmuon::base
