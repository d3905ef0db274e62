// Status shows each job's use of the executors (JobStatus device_seconds,
// device_share, weight, queue wait) from the scheduler's accounting, and a
// job's weight is its creator's principal's.

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/principal.h"
#include "server/service.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kTable = {{"a", 48, 64, v1::SHARDING_REPLICATED},
                                   {"b", 32, 64, v1::SHARDING_REPLICATED}};

// Opens `job` as `who` (one rank, shm) and runs `steps` steps.
void RunAs(OptimizerService& svc, const std::string& job, const Principal& who,
           int steps) {
  auto open =
      svc.OpenSession(Request(job, 0, 1, v1::TRANSPORT_SHM, kTable), who);
  ASSERT_TRUE(open.ok()) << open.status();
  Rank r;
  r.open = *open;
  auto shm = transport::OpenShmRegion(r.open.shm_name(),
                                      r.open.layout().total_bytes());
  ASSERT_TRUE(shm.ok()) << shm.status();
  r.shm = *std::move(shm);
  ASSERT_TRUE(svc.Attach(r.open.session_id(), r.sink).ok());
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n;
  for (int step = 1; step <= steps; ++step) {
    std::vector<std::vector<float>> grads;
    for (const Param& p : kTable) {
      grads.emplace_back(p.rows * p.cols);
      for (float& x : grads.back()) x = n(rng);
    }
    ASSERT_TRUE(r.Send(svc, step, grads).ok());
    r.sink->WaitStep(step);
  }
}

TEST(Share, StatusShowsEachJobsShareWeightAndWait) {
  auto svc = NewService({}, 1);
  Principal heavy;
  heavy.name = "heavy";
  heavy.weight = 3;
  RunAs(*svc, "h", heavy, 3);
  RunAs(*svc, "l", Principal{}, 1);
  const v1::StatusResponse s = svc->Status();
  ASSERT_EQ(s.jobs_size(), 2);
  double shares = 0, seconds = 0;
  for (const auto& j : s.jobs()) {
    EXPECT_EQ(j.weight(), j.job_id() == "h" ? 3 : 1) << j.job_id();
    EXPECT_GT(j.device_seconds(), 0) << j.job_id();
    EXPECT_GE(j.queue_wait_max_seconds(), j.queue_wait_mean_seconds());
    EXPECT_GE(j.queue_wait_mean_seconds(), 0);
    shares += j.device_share();
    seconds += j.device_seconds();
  }
  EXPECT_NEAR(shares, 1.0, 1e-9);
  // The executor's busy time is the jobs' (no other work ran).
  EXPECT_NEAR(seconds, s.executors(0).busy_seconds(), 1e-9);
}

}  // namespace
}  // namespace dmuon::server::testing
