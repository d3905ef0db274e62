// The service's state without sockets: a rank leaving mid-step, a shrunk
// segment, GetState/SetState, --state-dir snapshots and restarts, idle-job
// retention and the reaper.

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cost_model.h"
#include "kernels/testing/oracle.h"
#include "planner/planner.h"
#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

TEST(Service, RankLeavingMidStepAbortsItsJobOnly) {
  auto svc = NewService();
  const std::vector<Param> ps = {{"w", 8, 8, v1::SHARDING_UNREDUCED}};
  Rank a, b, other;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(other.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(a.Send(*svc, 1, {std::vector<float>(64, 1.0f)}).ok());
  svc->Detach(b.open.session_id(), absl::CancelledError("client died"));
  absl::Status st;
  ASSERT_TRUE(a.sink->WaitAbort(&st));
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted);
  EXPECT_NE(st.message().find("rank 1 of job 'j' left mid-step"),
            std::string::npos)
      << st;
  // The segment of the dead rank is gone; the other job keeps stepping.
  EXPECT_EQ(transport::OpenShmRegion(b.open.shm_name(), 1).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(other.Send(*svc, 1, {std::vector<float>(64, 2.0f)}).ok());
  auto msgs = other.sink->WaitStep(1);
  EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
}

TEST(Service, ShrunkSegmentIsDataLoss) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM,
                                   {{"w", 32, 32, v1::SHARDING_REPLICATED}}))
                  .ok());
  // The client shrinks its segment (through its own descriptor).
  int fd = -1;
  for (int cand = 3; cand < 1024; ++cand) {
    char path[64], link[256] = {0};
    snprintf(path, sizeof(path), "/proc/self/fd/%d", cand);
    if (readlink(path, link, sizeof(link) - 1) > 0 &&
        std::string(link).find(r.open.shm_name().substr(1)) !=
            std::string::npos) {
      fd = cand;
    }
  }
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);
  v1::StepRequest m;
  m.mutable_gradients_ready()->set_step(1);
  m.mutable_gradients_ready()->add_param_ids(0);
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), m).code(),
            absl::StatusCode::kDataLoss);
}

