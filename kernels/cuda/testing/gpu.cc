#include "kernels/cuda/testing/gpu.h"

#include "kernels/cuda/cuda_kernels.h"

namespace dmuon::kernels::cuda::testing {

bool HaveGpu(std::string* why) {
  auto n = DeviceCount();
  if (n.ok() && *n > 0) return true;
  *why = n.ok() ? "0 devices" : std::string(n.status().message());
  return false;
}

}  // namespace dmuon::kernels::cuda::testing
