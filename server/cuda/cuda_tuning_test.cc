// The autotuner's CUDA backend (cuda_tuning.h). The GPU parts skip, with the
// reason, on a machine without one.

#include "server/cuda/cuda_tuning.h"

#include <gtest/gtest.h>

#include "kernels/cuda/autotune_cuda.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/testing/gpu.h"

namespace dmuon::server {
namespace {

namespace cu = kernels::cuda;

TEST(CudaTuning, RefusesDevicesThatAreNotCudaOrdinals) {
  for (const char* bad : {"cpu:0", "cuda:", "cuda:x", "cuda:-1"}) {
    auto t = NewCudaTuning({bad}, CudaExecutorOptions());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(CudaTuning, MeasuresBothMethodsOnTheGpuKeyedByItsName) {
  DMUON_SKIP_WITHOUT_GPU();
  auto ctx = cu::Context::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  auto t = NewCudaTuning({"cuda:0"}, CudaExecutorOptions());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->device, cu::CudaDeviceName(**ctx));
  EXPECT_EQ(t->tolerance, kCudaTuneTolerance);
  auto measure = t->measure({256, 1024}, 1, kernels::NsOptions());
  for (kernels::Method m : {kernels::Method::kDirect, kernels::Method::kGram}) {
    auto got = measure(m);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_GT(got->seconds, 0);
    EXPECT_LT(got->error, kCudaTuneTolerance) << kernels::MethodName(m);
  }
}

}  // namespace
}  // namespace dmuon::server
