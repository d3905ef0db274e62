// The service over a GPU transport that moves data (nccl's contract,
// transport.h Region::Pull/Push) on the CPU (fake_device.h): gradients count
// as arrived only once their transfer lands, UpdatesReady follows the
// posted send, step_complete follows the step's snapshot, and a failed
// transfer breaks the job with its reason.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "server/testing/fake_daemon.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"

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

// Absent parameters (GradientsReady.absent_param_ids) over the GPU
// transports: nothing is received or sent for them (nccl: no transfer; the
// step's update sends wait for the absent ones' declaration too), their
// momentum is untouched bit for bit, and every other update is bit for bit
// the CPU service's over shm, a SHARDING_UNREDUCED parameter absent on one
// rank only included (zeros in the device gather's mean).
void AbsentMatchesTheCpuService(v1::Transport t) {
  const int world = 2;
  Daemon cpu(false), dev(true);
  dev.transports->nccl = true;
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true, t).ok());
  // absent[step - 1][rank]: "c" (unreduced) on rank 1 only, then "b" (rows)
  // and "a" (replicated) on both ranks, then "c" on both.
  const std::vector<std::vector<std::vector<int>>> absent = {
      {{}, {}}, {{}, {2}}, {{1, 0}, {0, 1}}, {{2}, {2}}, {{}, {}}};
  std::vector<std::vector<float>> last;
  for (int64_t step = 1; step <= static_cast<int64_t>(absent.size()); ++step) {
    const auto& none = absent[step - 1];
    const auto g = Grads(world, 500 + step);
    std::vector<std::vector<v1::StepResponse>> msgs;
    const auto want = cpu.Step(step, g, nullptr, none);
    const auto got = dev.Step(step, g, &msgs, none);
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < kTable.size(); ++i) {
        const bool everywhere =
            std::count(none[0].begin(), none[0].end(), static_cast<int>(i)) >
                0 &&
            std::count(none[1].begin(), none[1].end(), static_cast<int>(i)) > 0;
        if (!everywhere) {
          EXPECT_EQ(got[r][i], want[r][i])
              << "rank " << r << " step " << step << " param " << i;
        }
        bool listed = false, listed_absent = false;
        for (const auto& m : msgs[r]) {
          if (!m.has_updates_ready()) continue;
          for (int id : m.updates_ready().param_ids()) listed |= id == int(i);
          for (int id : m.updates_ready().absent_param_ids())
            listed_absent |= id == int(i);
        }
        EXPECT_EQ(listed, !everywhere) << "rank " << r << " step " << step;
        EXPECT_EQ(listed_absent, everywhere)
            << "rank " << r << " step " << step;
      }
    }
    const auto state = dev.State();
    EXPECT_EQ(state, cpu.State()) << "step " << step;
    for (size_t i = 0; i < kTable.size() && !last.empty(); ++i) {
      if (std::count(none[0].begin(), none[0].end(), static_cast<int>(i)) &&
          std::count(none[1].begin(), none[1].end(), static_cast<int>(i))) {
        EXPECT_EQ(state[i], last[i]) << "absent param " << i << " step " << step
                                     << ": its momentum changed";
      }
    }
    last = state;
  }
}

TEST(MovingTransport, AbsentParametersMatchTheCpuService) {
  AbsentMatchesTheCpuService(v1::TRANSPORT_NCCL);
}

TEST(MovingTransport, AbsentParametersMatchTheCpuServiceOverCudaIpc) {
  AbsentMatchesTheCpuService(v1::TRANSPORT_CUDA_IPC);
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
  EXPECT_FALSE(GetState(*dev.svc, dev.open[0].session_id()).ok())
      << "a broken job's state is not served";
}

// Counts snapshot writes, each made slow: a step_complete sent before its
// snapshot is written would arrive while the write is still going on.
class SlowSnapshots : public NoServiceMetrics {
 public:
  void Snapshot(double) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    written++;
  }
  std::atomic<int> written{0};
};

TEST(MovingTransport, StepCompleteFollowsTheStepsSnapshot) {
  // --snapshot-every: over nccl as over shm, a step is acknowledged only
  // once its snapshot is written (a daemon killed after the client saw
  // step_complete resumes from that step).
  const std::string dir = NewTempDir("nccl-snap");
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
