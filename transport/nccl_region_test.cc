// The daemon's side of an nccl session (NewNcclRegion, AddJobCommunicator)
// over the NCCL double with its blocking semantics
// (transport/testing/fake_nccl.h), a trainer rank played by the test.

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>

#include "transport/nccl.h"
#include "transport/testing/fake_nccl.h"

namespace dmuon::transport {
namespace {

using std::chrono::milliseconds;
using testing::FakeNcclNet;

TEST(NcclWarmUp, DaemonReceivesFromEachRankThenSendsBack) {
  const NcclRanks ranks = NcclRanksFor(2);
  EXPECT_EQ(NcclWarmUpScratchBytes(ranks), 3 * kNcclWarmUpBytes);
  std::byte scratch[12];
  const auto g = DaemonWarmUp(ranks, scratch);
  ASSERT_EQ(g.size(), 4u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(g[2 * r].send);
    EXPECT_EQ(g[2 * r].peer, r);
    EXPECT_EQ(g[2 * r].offset, r * kNcclWarmUpBytes);
    EXPECT_TRUE(g[2 * r + 1].send);
    EXPECT_EQ(g[2 * r + 1].peer, r);
    EXPECT_EQ(g[2 * r + 1].offset, 2 * kNcclWarmUpBytes);
    EXPECT_EQ(g[2 * r].base, scratch);
    EXPECT_EQ(g[2 * r].bytes, kNcclWarmUpBytes);
  }
}

// One trainer rank (0) and the daemon (1) over the double.
struct Job {
  Job()
      : net(std::make_shared<FakeNcclNet>(2, milliseconds(5000))),
        worker(std::make_shared<NcclWorker>(NcclPolicy{})),
        layout(*ComputeLayout({{2, 4, 4}, {3, 4, 4}})),
        mem(layout.total_bytes),
        scratch(NcclWarmUpScratchBytes(NcclRanksFor(1))),
        trainer(layout.total_bytes) {
    comm = AddJobCommunicator(*worker, testing::NewFakeDaemonComm(net, 1),
                              NcclRanksFor(1), scratch.data());
    DeviceView view;
    view.base = mem.data();
    view.bytes = mem.size();
    region = NewNcclRegion(worker, comm, 0, layout, view, [this] { freed++; });
  }
  // The trainer's groups of the slots of `params`.
  std::vector<NcclTransfer> Slots(bool gradients, std::vector<int> params) {
    std::vector<NcclTransfer> t;
    for (int p : params) {
      const Slot& s = layout.slots[p];
      t.push_back({gradients, 1,
                   gradients ? s.gradient_offset : s.update_offset, s.bytes,
                   trainer.data()});
    }
    return t;
  }
  std::shared_ptr<FakeNcclNet> net;
  std::shared_ptr<NcclWorker> worker;
  Layout layout;
  std::vector<std::byte> mem, scratch, trainer;
  int comm = 0;
  std::atomic<int> freed{0};
  std::unique_ptr<Region> region;
};

TEST(NcclRegion, WarmUpGoesFirstAndTheStepMovesTheBytes) {
  Job j;
  for (size_t i = 0; i < j.trainer.size(); ++i)
    j.trainer[i] = static_cast<std::byte>(i * 7);
  std::promise<absl::Status> pulled, pushed;
  // Submitted before anyone joined: still after the warm-up.
  j.region->Pull(1, {1, 0}, [&](absl::Status st) { pulled.set_value(st); });
  ASSERT_TRUE(j.net->Join(0).ok());
  std::byte warm[2 * kNcclWarmUpBytes] = {};
  ASSERT_TRUE(
      j.net
          ->Group(0, {{true, 1, 0, kNcclWarmUpBytes, warm},
                      {false, 1, kNcclWarmUpBytes, kNcclWarmUpBytes, warm}})
          .ok());
  ASSERT_TRUE(j.net->Group(0, j.Slots(true, {1, 0})).ok());
  ASSERT_EQ(pulled.get_future().get(), absl::OkStatus());
  const auto posted = j.net->Posted(1);
  ASSERT_GE(posted.size(), 2u);
  EXPECT_EQ(posted[0].size(), 2u) << "the warm-up is the daemon's first group";
  EXPECT_EQ(posted[0][0].bytes, kNcclWarmUpBytes);
  for (int p : {0, 1}) {
    const Slot& s = j.layout.slots[p];
    EXPECT_EQ(0, std::memcmp(j.mem.data() + s.gradient_offset,
                             j.trainer.data() + s.gradient_offset, s.bytes));
  }
  // The updates back.
  for (size_t i = 0; i < j.mem.size(); ++i)
    j.mem[i] = static_cast<std::byte>(255 - i);
  j.region->Push(1, {0, 1}, [&](absl::Status st) { pushed.set_value(st); });
  ASSERT_EQ(pushed.get_future().get(), absl::OkStatus());
  ASSERT_TRUE(j.net->Group(0, j.Slots(false, {0, 1})).ok());
  ASSERT_TRUE(j.net->Synchronize(0).ok());
  for (int p : {0, 1}) {
    const Slot& s = j.layout.slots[p];
    EXPECT_EQ(0, std::memcmp(j.mem.data() + s.update_offset,
                             j.trainer.data() + s.update_offset, s.bytes));
  }
  EXPECT_TRUE(j.region->Check().ok());
  j.region.reset();
  EXPECT_EQ(j.freed, 1);
  EXPECT_EQ(j.worker->status(j.comm).code(), absl::StatusCode::kCancelled)
      << "a closed session ends the job's communicator";
}

TEST(NcclRegion, ClosingFailsHeldPushesThenFreesTheMemory) {
  Job j;
  std::promise<absl::Status> pushed;
  // One of two gradients posted: the push waits.
  j.region->Absent(1, 1);
  j.region->Push(1, {0}, [&](absl::Status st) { pushed.set_value(st); });
  auto f = pushed.get_future();
  EXPECT_EQ(f.wait_for(milliseconds(50)), std::future_status::timeout);
  j.region.reset();
  EXPECT_EQ(f.get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(j.freed, 1);
}

}  // namespace
}  // namespace dmuon::transport
