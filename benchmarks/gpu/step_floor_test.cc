// MatrixStepWork against counts derived independently: the flops from the
// cost model (kernels/cost_model.h) at the triangle fraction the panel rule
// gives by hand (tiling.cc: k = min(8, m / 256) panels execute (k + 1) / 2k
// of a symmetric product), the bytes from the executor's passes and the
// direct plan's operations counted by hand.

#include "benchmarks/gpu/step_floor.h"

#include <cmath>

#include "gtest/gtest.h"
#include "kernels/cost_model.h"

namespace dmuon::bench {
namespace {

using kernels::Method;
using kernels::Shape;

struct Case {
  Shape shape;
  double fraction;  // of each symmetric product the panels execute
};

// m = 4096: 8 panels, 9/16; m = 1024: 4 panels, 5/8; m = 100: one, 1.
const Case kCases[] = {{{4096, 14336}, 9.0 / 16}, {{14336, 4096}, 9.0 / 16},
                       {{4096, 4096}, 9.0 / 16},  {{1024, 4096}, 5.0 / 8},
                       {{4096, 1024}, 5.0 / 8},   {{100, 37}, 1.0}};

TEST(StepFloor, FlopsAreTheCostModelsAtThePanelFraction) {
  const kernels::NsOptions ns;
  for (const Case& c : kCases) {
    for (Method method : {Method::kDirect, Method::kGram}) {
      const double want =
          kernels::EstimateCost(method, c.shape, ns, c.fraction).flops;
      const double got = MatrixStepWork(c.shape, method, ns, 1.0).gemm_flops;
      EXPECT_NEAR(got / want, 1.0, 1e-12) << c.shape.rows << "x" << c.shape.cols
                                          << " " << kernels::MethodName(method);
    }
  }
}

TEST(StepFloor, AutoIsTheCheapestMethod) {
  const kernels::NsOptions ns;
  for (const Case& c : kCases) {
    const Method cheapest = kernels::CheapestMethod(c.shape, ns);
    EXPECT_EQ(MatrixStepWork(c.shape, Method::kAuto, ns, 1.0).gemm_flops,
              MatrixStepWork(c.shape, cheapest, ns, 1.0).gemm_flops);
  }
}

TEST(StepFloor, DirectBytesCountEveryPass) {
  const kernels::NsOptions ns;  // 5 steps
  for (const Case& c : kCases) {
    const double n = double(c.shape.rows) * c.shape.cols;
    const double m = std::min(c.shape.rows, c.shape.cols);
    // Executor: momentum copy 8n, gather 8n, scan 4n, momentum 16n,
    // scatter 8n; plan: norm 4n, normalize 6n, output 6n; two mirrors a
    // step (A and B), each 2 bytes of m(m - 1) elements read or written.
    const double want = 60 * n + 5 * 2 * 2 * m * (m - 1);
    EXPECT_DOUBLE_EQ(MatrixStepWork(c.shape, Method::kDirect, ns, 1.0).bytes,
                     want);
    // A scale other than 1 is one more fp32 read and write.
    EXPECT_DOUBLE_EQ(MatrixStepWork(c.shape, Method::kDirect, ns, 1.5).bytes,
                     want + 8 * n);
  }
}

TEST(StepFloor, FloorSecondsAddsBothTerms) {
  StepWork w;
  w.gemm_flops = 6e12;
  w.bytes = 3e9;
  EXPECT_DOUBLE_EQ(FloorSeconds(w, 2e12, 1.5e9), 3.0 + 2.0);
  StepWork sum;
  sum += w;
  sum += w;
  EXPECT_DOUBLE_EQ(sum.gemm_flops, 12e12);
  EXPECT_DOUBLE_EQ(sum.bytes, 6e9);
}

}  // namespace
}  // namespace dmuon::bench
