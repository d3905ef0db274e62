// The cost model against the closed forms of docs/kernels.md ("Cost model
// and autotuner").

#include "kernels/cost_model.h"

#include <gtest/gtest.h>

namespace dmuon::kernels {
namespace {

TEST(CostModel, DirectClosedForm) {
  const NsOptions o;  // 5 classic steps
  const double m = 512, n = 2048;
  NsCost dense = EstimateCost(Method::kDirect, {512, 2048}, o, 1.0);
  EXPECT_DOUBLE_EQ(dense.flops, 5 * (4 * m * m * n + 2 * m * m * m));
  EXPECT_DOUBLE_EQ(dense.dense_equivalent_flops, dense.flops);
  NsCost sym = EstimateCost(Method::kDirect, {512, 2048}, o, 0.5);
  EXPECT_DOUBLE_EQ(sym.flops, 5 * (3 * m * m * n + m * m * m));
  // Tall matrices cost what their transpose does.
  EXPECT_DOUBLE_EQ(EstimateCost(Method::kDirect, {2048, 512}, o).flops,
                   sym.flops);
}

TEST(CostModel, GramClosedFormWithOneRestart) {
  const NsOptions o;  // restart after step 2
  const double m = 256, n = 1024;
  EXPECT_DOUBLE_EQ(EstimateCost(Method::kGram, {256, 1024}, o, 1.0).flops,
                   8 * m * m * n + 28 * m * m * m);
  EXPECT_DOUBLE_EQ(EstimateCost(Method::kGram, {256, 1024}, o, 0.5).flops,
                   6 * m * m * n + 14 * m * m * m);
}

TEST(CostModel, GramCheaperWhenWide) {
  const NsOptions o;
  EXPECT_EQ(CheapestMethod({1024, 1024}, o), Method::kDirect);
  EXPECT_EQ(CheapestMethod({1024, 4096}, o), Method::kGram);
  EXPECT_EQ(CheapestMethod({4096, 1024}, o), Method::kGram);
  // Notes: ~58% fewer flops at 1:4 than dense direct (6m^2n + 14m^3 with
  // symmetric products vs 5 (4m^2n + 2m^3)).
  const double d = EstimateCost(Method::kDirect, {1000, 4000}, o, 1.0).flops;
  const double g = EstimateCost(Method::kGram, {1000, 4000}, o, 0.5).flops;
  EXPECT_NEAR(1 - g / d, 1 - 38.0 / 90.0, 1e-12);
}

TEST(CostModel, PredictSecondsIsRoofline) {
  NsCost c;
  c.flops = 1e12;
  c.bytes = 1e9;
  EXPECT_DOUBLE_EQ(PredictSeconds(c, 1e12, 1e10), 1.0);
  EXPECT_DOUBLE_EQ(PredictSeconds(c, 1e14, 1e10), 0.1);
}

}  // namespace
}  // namespace dmuon::kernels
