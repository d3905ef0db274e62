// Whether the CUDA tests have a device: each GPU test skips, saying why, on
// a machine without one (the build still compiles and links it).
//
//   TEST(Foo, Bar) {
//     DMUON_SKIP_WITHOUT_GPU();
//     ...
//   }

#ifndef DMUON_KERNELS_CUDA_TESTING_GPU_H_
#define DMUON_KERNELS_CUDA_TESTING_GPU_H_

#include <gtest/gtest.h>

#include <string>

namespace dmuon::kernels::cuda::testing {

// True when the CUDA runtime reports a device; otherwise false, with *why
// "0 devices" or the runtime's error (no driver, a driver too old).
bool HaveGpu(std::string* why);

}  // namespace dmuon::kernels::cuda::testing

// Skips the current test (GTEST_SKIP, so only in a void function: the test
// body or SetUp) when there is no CUDA device.
#define DMUON_SKIP_WITHOUT_GPU()                                      \
  do {                                                                \
    std::string dmuon_no_gpu_why;                                     \
    if (!::dmuon::kernels::cuda::testing::HaveGpu(&dmuon_no_gpu_why)) \
      GTEST_SKIP() << "no CUDA device: " << dmuon_no_gpu_why;         \
  } while (0)

#endif  // DMUON_KERNELS_CUDA_TESTING_GPU_H_
