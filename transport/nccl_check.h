// The status macro for NCCL calls (one per foreign library; CUDA's is in
// base/cuda_status.h):
//   DMUON_NCCL_RETURN_IF_ERROR(expr)  expr is an ncclResult_t
// On a result other than ncclSuccess or ncclInProgress (callers of
// non-blocking communicators handle that one) the enclosing function returns
// UNAVAILABLE for system and remote errors (a peer died, a network failed),
// INVALID_ARGUMENT for invalid arguments and usage, INTERNAL otherwise, with
// file, line, the expression, NCCL's error string and its last error.

#ifndef DMUON_TRANSPORT_NCCL_CHECK_H_
#define DMUON_TRANSPORT_NCCL_CHECK_H_

#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dmuon::transport::internal {

inline absl::Status NcclErrorStatus(ncclResult_t r, const char* expr,
                                    const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  std::string msg = absl::StrCat(
      file, ":", line, ": ", expr, " failed: ", ncclGetErrorString(r),
      last != nullptr && *last ? absl::StrCat(" (", last, ")") : std::string());
  switch (r) {
    case ncclSystemError:
    case ncclRemoteError:
      return absl::UnavailableError(std::move(msg));
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(std::move(msg));
    default:
      return absl::InternalError(std::move(msg));
  }
}

}  // namespace dmuon::transport::internal

#define DMUON_NCCL_RETURN_IF_ERROR(expr)                    \
  do {                                                      \
    const ncclResult_t dmuon_nccl_result_ = (expr);         \
    if (dmuon_nccl_result_ != ncclSuccess &&                \
        dmuon_nccl_result_ != ncclInProgress) {             \
      return ::dmuon::transport::internal::NcclErrorStatus( \
          dmuon_nccl_result_, #expr, __FILE__, __LINE__);   \
    }                                                       \
  } while (0)

#endif  // DMUON_TRANSPORT_NCCL_CHECK_H_
