// PrometheusMetrics: every ServiceMetrics observation as the /metrics text
// serves it (the service's side of these numbers: server/service_test.cc and
// server/executor_state_test.cc, through a recording ServiceMetrics; the
// exposer over HTTP: tests/daemon_test.cc).

#include "daemon/prometheus_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace dmuon::server {
namespace {

// The value of one sample line `series` ("name{labels}") of /metrics text;
// NaN when there is none.
double MetricValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0)
      return std::strtod(line.c_str() + series.size() + 1, nullptr);
  }
  return NAN;
}

TEST(PrometheusMetrics, ServesTheServiceObservations) {
  PrometheusMetrics m;
  ServiceMetrics& observed = m;
  observed.SetSessions(3);
  observed.SetJobs(2);
  observed.BytesReceived(100);
  observed.BytesReceived(28);
  observed.BytesSent(64);
  observed.StepCompleted(0.003);
  observed.StepCompleted(0.2);
  observed.NonFiniteGradient();
  observed.Error("INVALID_ARGUMENT");
  observed.Error("INVALID_ARGUMENT");
  observed.Error("UNAVAILABLE");
  observed.Snapshot(0.01);
  observed.SnapshotFailure("write");
  observed.SnapshotFailure("corrupt");
  observed.SnapshotFailure("corrupt");

  const std::string text = m.Render();
  EXPECT_EQ(MetricValue(text, "dmuon_sessions"), 3) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_jobs"), 2) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_bytes_received_total"), 128) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_bytes_sent_total"), 64) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_steps_total"), 2) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_step_latency_seconds_count"), 2) << text;
  EXPECT_DOUBLE_EQ(MetricValue(text, "dmuon_step_latency_seconds_sum"), 0.203)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_nonfinite_gradients_total"), 1) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_errors_total{code=\"INVALID_ARGUMENT\"}"),
            2)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_errors_total{code=\"UNAVAILABLE\"}"), 1)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_snapshots_total"), 1) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_snapshot_seconds_count"), 1) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_snapshot_failures_total{kind=\"write\"}"),
            1)
      << text;
  EXPECT_EQ(
      MetricValue(text, "dmuon_snapshot_failures_total{kind=\"corrupt\"}"), 2)
      << text;
  // Every kind is served from the start, at 0.
  EXPECT_EQ(MetricValue(text, "dmuon_snapshot_failures_total{kind=\"stale\"}"),
            0)
      << text;

  // Gauges follow the latest value.
  observed.SetJobs(0);
  EXPECT_EQ(MetricValue(m.Render(), "dmuon_jobs"), 0);
}

TEST(PrometheusMetrics, ReadsExecutorsFromTheSourceAtScrapeTime) {
  PrometheusMetrics m;
  // No source: no executor series.
  EXPECT_TRUE(std::isnan(MetricValue(
      m.Render(), "dmuon_executor_busy_seconds_total{device=\"cpu:0\"}")));

  std::vector<ExecutorStats> stats(2);
  stats[0].device = "cpu:0";
  stats[0].busy_seconds = 1.5;
  stats[0].queue_depth = 4;
  stats[0].matrices = 12;
  stats[0].flops = 3e9;
  stats[0].memory_bytes = 4096;
  stats[0].predicted_step_seconds = 0.25;
  stats[0].measured_step_seconds = 0.125;
  stats[1].device = "fake:1";
  stats[1].healthy = false;
  stats[1].graph_fallbacks = 3;
  int reads = 0;
  m.SetExecutorSource([&] {
    ++reads;
    return stats;
  });
  EXPECT_EQ(reads, 0) << "read at scrape time only";

  std::string text = m.Render();
  EXPECT_EQ(reads, 1);
  const std::string cpu = "{device=\"cpu:0\"}", fake = "{device=\"fake:1\"}";
  EXPECT_EQ(MetricValue(text, "dmuon_executor_busy_seconds_total" + cpu), 1.5)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_queue_depth" + cpu), 4) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_matrices_total" + cpu), 12)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_flops_total" + cpu), 3e9) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_device_memory_bytes" + cpu), 4096) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_healthy" + cpu), 1) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_healthy" + fake), 0) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_graph_fallbacks_total" + fake), 3)
      << text;
  EXPECT_DOUBLE_EQ(
      MetricValue(text, "dmuon_executor_predicted_step_seconds" + cpu), 0.25)
      << text;
  EXPECT_DOUBLE_EQ(
      MetricValue(text, "dmuon_executor_measured_step_seconds" + cpu), 0.125)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_executor_predicted_step_seconds" + fake),
            0)
      << text;

  // Later scrapes read the source again.
  stats[0].predicted_step_seconds = 0;
  EXPECT_EQ(
      MetricValue(m.Render(), "dmuon_executor_predicted_step_seconds" + cpu),
      0);
  // A detached source serves no executors (the service detaches on
  // destruction).
  m.SetExecutorSource(nullptr);
  EXPECT_TRUE(std::isnan(
      MetricValue(m.Render(), "dmuon_executor_predicted_step_seconds" + cpu)));
}

