// The service over a GPU transport that moves data (nccl's contract,
// transport.h Region::Pull/Push) on the CPU (fake_device.h): gradients count
// as arrived only once their transfer lands, UpdatesReady follows the
// posted send, step_complete follows the step's snapshot, and a failed
// transfer breaks the job with its reason.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "server/testing/fake_daemon.h"

namespace dmuon::server::testing {
namespace {

TEST(MovingTransport, MatchesTheCpuServiceInEveryShardingMode) {
  const int world = 2;
  Daemon cpu(false), dev(true);
  dev.transports->nccl = true;
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true, v1::TRANSPORT_NCCL).ok());
  EXPECT_EQ(dev.open[0].transport(), v1::TRANSPORT_NCCL);
  EXPECT_EQ(dev.open[1].nccl().nranks(), world + 1);
  for (int64_t step = 1; step <= 3; ++step) {
    const auto g = Grads(world, 300 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g)) << "step " << step;
  }
  EXPECT_EQ(dev.State(), cpu.State());
  const v1::StatusResponse s = dev.svc->Status();
  ASSERT_EQ(s.sessions_size(), world);
  EXPECT_GT(s.sessions(0).bytes_received(), 0u);
}

TEST(MovingTransport, AFailedTransferBreaksTheJobWithItsReason) {
  Daemon dev(true);
  dev.transports->nccl = true;
  ASSERT_TRUE(dev.Open(1, true, v1::TRANSPORT_NCCL).ok());
  const auto g = Grads(1, 7);
  dev.Step(1, g);
  dev.transports->fail = true;
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(2);
  ready.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(dev.svc->OnStepRequest(dev.open[0].session_id(), ready).ok());
  dev.sinks[0]->WaitStep(2);
  const absl::Status why = dev.sinks[0]->abort_status();
  EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable) << why;
  EXPECT_NE(why.message().find("peer gone"), std::string::npos) << why;
  EXPECT_FALSE(dev.svc->GetState(dev.open[0].session_id()).ok())
      << "a broken job's state is not served";
}

// Counts snapshot writes, each made slow: a step_complete sent before its
// snapshot is written would arrive while the write is still going on.
class SlowSnapshots : public ServiceMetrics {
 public:
  void SetSessions(int) override {}
  void SetJobs(int) override {}
  void BytesReceived(uint64_t) override {}
  void BytesSent(uint64_t) override {}
  void StepCompleted(double) override {}
  void NonFiniteGradient() override {}
  void Error(const std::string&) override {}
  void Snapshot(double) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    written++;
  }
  void SetExecutorSource(std::function<std::vector<ExecutorStats>()>) override {
  }
  std::atomic<int> written{0};
};

TEST(MovingTransport, StepCompleteFollowsTheStepsSnapshot) {
  // --snapshot-every: over nccl as over shm, a step is acknowledged only
  // once its snapshot is written (a daemon killed after the client saw
  // step_complete resumes from that step).
  char dir[] = "/tmp/dmuon-nccl-snap-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  ServiceOptions o;
  o.state_dir = dir;
  o.snapshot_every = 1;
  SlowSnapshots metrics;
  Daemon dev(true, o, 2, &metrics);
  dev.transports->nccl = true;
  ASSERT_TRUE(dev.Open(2, true, v1::TRANSPORT_NCCL).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    dev.Step(step, Grads(2, 40 + step));  // every rank's step_complete
    EXPECT_EQ(metrics.written.load(), step) << "step " << step;
  }
}

}  // namespace
}  // namespace dmuon::server::testing
