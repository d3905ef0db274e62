// The nccl transport's logic on the CPU: ranks, transfers, the order rule,
// the abort policy, and the worker driving a fake communicator.

#include "transport/nccl.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <set>

namespace dmuon::transport {
namespace {

TEST(Nccl, DaemonIsTheLastRank) {
  const NcclRanks r = NcclRanksFor(3);
  EXPECT_EQ(r.nranks, 4);
  EXPECT_EQ(r.daemon_rank, 3);
}

TEST(Nccl, TransfersFollowTheLayoutInParameterOrder) {
  auto layout = ComputeLayout({{4, 8, 4}, {2, 8, 4}, {3, 3, 4}});
  ASSERT_TRUE(layout.ok());
  const auto recv = GradientReceives(*layout, 1, {2, 0});
  ASSERT_EQ(recv.size(), 2u);
  EXPECT_FALSE(recv[0].send);
  EXPECT_EQ(recv[0].peer, 1);
  EXPECT_EQ(recv[0].offset, layout->slots[2].gradient_offset);
  EXPECT_EQ(recv[0].bytes, 36u);
  EXPECT_EQ(recv[1].offset, layout->slots[0].gradient_offset);
  const auto send = UpdateSends(*layout, 0, {1});
  ASSERT_EQ(send.size(), 1u);
  EXPECT_TRUE(send[0].send);
  EXPECT_EQ(send[0].offset, layout->slots[1].update_offset);
  EXPECT_EQ(send[0].bytes, 64u);
}

TEST(Nccl, UpdatesWaitForEveryGradientOfTheirStep) {
  ExchangeOrder o(3);
  EXPECT_TRUE(o.GradientsPosted(1, 1).empty());
  EXPECT_FALSE(o.MayPush(1, 10));  // 1 of 3 gradients posted
  EXPECT_TRUE(o.GradientsPosted(1, 1).empty());
  EXPECT_FALSE(o.MayPush(1, 11));
  EXPECT_EQ(o.GradientsPosted(1, 1), (std::vector<uint64_t>{10, 11}));
  EXPECT_TRUE(o.MayPush(1, 12));
  // The next step starts over.
  EXPECT_TRUE(o.GradientsPosted(2, 2).empty());
  EXPECT_FALSE(o.MayPush(2, 20));
  EXPECT_EQ(o.GradientsPosted(2, 1), (std::vector<uint64_t>{20}));
}

TEST(Nccl, PolicyNamesWhatTimedOut) {
  NcclPolicy p;
  p.init_timeout_seconds = 10;
  p.transfer_timeout_seconds = 5;
  NcclHealth h;
  h.since_start_seconds = 9;
  EXPECT_TRUE(JudgeNccl(p, h).ok());
  h.since_start_seconds = 11;
  EXPECT_EQ(JudgeNccl(p, h).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(JudgeNccl(p, h).message().find("joined"), std::string::npos);
  h.initialized = true;
  EXPECT_TRUE(JudgeNccl(p, h).ok());
  h.oldest_pending_seconds = 6;
  EXPECT_NE(JudgeNccl(p, h).message().find("waited 6 s"), std::string::npos);
  h.async_error = absl::InternalError("remote process exited");
  EXPECT_EQ(JudgeNccl(p, h).code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(JudgeNccl(p, h).message().find("remote process exited"),
            std::string::npos);
}

// What a fake communicator did; outlives the worker that owns the fake.
struct FakeState {
  std::mutex mu;
  std::vector<std::vector<NcclTransfer>> posted;
  std::set<std::thread::id> threads;
  std::atomic<uint64_t> complete_upto{0};
  std::atomic<int> aborts{0};
  std::atomic<int> closes{0};
  std::string error;  // set before the worker starts
  size_t posted_count() {
    std::lock_guard<std::mutex> lock(mu);
    return posted.size();
  }
  size_t thread_count() {
    std::lock_guard<std::mutex> lock(mu);
    return threads.size();
  }
};

// Initializes after `init_polls` polls; groups complete when the test says.
class FakeComm : public NcclComm {
 public:
  FakeComm(std::shared_ptr<FakeState> s, int init_polls)
      : s_(std::move(s)), init_polls_(init_polls) {}
  absl::Status Poll() override {
    Touch();
    if (!s_->error.empty()) return absl::InternalError(s_->error);
    if (polls_++ < init_polls_) return absl::UnavailableError("joining");
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Post(const std::vector<NcclTransfer>& t) override {
    Touch();
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->posted.push_back(t);
    return s_->posted.size();
  }
  absl::StatusOr<bool> Done(uint64_t marker) override {
    Touch();
    return marker <= s_->complete_upto.load();
  }
  void Abort() override {
    Touch();
    s_->aborts++;
  }
  void Close() override {
    Touch();
    s_->closes++;
  }

 private:
  void Touch() {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->threads.insert(std::this_thread::get_id());
  }
  std::shared_ptr<FakeState> s_;
  const int init_polls_;
  int polls_ = 0;
};

// A callback that records its statuses, in order.
struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  std::function<void(absl::Status)> At(std::string what) {
    return [this, what](absl::Status st) {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(
          what +
          (st.ok() ? ""
                   : ":" + std::string(absl::StatusCodeToString(st.code()))));
    };
  }
  bool WaitFor(size_t n) {
    for (int i = 0; i < 2000; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (events.size() >= n) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
  std::vector<std::string> Get() {
    std::lock_guard<std::mutex> lock(mu);
    return events;
  }
};

TEST(NcclWorker, PostsInOrderOnceJoinedAndReportsCompletions) {
  auto c = std::make_shared<FakeState>();
  Log log;
  {
    NcclWorker w(NcclPolicy{});
    const int id = w.Add(std::make_unique<FakeComm>(c, 3));
    w.Submit(id, {{false, 0, 0, 8}}, log.At("posted a"), log.At("done a"));
    w.Submit(id, {{true, 0, 64, 8}, {true, 0, 128, 8}}, log.At("posted b"),
             log.At("done b"));
    ASSERT_TRUE(log.WaitFor(2));
    EXPECT_EQ(log.Get(), (std::vector<std::string>{"posted a", "posted b"}));
    c->complete_upto = 1;
    ASSERT_TRUE(log.WaitFor(3));
    c->complete_upto = 2;
    ASSERT_TRUE(log.WaitFor(4));
    EXPECT_EQ(log.Get()[2], "done a");
    EXPECT_EQ(log.Get()[3], "done b");
    EXPECT_TRUE(w.status(id).ok());
  }
  ASSERT_EQ(c->posted_count(), 2u);
  EXPECT_EQ(c->posted[1].size(), 2u);
  EXPECT_EQ(c->aborts, 0);
  EXPECT_EQ(c->closes, 1) << "closed when the worker ends";
  EXPECT_EQ(c->thread_count(), 1u) << "every call from the worker's one thread";
}

TEST(NcclWorker, AsyncErrorAbortsAndFailsEverything) {
  auto c = std::make_shared<FakeState>();
  Log log;
  NcclWorker w(NcclPolicy{});
  const int id = w.Add(std::make_unique<FakeComm>(c, 0));
  w.Submit(id, {{false, 0, 0, 8}}, nullptr, log.At("done"));
  for (int i = 0; i < 200 && c->posted_count() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  w.Abort(id, absl::UnavailableError("rank 0 of job 'j' left"));
  ASSERT_TRUE(log.WaitFor(1));
  EXPECT_EQ(log.Get()[0], "done:UNAVAILABLE");
  w.Submit(id, {{false, 0, 0, 8}}, log.At("late posted"), log.At("late done"));
  ASSERT_TRUE(log.WaitFor(3));
  EXPECT_EQ(log.Get()[1], "late posted:UNAVAILABLE");
  EXPECT_EQ(c->aborts, 1);
  EXPECT_NE(w.status(id).message().find("left"), std::string::npos);
}

TEST(NcclWorker, StuckTransferTimesOut) {
  auto c = std::make_shared<FakeState>();
  NcclPolicy p;
  p.transfer_timeout_seconds = 0.05;
  Log log;
  NcclWorker w(p);
  const int id = w.Add(std::make_unique<FakeComm>(c, 0));
  w.Submit(id, {{true, 1, 0, 8}}, log.At("posted"), log.At("done"));
  ASSERT_TRUE(log.WaitFor(2));
  EXPECT_EQ(log.Get()[1], "done:DEADLINE_EXCEEDED");
  EXPECT_EQ(c->aborts, 1);
  EXPECT_EQ(c->thread_count(), 1u);
}

TEST(NcclWorker, RanksThatNeverJoinTimeOut) {
  NcclPolicy p;
  p.init_timeout_seconds = 0.05;
  Log log;
  NcclWorker w(p);
  const int id =
      w.Add(std::make_unique<FakeComm>(std::make_shared<FakeState>(), 1 << 30));
  w.Submit(id, {{false, 0, 0, 8}}, log.At("posted"), nullptr);
  ASSERT_TRUE(log.WaitFor(1));
  EXPECT_EQ(log.Get()[0], "posted:DEADLINE_EXCEEDED");
}

TEST(NcclWorker, CommunicatorErrorIsReported) {
  auto c = std::make_shared<FakeState>();
  c->error = "NCCL WARN remote process exited";
  Log log;
  NcclWorker w(NcclPolicy{});
  const int id = w.Add(std::make_unique<FakeComm>(c, 0));
  w.Submit(id, {}, log.At("posted"), nullptr);
  ASSERT_TRUE(log.WaitFor(1));
  EXPECT_EQ(log.Get()[0], "posted:UNAVAILABLE");
  EXPECT_NE(w.status(id).message().find("remote process exited"),
            std::string::npos);
}

TEST(NcclWorker, ClosingWithPendingTransfersCancelsThem) {
  Log log;
  auto c = std::make_shared<FakeState>();
  {
    NcclWorker w(NcclPolicy{});
    const int id = w.Add(std::make_unique<FakeComm>(c, 0));
    w.Submit(id, {{false, 0, 0, 8}}, log.At("posted"), log.At("done"));
    ASSERT_TRUE(log.WaitFor(1));
  }
  ASSERT_TRUE(log.WaitFor(2));
  EXPECT_EQ(log.Get()[1], "done:CANCELLED");
  EXPECT_EQ(c->aborts, 1);
}

TEST(NcclWorker, OneThreadServesEveryCommunicatorOfTheDevice) {
  auto a = std::make_shared<FakeState>(), b = std::make_shared<FakeState>();
  Log log;
  NcclWorker w(NcclPolicy{});
  const int ia = w.Add(std::make_unique<FakeComm>(a, 0));
  const int ib = w.Add(std::make_unique<FakeComm>(b, 0));
  w.Submit(ia, {{false, 0, 0, 8}}, log.At("a posted"), log.At("a done"));
  w.Submit(ib, {{false, 1, 0, 8}}, log.At("b posted"), log.At("b done"));
  ASSERT_TRUE(log.WaitFor(2));
  // Job a ends: its pending group fails, job b goes on.
  w.AbortAndWait(ia, absl::CancelledError("rank 0 of job a closed"));
  EXPECT_EQ(log.Get().back(), "a done:CANCELLED");
  EXPECT_EQ(w.status(ia).code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(w.status(ib).ok());
  b->complete_upto = 1;
  ASSERT_TRUE(log.WaitFor(4));
  EXPECT_EQ(log.Get().back(), "b done");
  w.Remove(ia);
  for (int i = 0; i < 200 && w.status(ia).code() != absl::StatusCode::kNotFound;
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(w.status(ia).code(), absl::StatusCode::kNotFound);
  w.Submit(ia, {}, log.At("late"), nullptr);
  ASSERT_TRUE(log.WaitFor(5));
  EXPECT_EQ(log.Get().back(), "late:FAILED_PRECONDITION");
  std::set<std::thread::id> threads;
  {
    std::lock_guard<std::mutex> la(a->mu), lb(b->mu);
    threads.insert(a->threads.begin(), a->threads.end());
    threads.insert(b->threads.begin(), b->threads.end());
  }
  EXPECT_EQ(threads.size(), 1u);
}

}  // namespace
}  // namespace dmuon::transport
