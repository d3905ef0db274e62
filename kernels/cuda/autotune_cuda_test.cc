// The CUDA autotuner backend on a real GPU; skips (with the reason) without.

#include "kernels/cuda/autotune_cuda.h"

#include <gtest/gtest.h>

#include "kernels/cuda/testing/accuracy.h"
#include "kernels/cuda/testing/gpu.h"

namespace dmuon::kernels::cuda {
namespace {

TEST(AutotuneCuda, MeasuresBothMethodsAndPicksAnAccurateOne) {
  DMUON_SKIP_WITHOUT_GPU();
  auto ctx = Context::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  CudaNsOptions o;
  o.compute = DType::kF16;
  const Shape shape{256, 1024};
  auto measure = CudaMeasure(ctx->get(), shape, 4, o, 3);
  for (Method m : {Method::kDirect, Method::kGram}) {
    auto got = measure(m);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_GT(got->seconds, 0);
    // The measured error is against the CPU fp32 direct path on the fp32
    // input the device holds rounded to fp16: accuracy.h's bound with that
    // input rounding (direct 8.4e-3, Gram 2.4e-2; emulated on the same
    // input by emulated_precision_test: 1.4e-3 and 1.6e-3).
    CudaNsOptions om = o;
    om.ns.method = m;
    EXPECT_LE(got->error,
              accuracy::ErrorBound(shape, om, DType::kF16, DType::kF16))
        << MethodName(m);
  }
  Autotuner tuner("");
  TuneKey key;
  key.device = CudaDeviceName(**ctx);
  key.shape = {256, 1024};
  key.batch = 4;
  key.dtype = "f16";
  key.schedule = "classic/5";
  auto r = tuner.Choose(key, measure, 2e-2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->candidates.size(), 2u);
}

}  // namespace
}  // namespace dmuon::kernels::cuda