// dmuon_fallbacks_total{kind}: every kind at 0 before any source (alerts
// see the series), then the source's counts, read at each scrape.
TEST(PrometheusMetrics, FallbacksByKindFromTheSourceAtScrapeTime) {
  PrometheusMetrics m;
  auto series = [](const std::string& kind) {
    return "dmuon_fallbacks_total{kind=\"" + kind + "\"}";
  };
  std::string text = m.Render();
  EXPECT_NE(text.find("# TYPE dmuon_fallbacks_total counter"),
            std::string::npos)
      << text;
  for (const char* kind : {"graph_eager", "unhealthy_executor", "rewind"})
    EXPECT_EQ(MetricValue(text, series(kind)), 0) << text;
  std::map<std::string, uint64_t> counts = {
      {"graph_eager", 7}, {"unhealthy_executor", 0}, {"rewind", 2}};
  int reads = 0;
  m.SetFallbackSource([&] {
    ++reads;
    return counts;
  });
  EXPECT_EQ(reads, 0) << "read at scrape time only";
  text = m.Render();
  EXPECT_EQ(reads, 1);
  EXPECT_EQ(MetricValue(text, series("graph_eager")), 7) << text;
  EXPECT_EQ(MetricValue(text, series("unhealthy_executor")), 0) << text;
  EXPECT_EQ(MetricValue(text, series("rewind")), 2) << text;
  counts["rewind"] = 5;
  EXPECT_EQ(MetricValue(m.Render(), series("rewind")), 5);
  m.SetFallbackSource(nullptr);
  EXPECT_EQ(MetricValue(m.Render(), series("rewind")), 0);
}

// dmuon_job_*{job,principal}: each job the source lists, read at each
// scrape; a job the source no longer lists (dropped) has no series left.
TEST(PrometheusMetrics, JobsFromTheSourceAtScrapeTime) {
  PrometheusMetrics m;
  const std::string a = "{job=\"run-a\",principal=\"team-a\"}";
  const std::string b = "{job=\"run-b\",principal=\"\"}";
  JobMetrics ja;
  ja.job_id = "run-a";
  ja.principal = "team-a";
  ja.weight = 3;
  ja.max_device_share = 0.5;
  ja.device_seconds = 12.5;
  ja.device_share = 0.75;
  ja.queue_wait_mean_seconds = 0.002;
  ja.queue_wait_max_seconds = 0.04;
  LatencyWindow w(16);
  for (double x : {0.01, 0.02, 0.03, 0.5}) w.Add(x);
  ja.exposed = w.Snapshot();
  JobMetrics jb;
  jb.job_id = "run-b";  // no step completed yet: a count of 0, no quantiles
  std::vector<JobMetrics> jobs = {ja, jb};
  int reads = 0;
  m.SetJobSource([&] {
    ++reads;
    return jobs;
  });
  EXPECT_EQ(reads, 0) << "read at scrape time only";
  std::string text = m.Render();
  EXPECT_EQ(reads, 1);
  EXPECT_EQ(MetricValue(text, "dmuon_job_device_seconds_total" + a), 12.5)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_job_device_share" + a), 0.75);
  EXPECT_EQ(MetricValue(text, "dmuon_job_weight" + a), 3);
  EXPECT_EQ(MetricValue(text, "dmuon_job_max_device_share" + a), 0.5);
  EXPECT_EQ(MetricValue(text, "dmuon_job_queue_wait_mean_seconds" + a), 0.002);
  EXPECT_EQ(MetricValue(text, "dmuon_job_queue_wait_max_seconds" + a), 0.04);
  const std::string q99 =
      "{job=\"run-a\",principal=\"team-a\",quantile=\"0.99\"}";
  EXPECT_EQ(MetricValue(text, "dmuon_job_exposed_latency_seconds" + q99), 0.5)
      << text;
  EXPECT_EQ(MetricValue(text, "dmuon_job_exposed_latency_seconds_count" + a),
            4);
  EXPECT_NEAR(MetricValue(text, "dmuon_job_exposed_latency_seconds_sum" + a),
              0.56, 1e-12);
  EXPECT_EQ(MetricValue(text, "dmuon_job_exposed_latency_seconds_count" + b),
            0);
  EXPECT_NE(text.find("# TYPE dmuon_job_exposed_latency_seconds summary"),
            std::string::npos);
  jobs.erase(jobs.begin());  // run-a dropped
  text = m.Render();
  EXPECT_EQ(text.find("run-a"), std::string::npos) << text;
  EXPECT_EQ(MetricValue(text, "dmuon_job_weight" + b), 1);
  m.SetJobSource(nullptr);
  EXPECT_EQ(m.Render().find("run-b"), std::string::npos);
}

}  // namespace
}  // namespace dmuon::server
