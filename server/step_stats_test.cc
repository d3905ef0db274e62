#include "server/step_stats.h"

#include <gtest/gtest.h>

namespace dmuon::server {
namespace {

TEST(StepStats, EmptyHasACountAndNoQuantiles) {
  StepStats s;
  v1::StatusResponse r;
  s.Fill(&r);
  EXPECT_TRUE(r.has_step_latency());
  EXPECT_EQ(r.step_latency().count(), 0u);
  EXPECT_EQ(r.step_latency().max_seconds(), 0.0);
  EXPECT_TRUE(r.errors().empty());
}

TEST(StepStats, QuantilesOfTheWindow) {
  StepStats s;
  for (int i = 1; i <= 100; ++i) s.RecordLatency(i);
  v1::StatusResponse r;
  s.Fill(&r);
  EXPECT_EQ(r.step_latency().count(), 100u);
  // The element at floor(q * n) of the sorted window.
  EXPECT_EQ(r.step_latency().p50_seconds(), 51);
  EXPECT_EQ(r.step_latency().p90_seconds(), 91);
  EXPECT_EQ(r.step_latency().p99_seconds(), 100);
  EXPECT_EQ(r.step_latency().max_seconds(), 100);
}

TEST(StepStats, TheRingKeepsTheLastWindowAndCountsEverything) {
  StepStats s(4);
  for (double x : {100.0, 200.0, 1.0, 2.0, 3.0, 4.0}) s.RecordLatency(x);
  v1::StatusResponse r;
  s.Fill(&r);
  EXPECT_EQ(r.step_latency().count(), 6u);
  EXPECT_EQ(r.step_latency().max_seconds(), 4.0);  // 100 and 200 overwritten
  EXPECT_EQ(r.step_latency().p50_seconds(), 3.0);
  EXPECT_EQ(r.step_latency().mean_seconds(), 2.5);  // of the window
}

TEST(StepStats, CountsErrorsByCode) {
  StepStats s;
  s.CountError("ABORTED");
  s.CountError("ABORTED");
  s.CountError("NOT_FOUND");
  v1::StatusResponse r;
  s.Fill(&r);
  EXPECT_EQ(r.errors().at("ABORTED"), 2u);
  EXPECT_EQ(r.errors().at("NOT_FOUND"), 1u);
  EXPECT_EQ(r.errors().size(), 2u);
}

}  // namespace
}  // namespace dmuon::server
