// The service over a GPU transport that moves data (nccl's contract,
// transport.h Region::Pull/Push) on the CPU (fake_device.h): gradients count
// as arrived only once their transfer lands, UpdatesReady follows the
// posted send, and a failed transfer breaks the job with its reason.

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dmuon::server::testing
