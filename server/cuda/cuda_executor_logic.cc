#include "server/cuda/cuda_executor_logic.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/gpu_logic.h"

namespace dmuon::server::gpu {

absl::Status FinishOnError(absl::Status status,
                           const std::function<absl::Status()>& sync) {
  const absl::Status waited = sync();
  if (waited.ok()) return status;
  const absl::StatusCode code = ClassifyFault(waited) > ClassifyFault(status)
                                    ? waited.code()
                                    : status.code();
  return absl::Status(code, absl::StrCat(status.message(),
                                         "; waiting for the stream after it: ",
                                         waited.message()));
}

}  // namespace dmuon::server::gpu
