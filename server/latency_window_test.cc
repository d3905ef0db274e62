#include "server/latency_window.h"

#include <gtest/gtest.h>

namespace dmuon::server {
namespace {

TEST(LatencyWindow, EmptyHasNothing) {
  const LatencySnapshot s = LatencyWindow(8).Snapshot();
  EXPECT_EQ(s.count, 0u);
  EXPECT_EQ(s.sum, 0.0);
  EXPECT_EQ(s.p99, 0.0);
}

TEST(LatencyWindow, CountAndSumCoverEverythingQuantilesTheWindow) {
  LatencyWindow w(3);
  for (double x : {10.0, 1.0, 2.0, 6.0}) w.Add(x);
  const LatencySnapshot s = w.Snapshot();
  EXPECT_EQ(s.count, 4u);
  EXPECT_EQ(s.sum, 19.0);  // 10 too: it left the window, not the sum
  EXPECT_EQ(s.mean, 3.0);  // (1 + 2 + 6) / 3
  EXPECT_EQ(s.p50, 2.0);
  EXPECT_EQ(s.p99, 6.0);
  EXPECT_EQ(s.max, 6.0);
}

}  // namespace
}  // namespace dmuon::server