TEST(Service, StateRoundTripContinuesLikeUninterrupted) {
  const std::vector<Param> ps = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                 {"b", 40, 24, v1::SHARDING_REPLICATED}};
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  std::vector<std::vector<std::vector<float>>> grads(4);
  for (auto& step : grads) {
    for (const auto& p : ps) {
      step.emplace_back(p.rows * p.cols);
      for (float& x : step.back()) x = d(rng);
    }
  }
  auto run = [&](OptimizerService& svc, Rank& r, int from, int to) {
    std::vector<std::vector<float>> last;
    for (int s = from; s <= to; ++s) {
      EXPECT_TRUE(r.Send(svc, s, grads[s - 1]).ok());
      auto msgs = r.sink->WaitStep(s);
      last = {r.Update(0, msgs), r.Update(1, msgs)};
    }
    return last;
  };
  auto svc1 = NewService();
  Rank r1;
  ASSERT_TRUE(
      r1.Open(*svc1, Request("j", 0, 1, v1::TRANSPORT_INLINE, ps)).ok());
  run(*svc1, r1, 1, 2);
  auto state = svc1->GetState(r1.open.session_id());
  ASSERT_TRUE(state.ok()) << state.status();
  auto straight = run(*svc1, r1, 3, 4);

  auto svc2 = NewService();
  Rank r2;
  ASSERT_TRUE(r2.Open(*svc2, Request("j", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  (*state)[0].set_session_id(r2.open.session_id());
  auto set = svc2->SetState(*state);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, 2);
  auto resumed = run(*svc2, r2, 3, 4);
  EXPECT_EQ(resumed, straight);  // bit for bit

  // A state whose table differs is refused, naming the parameter.
  auto other = *state;
  other[0].mutable_header()->mutable_parameters(1)->set_shape(0, 41);
  EXPECT_EQ(svc2->SetState(other).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Service, SnapshotResumesAfterRestart) {
  char tmpl[] = "/tmp/dmuon-state-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;
  o.snapshot_every = 1;
  const std::vector<Param> ps = {{"w", 20, 30, v1::SHARDING_REPLICATED}};
  std::vector<std::vector<float>> g(3, std::vector<float>(600));
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (auto& v : g)
    for (float& x : v) x = d(rng);
  std::vector<float> straight;
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    for (int s = 1; s <= 2; ++s) {
      ASSERT_TRUE(r.Send(*svc, s, {g[s - 1]}).ok());
      r.sink->WaitStep(s);
    }
  }  // the daemon goes away after step 2 (snapshot written at each step)
  {
    auto ref = NewService();
    Rank r;
    ASSERT_TRUE(r.Open(*ref, Request("x", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    for (int s = 1; s <= 3; ++s) {
      ASSERT_TRUE(r.Send(*ref, s, {g[s - 1]}).ok());
      auto msgs = r.sink->WaitStep(s);
      straight = r.Update(0, msgs);
    }
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  EXPECT_EQ(r.open.next_step(), 3);
  ASSERT_TRUE(r.Send(*svc, 3, {g[2]}).ok());
  auto msgs = r.sink->WaitStep(3);
  EXPECT_EQ(r.Update(0, msgs), straight);
}

TEST(Service, RacingSnapshotsEndWithTheNewestState) {
  // --snapshot-every writes (on the step's thread) race whole-daemon
  // snapshots (shutdown, here a thread calling SnapshotAll without pause):
  // every write must succeed and the file must end with the last step.
  char tmpl[] = "/tmp/dmuon-race-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;
  o.snapshot_every = 1;
  const std::vector<Param> ps = {{"w", 48, 64, v1::SHARDING_REPLICATED}};
  std::mt19937_64 rng(std::random_device{}());
  constexpr int kSteps = 30;
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("race", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0}, writes{0};
    std::thread spammer([&] {
      while (!stop) {
        if (!svc->SnapshotAll().ok()) failures++;
        writes++;
      }
    });
    for (int s = 1; s <= kSteps; ++s) {
      ASSERT_TRUE(r.Send(*svc, s, RandomGradients(ps, rng)).ok());
      r.sink->WaitStep(s);
    }
    stop = true;
    spammer.join();
    EXPECT_EQ(failures.load(), 0) << "of " << writes.load();
    EXPECT_EQ(svc->Status().errors_size(), 0);
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("race", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  EXPECT_EQ(r.open.next_step(), kSteps + 1);
}

// Idle jobs (ServiceOptions::job_retention_seconds): the reaper is driven
// with the test's clock, never started.
using Clock = std::chrono::steady_clock;

// Runs steps `from`..`from + grads.size() - 1` of a one-rank job and returns
// the last step's update of each parameter.
std::vector<std::vector<float>> RunSteps(
    OptimizerService& svc, Rank& r, int64_t from,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> last;
  for (size_t k = 0; k < grads.size(); ++k) {
    const int64_t step = from + static_cast<int64_t>(k);
    EXPECT_TRUE(r.Send(svc, step, grads[k]).ok()) << "step " << step;
    auto msgs = r.sink->WaitStep(step);
    EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete())
        << "step " << step;
    last.clear();
    for (int i = 0; i < r.open.layout().slots_size(); ++i)
      last.push_back(r.Update(i, msgs));
  }
  return last;
}

// Feeds `grads` (by step, by parameter) to one fp64 reference per parameter
// and returns the last step's updates.
std::vector<std::vector<double>> ReferenceSteps(
    std::vector<Reference>& ref, const std::vector<Param>& ps,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<double>> want(ps.size());
  for (const auto& step : grads) {
    for (size_t i = 0; i < ps.size(); ++i) {
      want[i] = ref[i].Step(std::vector<double>(step[i].begin(), step[i].end()),
                            {ps[i].rows, ps[i].cols});
    }
  }
  return want;
}

std::vector<std::vector<std::vector<float>>> StepsOfGradients(
    const std::vector<Param>& ps, int steps, std::mt19937_64& rng) {
  std::vector<std::vector<std::vector<float>>> g;
  for (int k = 0; k < steps; ++k) g.push_back(RandomGradients(ps, rng));
  return g;
}

const std::vector<Param> kIdle = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                  {"b", 40, 24, v1::SHARDING_REPLICATED}};

TEST(Service, IdleJobResumesBeforeItsRetentionAndIsDroppedAfter) {
  RecordingMetrics metrics;
  ServiceOptions o;
  o.job_retention_seconds = 600;
  auto svc = NewService(o, 2, &metrics);
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 4, rng);
  std::vector<Reference> ref(kIdle.size());
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
    RunSteps(*svc, r, 1, {g[0], g[1]});
    ReferenceSteps(ref, kIdle, {g[0], g[1]});
    EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0) << "a rank is open";
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  const Clock::time_point closed = Clock::now();
  v1::StatusResponse st = svc->Status();
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).ranks_open(), 0);
  EXPECT_GT(st.jobs(0).drop_in_seconds(), 590);
  EXPECT_LE(st.jobs(0).drop_in_seconds(), 600);

  // Before the deadline: kept, and the next drop time is reported.
  ReapResult reap = svc->ReapIdleJobs(closed + std::chrono::seconds(599));
  EXPECT_TRUE(reap.dropped.empty());
  EXPECT_TRUE(reap.failed.empty());
  EXPECT_GT(reap.next, closed + std::chrono::seconds(599));
  EXPECT_LE(reap.next, Clock::now() + std::chrono::seconds(600));
  ASSERT_EQ(svc->Status().jobs_size(), 1);

  // Reopened: the daemon-held momentum continues (step 3 after 1 and 2).
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 3);
    const auto got = RunSteps(*svc, r, 3, {g[2]});
    const auto want = ReferenceSteps(ref, kIdle, {g[2]});
    for (size_t i = 0; i < kIdle.size(); ++i)
      EXPECT_LT(RelErr(got[i], want[i]), 1e-4) << kIdle[i].name;
    // Open again: never dropped, however late.
    EXPECT_TRUE(svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24))
                    .dropped.empty());
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }

  // After the deadline: gone from Status and /metrics.
  reap = svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(601));
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_EQ(reap.dropped[0].first, "j");
  EXPECT_FALSE(reap.dropped[0].second) << "no --state-dir: no snapshot";
  EXPECT_EQ(reap.next, Clock::time_point::max());
  st = svc->Status();
  EXPECT_EQ(st.jobs_size(), 0);
  EXPECT_EQ(metrics.jobs(), 0);
  EXPECT_TRUE(
      svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24)).dropped.empty());

  // Reopened after the drop, without --state-dir: zero momentum, step 1.
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
  const auto got = RunSteps(*svc, r, 1, {g[3]});
  std::vector<Reference> fresh(kIdle.size());
  const auto want = ReferenceSteps(fresh, kIdle, {g[3]});
  for (size_t i = 0; i < kIdle.size(); ++i)
    EXPECT_LT(RelErr(got[i], want[i]), 1e-4) << kIdle[i].name;
}

