// The scheduler's sharing rule (scheduler.h) with fake work of known cost:
// an executor that sleeps in proportion to each task's predicted cost, so
// the scheduler's own accounting of busy time per job (JobStats) is the
// measure. Shares are read over windows of whole batches, while every job
// is backlogged; nothing here asserts a duration.

#include "server/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace dmuon::server {
namespace {

// One predicted cost unit sleeps this long: coarse against sleep overshoot
// on a loaded machine, which would otherwise favour the cheaper job.
constexpr auto kUnit = std::chrono::microseconds(1000);

// Sleeps kUnit per cost unit (a task's rows) and records the (job, forward
// order) of each batch's tasks.
class SleepExecutor : public Executor {
 public:
  std::string device() const override { return "fake:0"; }
  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    int64_t units = 0;
    std::vector<StateKey> keys;
    for (const ComputeTask& t : batch) {
      units += t.shape.rows;
      keys.push_back(t.state);
    }
    {
      absl::MutexLock lock(&mu_);
      batches_.push_back(keys);
    }
    std::this_thread::sleep_for(kUnit * units);
    return absl::OkStatus();
  }
  std::vector<std::vector<StateKey>> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::vector<StateKey>> batches_ ABSL_GUARDED_BY(mu_);
};

const MuonParams kMuon{};

// A matrix of job `job` costing `cost` units (its shape's rows: matrices of
// one cost batch together). `on_finish` runs on the worker, after Finish.
class FakeWork : public Work {
 public:
  FakeWork(uint64_t job, double weight, int cost, int order,
           std::function<void()> on_prepare = nullptr,
           std::function<void()> on_finish = nullptr)
      : job_(job),
        weight_(weight),
        cost_(cost),
        order_(order),
        on_prepare_(std::move(on_prepare)),
        on_finish_(std::move(on_finish)) {}
  int32_t forward_order() const override { return order_; }
  kernels::Shape shape() const override { return {cost_, 8}; }
  const MuonParams* muon() const override { return &kMuon; }
  double flops() const override { return cost_; }
  uint64_t job_serial() const override { return job_; }
  double weight() const override { return weight_; }
  absl::StatusOr<ComputeTask> Prepare() override {
    if (on_prepare_) on_prepare_();
    ComputeTask t;
    t.shape = shape();
    t.muon = muon();
    t.state = {job_, order_};
    return t;
  }
  void Finish(absl::Status status) override {
    if (on_finish_) on_finish_();
  }

 private:
  const uint64_t job_;
  const double weight_;
  const int cost_;
  const int order_;
  std::function<void()> on_prepare_;
  std::function<void()> on_finish_;
};

std::map<uint64_t, JobShareStats> ByJob(const Scheduler& s) {
  std::map<uint64_t, JobShareStats> out;
  for (const JobShareStats& j : s.JobStats(0)) out[j.job] = j;
  return out;
}

struct Job {
  uint64_t id;
  double weight;
  int cost;
  int matrices;
};

// Runs jobs `a` and `b` (all queued at once, max_batch 1) and returns a's
// share of the busy time both had between a's finished matrices `from` and
// `to` (snapshots taken in a's Finish, so both miss exactly a's batch in
// flight: the window is whole batches). Both must still be backlogged at
// `to`.
double ShareOfA(const Job& a, const Job& b, int from, int to) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<SleepExecutor>());
  Scheduler s(std::move(ex), 1);
  std::map<uint64_t, JobShareStats> at_from, at_to;
  std::atomic<int> done_a{0};
  std::vector<std::pair<int, std::shared_ptr<Work>>> works;
  for (int i = 0; i < std::max(a.matrices, b.matrices); ++i) {
    if (i < a.matrices) {
      works.emplace_back(0, std::make_shared<FakeWork>(a.id, a.weight, a.cost,
                                                       i, nullptr, [&] {
                                                         const int n = ++done_a;
                                                         if (n == from)
                                                           at_from = ByJob(s);
                                                         if (n == to)
                                                           at_to = ByJob(s);
                                                       }));
    }
    if (i < b.matrices) {
      works.emplace_back(0,
                         std::make_shared<FakeWork>(b.id, b.weight, b.cost, i));
    }
  }
  s.SubmitAll(std::move(works));
  s.Shutdown();
  EXPECT_LT(at_to[b.id].matrices, static_cast<uint64_t>(b.matrices))
      << "b was not backlogged through the window";
  const double busy_a = at_to[a.id].busy_seconds - at_from[a.id].busy_seconds;
  const double busy_b = at_to[b.id].busy_seconds - at_from[b.id].busy_seconds;
  return busy_a / (busy_a + busy_b);
}

TEST(FairShare, EqualWeightsShareTimeNotMatrices) {
  // a's matrices cost a third of b's: a runs three per b's one.
  const double share = ShareOfA({1, 1, 2, 80}, {2, 1, 6, 40}, 15, 75);
  EXPECT_GE(share, 0.45);
  EXPECT_LE(share, 0.55);
}

