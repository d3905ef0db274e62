// A job's exposed latency (Job::exposed_latency, JobStatus.exposed_latency,
// ServiceMetrics' job source): per step, from the last rank's last
// gradient hand-off to the step's last update delivered. Checked against
// bounds the test itself brackets with its own clock reads around the
// hand-off and the delivery (so no assertion depends on how fast this
// machine is): at least the executor's deliberate delay, at most what the
// test saw from before the last hand-off to after the step completed, and
// without the time the first rank waited for the second (which the
// per-session step latency includes).

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/executor.h"
#include "server/principal.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kComputeDelay = std::chrono::milliseconds(20);
constexpr auto kRankSkew = std::chrono::milliseconds(150);

// The CPU executor, each Compute delayed by kComputeDelay first.
class SlowExecutor : public Executor {
 public:
  SlowExecutor() : inner_(NewCpuExecutor(0, 1)) {}
  std::string device() const override { return inner_->device(); }
  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    std::this_thread::sleep_for(kComputeDelay);
    return inner_->Compute(batch);
  }

 private:
  std::unique_ptr<Executor> inner_;
};

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

TEST(ExposedLatency, FromTheLastHandOffToTheLastUpdate) {
  RecordingMetrics metrics;
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<SlowExecutor>());
  ServiceOptions o;
  o.job_retention_seconds = 0;
  OptimizerService svc(o, std::make_unique<Scheduler>(std::move(ex), 4),
                       &metrics);
  const std::vector<Param> table = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                    {"b", 16, 40, v1::SHARDING_REPLICATED}};
  Principal who;
  who.name = "team-a";
  who.weight = 2;
  Rank r0, r1;
  auto open = [&](Rank& r, int rank) {
    auto s = svc.OpenSession(
        Request("exp", rank, 2, v1::TRANSPORT_INLINE, table), who);
    ASSERT_TRUE(s.ok()) << s.status();
    r.open = *s;
    r.inline_updates.resize(table.size());
    ASSERT_TRUE(svc.Attach(r.open.session_id(), r.sink).ok());
  };
  open(r0, 0);
  open(r1, 1);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<double> upper;  // per step: the test's bracket
  constexpr int kSteps = 3;
  for (int step = 1; step <= kSteps; ++step) {
    const auto grads = RandomGradients(table, rng);
    ASSERT_TRUE(r0.Send(svc, step, grads).ok());
    std::this_thread::sleep_for(kRankSkew);  // rank 0 waits for rank 1
    const Clock::time_point before = Clock::now();
    ASSERT_TRUE(r1.Send(svc, step, grads).ok());
    r0.sink->WaitStep(step);
    r1.sink->WaitStep(step);
    upper.push_back(Seconds(Clock::now() - before));
  }
  const v1::StatusResponse s = svc.Status();
  ASSERT_EQ(s.jobs_size(), 1);
  const v1::LatencySummary& e = s.jobs(0).exposed_latency();
  EXPECT_EQ(e.count(), static_cast<uint64_t>(kSteps));
  // Two parameters, one at a time (a CPU executor): two delayed Computes
  // after the last hand-off, every step.
  const double least = 2 * Seconds(kComputeDelay);
  EXPECT_GE(e.p50_seconds(), least);
  EXPECT_GE(e.max_seconds(), e.p99_seconds());
  EXPECT_LE(e.max_seconds(), *std::max_element(upper.begin(), upper.end()));
  EXPECT_GE(e.mean_seconds(), least);
  // Rank 0's own step latency (first gradient to last update) includes
  // the skew, every step; the exposed latency does not (upper: measured
  // from after the skew).
  const std::vector<double> sessions = metrics.step_seconds();
  ASSERT_EQ(sessions.size(), 2u * kSteps);
  int with_skew = 0;
  for (double x : sessions) with_skew += x >= Seconds(kRankSkew);
  EXPECT_GE(with_skew, kSteps);
  EXPECT_EQ(s.jobs(0).max_device_share(), 1);

  // The same through the metrics' job source, labelled by principal.
  const std::vector<JobMetrics> jobs = metrics.Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].job_id, "exp");
  EXPECT_EQ(jobs[0].principal, "team-a");
  EXPECT_EQ(jobs[0].weight, 2);
  EXPECT_EQ(jobs[0].exposed.count, static_cast<uint64_t>(kSteps));
  EXPECT_EQ(jobs[0].exposed.p99, e.p99_seconds());
  EXPECT_GT(jobs[0].exposed.sum, kSteps * least);
  EXPECT_EQ(jobs[0].device_share, 1);
  EXPECT_GT(jobs[0].device_seconds, 0);

  // Dropped (its ranks closed, no retention): gone from the source.
  ASSERT_TRUE(svc.CloseSession(r0.open.session_id()).ok());
  ASSERT_TRUE(svc.CloseSession(r1.open.session_id()).ok());
  svc.ReapIdleJobs(Clock::now() + std::chrono::seconds(1));
  EXPECT_TRUE(metrics.Jobs().empty());
}

}  // namespace
}  // namespace dmuon::server::testing