TEST(Service, RetentionZeroDropsWhenTheLastRankCloses) {
  ServiceOptions o;
  o.job_retention_seconds = 0;
  auto svc = NewService(o);
  std::mt19937_64 rng(std::random_device{}());
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  const auto g = RandomGradients(kIdle, rng);
  ASSERT_TRUE(a.Send(*svc, 1, g).ok());
  ASSERT_TRUE(b.Send(*svc, 1, g).ok());
  a.sink->WaitStep(1);
  b.sink->WaitStep(1);
  ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
  // One rank still open: kept.
  EXPECT_TRUE(svc->ReapIdleJobs(Clock::now()).dropped.empty());
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0) << "due now";
  const ReapResult reap = svc->ReapIdleJobs(Clock::now());
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_EQ(svc->Status().jobs_size(), 0);
}

TEST(Service, ReattachingOneRankCancelsTheDrop) {
  ServiceOptions o;
  o.job_retention_seconds = 600;
  auto svc = NewService(o);
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 2, rng);
  std::vector<Reference> ref(kIdle.size());
  ReferenceSteps(ref, kIdle, {g[0]});
  {
    Rank a, b;
    ASSERT_TRUE(
        a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
    ASSERT_TRUE(
        b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
    ASSERT_TRUE(a.Send(*svc, 1, g[0]).ok());
    ASSERT_TRUE(b.Send(*svc, 1, g[0]).ok());
    a.sink->WaitStep(1);
    b.sink->WaitStep(1);
    ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
    // The stream of the last rank ends between steps (not a clean close):
    // the job is idle all the same, not broken.
    EXPECT_TRUE(svc->Detach(b.open.session_id(),
                            absl::CancelledError("trainer restarted")));
  }
  // Rank 0 is back: the drop is off, even long after its time.
  Rank a;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0);
  EXPECT_TRUE(
      svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24)).dropped.empty());
  Rank b;
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(b.open.next_step(), 2);
  ASSERT_TRUE(a.Send(*svc, 2, g[1]).ok());
  ASSERT_TRUE(b.Send(*svc, 2, g[1]).ok());
  const auto msgs = a.sink->WaitStep(2);
  b.sink->WaitStep(2);
  const auto want = ReferenceSteps(ref, kIdle, {g[1]});
  for (size_t i = 0; i < kIdle.size(); ++i)
    EXPECT_LT(RelErr(a.Update(i, msgs), want[i]), 1e-4) << kIdle[i].name;
  // Closing again restarts the whole retention from this close.
  const Clock::time_point before = Clock::now();
  ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  EXPECT_TRUE(
      svc->ReapIdleJobs(before + std::chrono::seconds(599)).dropped.empty());
  EXPECT_EQ(svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(600))
                .dropped.size(),
            1u);
}