TEST(FairShare, WeightsThreeToOne) {
  const double share = ShareOfA({1, 3, 2, 120}, {2, 1, 2, 60}, 15, 105);
  EXPECT_GE(share, 0.70);
  EXPECT_LE(share, 0.80);
}

// The bound of scheduler.h: a small job (4 matrices, one batch) arriving
// beside a backlogged job 100x its size starts right after the big job's
// batch in flight; a step of two batches costing no more than that batch
// (start-time fair queuing) still waits only it; a step costing more than
// it waits one more batch of the big job at most.
void SmallBesideBig(int small_matrices, uint64_t max_big_batches) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<SleepExecutor>());
  Scheduler s(std::move(ex), 4);
  constexpr uint64_t kBig = 1, kSmall = 2;
  // The big job's first batch waits in Prepare until the small job is
  // queued: the small one arrives while a big batch is in flight.
  absl::Notification big_running, small_queued;
  std::vector<std::pair<int, std::shared_ptr<Work>>> big;
  // 40 matrices of 10 units, batches of 4: 400 units (the small job: 4).
  for (int i = 0; i < 40; ++i) {
    big.emplace_back(0, std::make_shared<FakeWork>(kBig, 1, 10, i, [&] {
                       if (big_running.HasBeenNotified()) return;
                       big_running.Notify();
                       small_queued.WaitForNotification();
                     }));
  }
  s.SubmitAll(std::move(big));
  big_running.WaitForNotification();
  // Batches the big job has started (charged at the pick) when the small
  // one arrives, and when the small one's last batch starts.
  const uint64_t at_submit = ByJob(s)[kBig].batches;
  std::atomic<uint64_t> at_last_start{0};
  std::atomic<int> prepared{0};
  std::vector<std::pair<int, std::shared_ptr<Work>>> small;
  for (int i = 0; i < small_matrices; ++i) {
    small.emplace_back(0, std::make_shared<FakeWork>(kSmall, 1, 1, i, [&] {
                         if (++prepared == small_matrices)
                           at_last_start = ByJob(s)[kBig].batches;
                       }));
  }
  s.SubmitAll(std::move(small));
  small_queued.Notify();
  s.Shutdown();
  EXPECT_EQ(prepared.load(), small_matrices);
  EXPECT_LE(at_last_start.load() - at_submit, max_big_batches);
  EXPECT_LT(at_last_start.load(), 10u) << "the big job had drained";
  EXPECT_EQ(ByJob(s)[kBig].cost, 400);
  EXPECT_EQ(ByJob(s)[kSmall].cost, small_matrices);
}

TEST(FairShare, SmallJobWaitsOnlyTheBatchInFlight) { SmallBesideBig(4, 0); }

TEST(FairShare, SmallJobOfTwoBatchesWaitsOnlyTheBatchInFlight) {
  SmallBesideBig(8, 0);
}

TEST(FairShare, SmallJobCostingMoreThanABatchWaitsOneMoreBatch) {
  SmallBesideBig(48, 1);  // 48 units beside big batches of 40
}

// Returns at once: the served predicted cost (JobShareStats::cost) is the
// clock, so shares do not depend on how busy the machine is.
class InstantExecutor : public Executor {
 public:
  std::string device() const override { return "fake:0"; }
  absl::Status Compute(absl::Span<const ComputeTask>) override {
    return absl::OkStatus();
  }
};

// A FakeWork of a principal with a share cap (Work::max_share).
class CappedWork : public FakeWork {
 public:
  CappedWork(uint64_t job, std::string principal, double weight, double cap,
             int order, std::function<void()> on_finish = nullptr)
      : FakeWork(job, weight, 2, order, nullptr, std::move(on_finish)),
        principal_(std::move(principal)),
        cap_(cap) {}
  std::string principal() const override { return principal_; }
  double max_share() const override { return cap_; }

 private:
  const std::string principal_;
  const double cap_;
};

// Principal "a" (jobs 1 and 2, weights 2 and 1: 3/4 by weight) capped at
// `cap`, beside principal "b" (job 3, weight 1), all backlogged on one
// executor: a's jobs' share of the cost served between a's 30th and 120th
// finished matrices (b still backlogged).
double CappedShareOfA(double cap) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<InstantExecutor>());
  Scheduler s(std::move(ex), 1);
  std::map<uint64_t, JobShareStats> at_from, at_to;
  std::atomic<int> done_a{0};
  auto mark = [&] {
    const int n = ++done_a;
    if (n == 30) at_from = ByJob(s);
    if (n == 120) at_to = ByJob(s);
  };
  std::vector<std::pair<int, std::shared_ptr<Work>>> works;
  for (int i = 0; i < 400; ++i) {
    works.emplace_back(0,
                       std::make_shared<CappedWork>(1, "a", 2, cap, i, mark));
    works.emplace_back(0,
                       std::make_shared<CappedWork>(2, "a", 1, cap, i, mark));
    works.emplace_back(0, std::make_shared<CappedWork>(3, "b", 1, 1, i));
  }
  s.SubmitAll(std::move(works));
  s.Shutdown();
  EXPECT_LT(at_to[3].matrices, 400u) << "b was not backlogged";
  auto served = [&](uint64_t job) {
    return at_to[job].cost - at_from[job].cost;
  };
  EXPECT_NEAR(served(1) / served(2), 2, 0.1) << "a's jobs keep their 2:1";
  return (served(1) + served(2)) / (served(1) + served(2) + served(3));
}

