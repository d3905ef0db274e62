// The NCCL double's semantics (fake_nccl.h): each way the real NCCL blocks
// is a way the fake blocks.

#include "transport/testing/fake_nccl.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

namespace dmuon::transport::testing {
namespace {

using std::chrono::milliseconds;

NcclTransfer Send(int peer, std::vector<float>& buf) {
  return {true, peer, 0, buf.size() * sizeof(float),
          reinterpret_cast<std::byte*>(buf.data())};
}
NcclTransfer Recv(int peer, std::vector<float>& buf) {
  return {false, peer, 0, buf.size() * sizeof(float),
          reinterpret_cast<std::byte*>(buf.data())};
}

// Whether `f` is still running after `wait`.
template <typename T>
bool StillBlocked(std::future<T>& f, milliseconds wait = milliseconds(100)) {
  return f.wait_for(wait) == std::future_status::timeout;
}

TEST(FakeNccl, InitReturnsOnceEveryRankJoined) {
  FakeNcclNet net(2, milliseconds(5000));
  auto a = std::async(std::launch::async, [&] { return net.Join(0); });
  EXPECT_TRUE(StillBlocked(a));
  EXPECT_FALSE(net.AllJoined());
  ASSERT_TRUE(net.StartJoin(1).ok());  // the daemon's non-blocking join
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(net.AllJoined());
  EXPECT_EQ(net.StartJoin(1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FakeNccl, InitTimesOutWhenARankNeverJoins) {
  FakeNcclNet net(2, milliseconds(50));
  const absl::Status st = net.Join(0);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(FakeNccl, FirstGroupBlocksUntilThePeerUsesThePairToo) {
  FakeNcclNet net(2, milliseconds(5000));
  ASSERT_TRUE(net.StartJoin(0).ok());
  ASSERT_TRUE(net.StartJoin(1).ok());
  std::vector<float> out = {1, 2, 3}, in(3), other(3);
  auto sent = std::async(std::launch::async,
                         [&] { return net.Group(0, {Send(1, out)}); });
  EXPECT_TRUE(StillBlocked(sent)) << "lazy connect: group end waits";
  // The peer sending back does not connect 0 -> 1.
  auto back = std::async(std::launch::async,
                         [&] { return net.Group(1, {Send(0, other)}); });
  EXPECT_TRUE(StillBlocked(sent));
  EXPECT_TRUE(StillBlocked(back));
  // Its receive does (and, on its stream, comes after its send).
  auto recv = std::async(std::launch::async,
                         [&] { return net.Group(1, {Recv(0, in)}); });
  ASSERT_TRUE(sent.get().ok());
  ASSERT_TRUE(recv.get().ok());
  EXPECT_TRUE(StillBlocked(back)) << "1 -> 0 is still not connected";
  net.Abort(1);
  EXPECT_EQ(back.get().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(FakeNccl, SendCompletesOnlyWhenTheReceiveIsPosted) {
  FakeNcclNet net(2, milliseconds(5000));
  ASSERT_TRUE(net.StartJoin(0).ok());
  ASSERT_TRUE(net.StartJoin(1).ok());
  std::vector<float> w0(1), w1(1), a = {4, 5}, b(2);
  // Connect both ways in one group each (the warm-up).
  auto wu = std::async(std::launch::async, [&] {
    return net.Group(0, {Send(1, w0), Recv(1, w0)});
  });
  ASSERT_TRUE(net.Group(1, {Recv(0, w1), Send(0, w1)}).ok());
  ASSERT_TRUE(wu.get().ok());
  // Connected: the group end returns at once, the transfer waits.
  auto m = net.Group(0, {Send(1, a)});
  ASSERT_TRUE(m.ok());
  auto done = net.Done(0, *m);
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  auto r = net.Group(1, {Recv(0, b)});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*net.Done(0, *m));
  EXPECT_TRUE(*net.Done(1, *r));
  EXPECT_EQ(b, a);
  EXPECT_TRUE(net.Synchronize(0).ok());
}

TEST(FakeNccl, GroupsOfOneRankRunInStreamOrder) {
  FakeNcclNet net(3, milliseconds(5000));
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(net.StartJoin(r).ok());
  std::vector<float> w0(1), w1(1), w2a(1), w2b(1);
  auto c0 = std::async(std::launch::async,
                       [&] { return net.Group(0, {Send(2, w0)}); });
  auto c1 = std::async(std::launch::async,
                       [&] { return net.Group(1, {Send(2, w1)}); });
  ASSERT_TRUE(net.Group(2, {Recv(0, w2a), Recv(1, w2b)}).ok());
  ASSERT_TRUE(c0.get().ok());
  ASSERT_TRUE(c1.get().ok());
  // Rank 2 receives from 0, then from 1. Rank 1's send cannot complete
  // while rank 2's first group waits for rank 0.
  std::vector<float> x = {1}, y = {2}, got_x(1), got_y(1);
  ASSERT_TRUE(net.Group(2, {Recv(0, got_x)}).ok());
  auto second = net.Group(2, {Recv(1, got_y)});
  ASSERT_TRUE(second.ok());
  auto from1 = net.Group(1, {Send(2, y)});
  ASSERT_TRUE(from1.ok());
  EXPECT_FALSE(*net.Done(1, *from1));
  EXPECT_EQ(got_y[0], 0);
  ASSERT_TRUE(net.Group(0, {Send(2, x)}).ok());
  EXPECT_TRUE(*net.Done(1, *from1));
  EXPECT_TRUE(*net.Done(2, *second));
  EXPECT_EQ(got_x[0], 1);
  EXPECT_EQ(got_y[0], 2);
}

TEST(FakeNccl, MismatchedSizesFailBothSides) {
  FakeNcclNet net(2, milliseconds(2000));
  ASSERT_TRUE(net.StartJoin(0).ok());
  ASSERT_TRUE(net.StartJoin(1).ok());
  std::vector<float> big(4), small(1);
  auto s = std::async(std::launch::async,
                      [&] { return net.Group(0, {Send(1, big)}); });
  ASSERT_TRUE(net.Group(1, {Recv(0, small)}).ok());
  ASSERT_TRUE(s.get().ok());
  const absl::Status st = net.Synchronize(1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("out of the order"), std::string::npos) << st;
  EXPECT_EQ(net.Synchronize(0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FakeNccl, AbortedPeerLeavesItsMatchesHanging) {
  FakeNcclNet net(2, milliseconds(100));
  ASSERT_TRUE(net.StartJoin(0).ok());
  ASSERT_TRUE(net.StartJoin(1).ok());
  net.Abort(1);
  std::vector<float> v(1);
  const auto st = net.Group(0, {Send(1, v)});
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.status().message().find("deadlock"), std::string::npos);
  EXPECT_EQ(net.Group(0, {}).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "the rank that gave up is aborted";
}

TEST(FakeNccl, DaemonCommJoinsWithoutBlockingAndPostsLikeRealComm) {
  auto net = std::make_shared<FakeNcclNet>(2, milliseconds(5000));
  auto comm = NewFakeDaemonComm(net, 1);
  EXPECT_TRUE(absl::IsUnavailable(comm->Poll())) << "joining";
  ASSERT_TRUE(net->Join(0).ok());
  ASSERT_TRUE(comm->Poll().ok());
  std::vector<float> d(1), t(1);
  auto trainer = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(milliseconds(50));
    return net->Group(0, {Send(1, t), Recv(1, t)});
  });
  // Post waits for the connection (RealComm's WaitIdle on ncclInProgress).
  auto m = comm->Post({Recv(0, d), Send(0, d)});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(trainer.get().ok());
  auto done = comm->Done(*m);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
}

}  // namespace
}  // namespace dmuon::transport::testing