TEST(Service, DroppedJobWithStateDirResumesBitExactlyFromItsSnapshot) {
  char tmpl[] = "/tmp/dmuon-idle-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;  // snapshot_every 0: only the drop writes one
  o.job_retention_seconds = 30;
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 4, rng);
  // The same steps without interruption, on a daemon that keeps the job.
  std::vector<std::vector<float>> straight;
  {
    auto ref = NewService();
    Rank r;
    ASSERT_TRUE(
        r.Open(*ref, Request("x", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    straight = RunSteps(*ref, r, 1, g);
  }
  auto svc = NewService(o);
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    RunSteps(*svc, r, 1, {g[0], g[1]});
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  const std::string file = std::string(tmpl) + "/job-736e6170.dmst";
  EXPECT_NE(access(file.c_str(), F_OK), 0) << "nothing written before";
  const ReapResult reap =
      svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(31));
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_TRUE(reap.dropped[0].second) << "snapshotted";
  EXPECT_TRUE(reap.failed.empty());
  EXPECT_EQ(access(file.c_str(), F_OK), 0);
  EXPECT_EQ(svc->Status().jobs_size(), 0);
  // A shutdown snapshot now leaves the dropped job's file alone.
  ASSERT_TRUE(svc->SnapshotAll().ok());

  // Reopened (over another transport): step 3 from the snapshot, then 4.
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 3);
    EXPECT_EQ(RunSteps(*svc, r, 3, {g[2], g[3]}), straight);  // bit for bit
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }

  // Dropped again (step 4 saved), and the file damaged: a reopen is refused
  // rather than silently starting from zero; once the file is removed, the
  // job starts afresh.
  ASSERT_EQ(
      svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(31)).dropped.size(),
      1u);
  {
    FILE* f = fopen(file.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    fseek(f, 40, SEEK_SET);
    fputc(0x5a, f);
    fclose(f);
  }
  auto refused =
      svc->OpenSession(Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("remove " + file),
            std::string::npos)
      << refused.status();
  ASSERT_EQ(unlink(file.c_str()), 0);
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
}

TEST(Service, ReaperThreadDropsIdleJobsByItself) {
  ServiceOptions o;
  o.job_retention_seconds = 0;
  // Outlive the service: its reaper thread reports into them.
  absl::Mutex mu;
  std::vector<std::string> reported;  // guarded by mu
  auto svc = NewService(o);
  svc->StartReaper([&](const ReapResult& r) {
    absl::MutexLock lock(&mu);
    for (const auto& [job, snapshotted] : r.dropped) reported.push_back(job);
  });
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  std::mt19937_64 rng(std::random_device{}());
  RunSteps(*svc, r, 1, {RandomGradients(kIdle, rng)});
  EXPECT_EQ(svc->Status().jobs_size(), 1) << "open: kept";
  ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  // The report comes after the drop.
  auto reported_one = [&] { return !reported.empty(); };  // under mu
  absl::MutexLock lock(&mu);
  mu.AwaitWithTimeout(absl::Condition(&reported_one), absl::Seconds(10));
  EXPECT_EQ(svc->Status().jobs_size(), 0);
  EXPECT_EQ(reported, std::vector<std::string>{"j"});
}

}  // namespace
}  // namespace dmuon::server::testing
