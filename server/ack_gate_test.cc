#include "server/ack_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace dmuon::server {
namespace {

TEST(AckGate, SendsOnceAfterTheLastWaitInAnyOrder) {
  int sent = 0;
  AckGate one(1, [&] { ++sent; });
  one.Done();
  EXPECT_EQ(sent, 1);

  sent = 0;
  AckGate two(2, [&] { ++sent; });
  two.Done();  // the transfer posted, the snapshot not yet written
  EXPECT_EQ(sent, 0);
  two.Done();  // the snapshot written
  EXPECT_EQ(sent, 1);

  sent = 0;
  AckGate never(2, [&] { ++sent; });
  never.Done();  // the other wait never ends (a failed transfer)
  EXPECT_EQ(sent, 0);
}

TEST(AckGate, RacingWaitsSendExactlyOnce) {
  for (int round = 0; round < 200; ++round) {
    std::atomic<int> sent{0};
    auto gate = std::make_shared<AckGate>(2, [&] { sent++; });
    std::thread a([gate] { gate->Done(); });
    std::thread b([gate] { gate->Done(); });
    a.join();
    b.join();
    ASSERT_EQ(sent.load(), 1) << "round " << round;
  }
}

}  // namespace
}  // namespace dmuon::server