TEST(FairShare, PrincipalCapHoldsUnderContention) {
  const double share = CappedShareOfA(0.25);
  EXPECT_GE(share, 0.24);
  EXPECT_LE(share, 0.26);
}

TEST(FairShare, PrincipalCapThatDoesNotBindLeavesTheWeights) {
  const double share = CappedShareOfA(0.9);
  EXPECT_GE(share, 0.74);
  EXPECT_LE(share, 0.76);
}

// Job 2 hands its matrices in one at a time, each while its previous one is
// being computed (an overlapped trainer, or ranks finishing at different
// times), beside job 1 backlogged with all of its: at equal weights each
// still gets half of the cost served. (The defect this guards: a job
// becoming backlogged again started before its own charge, won every pick
// and starved job 1.)
TEST(FairShare, AJobTricklingItsMatricesInKeepsItsShare) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<InstantExecutor>());
  Scheduler s(std::move(ex), 1);
  std::map<uint64_t, JobShareStats> at_from, at_to;
  std::atomic<int> done_a{0};
  std::function<void(int)> trickle = [&](int i) {
    if (i >= 600) return;
    // Submitted from the previous matrix's Prepare: while it runs, with
    // job 2's queue empty.
    s.Submit(0, std::make_shared<FakeWork>(2, 1, 2, i,
                                           [&trickle, i] { trickle(i + 1); }));
  };
  std::vector<std::pair<int, std::shared_ptr<Work>>> works;
  for (int i = 0; i < 300; ++i) {
    works.emplace_back(0, std::make_shared<FakeWork>(1, 1, 2, i, nullptr, [&] {
                         const int n = ++done_a;
                         if (n == 50) at_from = ByJob(s);
                         if (n == 200) at_to = ByJob(s);
                       }));
  }
  s.SubmitAll(std::move(works));
  trickle(0);
  while (done_a.load() < 300) std::this_thread::sleep_for(kUnit);
  s.Shutdown();
  ASSERT_LT(at_to[2].matrices, 600u) << "job 2 stopped trickling";
  const double a = at_to[1].cost - at_from[1].cost;
  const double b = at_to[2].cost - at_from[2].cost;
  EXPECT_NEAR(a / (a + b), 0.5, 0.05) << a << " vs " << b;
}

TEST(FairShare, BatchesNeverMixJobsAndKeepForwardOrder) {
  auto owned = std::make_unique<SleepExecutor>();
  SleepExecutor* executor = owned.get();
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::move(owned));
  Scheduler s(std::move(ex), 8);
  std::vector<std::pair<int, std::shared_ptr<Work>>> works;
  // Same shape in both jobs; orders descending so arrival is not order.
  for (int i = 5; i >= 0; --i) {
    works.emplace_back(0, std::make_shared<FakeWork>(1, 1, 1, i));
    works.emplace_back(0, std::make_shared<FakeWork>(2, 1, 1, i));
  }
  s.SubmitAll(std::move(works));
  s.Shutdown();
  int seen = 0;
  std::map<uint64_t, int32_t> last;  // by job: the last order run
  for (const auto& batch : executor->batches()) {
    seen += static_cast<int>(batch.size());
    for (const StateKey& k : batch) {
      EXPECT_EQ(k.job, batch.front().job);
      if (last.count(k.job)) {
        EXPECT_GT(k.param, last[k.job]);
      }
      last[k.job] = k.param;
    }
  }
  EXPECT_EQ(seen, 12);
  EXPECT_EQ(ByJob(s)[1].matrices, 6u);
  EXPECT_EQ(ByJob(s)[2].matrices, 6u);
}

TEST(FairShare, DroppedJobLeavesTheAccounting) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<SleepExecutor>());
  Scheduler s(std::move(ex), 1);
  s.Submit(0, std::make_shared<FakeWork>(7, 1, 1, 0));
  s.Shutdown();
  ASSERT_EQ(ByJob(s).count(7), 1u);
  s.DropJob(7);
  EXPECT_EQ(ByJob(s).count(7), 0u);
}

}  // namespace
}  // namespace dmuon::server
