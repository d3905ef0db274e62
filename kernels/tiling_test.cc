#include "kernels/tiling.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace dmuon::kernels {
namespace {

// Marks every element each panel computes; the upper triangle must be hit
// exactly once and nothing outside [0, m) touched.
void CheckCoverage(int64_t m, int64_t panel_rows) {
  std::vector<int> hits(m * m, 0);
  for (const Panel& p : UpperTrianglePanels(m, panel_rows)) {
    ASSERT_GE(p.row0, 0);
    ASSERT_LE(p.row0 + p.rows, m);
    ASSERT_GE(p.col0, 0);
    ASSERT_LE(p.col0 + p.cols, m);
    for (int64_t i = p.row0; i < p.row0 + p.rows; ++i)
      for (int64_t j = p.col0; j < p.col0 + p.cols; ++j) ++hits[i * m + j];
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = i; j < m; ++j)
      ASSERT_EQ(hits[i * m + j], 1) << "m=" << m << " panel=" << panel_rows
                                    << " element (" << i << "," << j << ")";
}

TEST(Tiling, CoversUpperTriangleExactlyOnce) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    int64_t m = 1 + rng() % 300;
    int64_t panel = static_cast<int64_t>(rng() % (m + 3)) - 1;
    CheckCoverage(m, panel);
  }
  CheckCoverage(1, 1);
  CheckCoverage(7, 3);
}

TEST(Tiling, SinglePanelIsFullProduct) {
  auto p = UpperTrianglePanels(64, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].rows, 64);
  EXPECT_EQ(p[0].cols, 64);
  EXPECT_DOUBLE_EQ(PanelFlops(p, 10), 2.0 * 64 * 64 * 10);
  EXPECT_TRUE(UpperTrianglePanels(0, 4).empty());
}

TEST(Tiling, PanelsSaveWork) {
  // k equal panels execute (k + 1) / (2k) of the full product.
  auto p = UpperTrianglePanels(800, 100);
  ASSERT_EQ(p.size(), 8u);
  EXPECT_NEAR(PanelFlops(p, 1) / (2.0 * 800 * 800), 9.0 / 16.0, 1e-12);
}

TEST(Tiling, ChoosePanelRows) {
  EXPECT_EQ(ChoosePanelRows(100, 128), 100);  // too small to split
  EXPECT_EQ(ChoosePanelRows(1024, 128), 128);
  EXPECT_EQ(ChoosePanelRows(4096, 256), 512);  // capped at 8 panels
  EXPECT_EQ(ChoosePanelRows(300, 128), 150);
}

}  // namespace
}  // namespace dmuon::kernels
