// The service's state without sockets: a rank leaving mid-step, a shrunk
// segment, GetState/SetState, --state-dir snapshots and restarts, idle-job
// retention and the reaper.

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
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

std::vector<std::vector<std::vector<float>>> StepsOfGradients(
    const std::vector<Param>& ps, int steps, std::mt19937_64& rng) {
  std::vector<std::vector<std::vector<float>>> g;
  for (int k = 0; k < steps; ++k) g.push_back(RandomGradients(ps, rng));
  return g;
}

// Sends the gradients of `ids` only (shm) at `step`.
absl::Status SendSome(OptimizerService& svc, Rank& r, int64_t step,
                      const std::vector<std::vector<float>>& grads,
                      const std::vector<int>& ids) {
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(step);
  for (int i : ids) {
    const auto& slot = r.open.layout().slots(i);
    std::memcpy(r.shm->bytes().data() + slot.gradient_offset(), grads[i].data(),
                slot.bytes());
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  return svc.OnStepRequest(r.open.session_id(), ready);
}

// Both ranks of a two-rank job run `grads[from-1..to-1]` (the same
// gradients on both: replicated parameters); returns rank 0's last updates.
std::vector<std::vector<float>> RunBoth(
    OptimizerService& svc, Rank& a, Rank& b, int from, int to,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> last;
  for (int s = from; s <= to; ++s) {
    EXPECT_TRUE(a.Send(svc, s, grads[s - 1]).ok()) << "step " << s;
    EXPECT_TRUE(b.Send(svc, s, grads[s - 1]).ok()) << "step " << s;
    auto msgs = a.sink->WaitStep(s);
    b.sink->WaitStep(s);
    EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
    last.clear();
    for (int i = 0; i < a.open.layout().slots_size(); ++i)
      last.push_back(a.Update(i, msgs));
  }
  return last;
}

const std::vector<Param> kTwo = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                 {"b", 40, 24, v1::SHARDING_REPLICATED}};

// Steps 1..`to` of job "ref" on a service of its own, uninterrupted.
std::vector<std::vector<float>> Uninterrupted(
    int to, const std::vector<std::vector<std::vector<float>>>& grads) {
  auto ref = NewService();
  Rank a, b;
  EXPECT_TRUE(a.Open(*ref, Request("ref", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  EXPECT_TRUE(b.Open(*ref, Request("ref", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  return RunBoth(*ref, a, b, 1, to, grads);
}

// Step `step` half done: parameter 0 stepped on both ranks (its momentum
// advanced), parameter 1 declared by rank `a` only.
void HalfStep(OptimizerService& svc, Rank& a, Rank& b, int step,
              const std::vector<std::vector<float>>& grads) {
  ASSERT_TRUE(SendSome(svc, a, step, grads, {0}).ok());
  ASSERT_TRUE(SendSome(svc, b, step, grads, {0}).ok());
  ASSERT_TRUE(a.sink->WaitUpdatesReady(step, 0));
  ASSERT_TRUE(SendSome(svc, a, step, grads, {1}).ok());
}

TEST(Service, RankLeavingMidStepRollsItsJobBackAndKeepsIt) {
  // A rank dies mid-step: the step is void for every rank, the job goes
  // back to its last completed step (parameter 0's momentum had advanced)
  // and is kept like an idle job; reopened, it continues bit for bit like
  // an uninterrupted run. Other jobs never notice.
  std::mt19937_64 rng(std::random_device{}());
  const auto grads = StepsOfGradients(kTwo, 3, rng);
  const auto straight = Uninterrupted(3, grads);

  auto svc = NewService();
  Rank a, b, other;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(
      other.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  RunBoth(*svc, a, b, 1, 1, grads);
  HalfStep(*svc, a, b, 2, grads[1]);
  svc->Detach(b.open.session_id(), absl::CancelledError("client died"));
  absl::Status st;
  ASSERT_TRUE(a.sink->WaitAbort(&st));
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted);
  for (const char* part :
       {"rank 1 of job 'j' left mid-step (client died)",
        "back at its last completed step 1", "continue from step 2"}) {
    EXPECT_NE(st.message().find(part), std::string::npos) << part << ": " << st;
  }
  // The segment of the dead rank is gone; every rank of the job is closed,
  // the job kept at step 1.
  EXPECT_EQ(transport::OpenShmRegion(b.open.shm_name(), 1).status().code(),
            absl::StatusCode::kNotFound);
  const v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.jobs_size(), 2);
  for (const auto& j : status.jobs()) {
    if (j.job_id() != "j") continue;
    EXPECT_EQ(j.completed_steps(), 1);
    EXPECT_EQ(j.ranks_open(), 0);
  }
  EXPECT_EQ(svc->open_sessions(), 1);  // "k"'s
  EXPECT_EQ(svc->OnStepRequest(a.open.session_id(), v1::StepRequest()).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(other.Send(*svc, 1, grads[0]).ok());
  auto msgs = other.sink->WaitStep(1);
  EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete());

  Rank a2, b2;
  ASSERT_TRUE(a2.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(b2.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  EXPECT_EQ(a2.open.next_step(), 2);
  EXPECT_EQ(b2.open.next_step(), 2);
  EXPECT_EQ(RunBoth(*svc, a2, b2, 2, 3, grads), straight);  // bit for bit
}

TEST(Service, DrainRefusesNewStepsAndTheFinalSnapshotHoldsTheLastComplete) {
  // While draining, a step nobody started is refused (UNAVAILABLE naming the
  // drain); the final snapshot takes a job stuck mid-step at its last
  // completed step (voiding that step on its streams), and a daemon
  // restarted on the directory continues it bit for bit.
  char tmpl[] = "/tmp/dmuon-drain-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;
  std::mt19937_64 rng(std::random_device{}());
  const auto grads = StepsOfGradients(kTwo, 3, rng);
  const auto straight = Uninterrupted(3, grads);
  {
    auto svc = NewService(o);
    Rank a, b, idle;
    ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
    ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
    ASSERT_TRUE(
        idle.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
    RunBoth(*svc, a, b, 1, 1, grads);
    ASSERT_TRUE(idle.Send(*svc, 1, grads[0]).ok());
    idle.sink->WaitStep(1);
    HalfStep(*svc, a, b, 2, grads[1]);  // rank 1 never sends parameter 1

    svc->Drain();
    const absl::Status refused = idle.Send(*svc, 2, grads[1]);
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
    EXPECT_NE(refused.message().find("draining"), std::string::npos) << refused;
    EXPECT_NE(refused.message().find("step 2 of job 'k' was not started"),
              std::string::npos)
        << refused;
    // A step in progress is not refused: rank 1 may still finish it.
    EXPECT_TRUE(svc->Busy());

    ASSERT_TRUE(svc->SnapshotAll().ok());
    absl::Status st;
    ASSERT_TRUE(a.sink->WaitAbort(&st));
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
    EXPECT_NE(st.message().find("step 2 of job 'j' was not complete"),
              std::string::npos)
        << st;
    EXPECT_FALSE(svc->Busy());
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank a, b, idle;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(
      idle.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  EXPECT_EQ(a.open.next_step(), 2);
  EXPECT_EQ(idle.open.next_step(), 2);
  EXPECT_EQ(RunBoth(*svc, a, b, 2, 3, grads), straight);  // bit for bit
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
  // rather than silently starting from zero, and the file moved aside (never
  // overwritten); the next reopen starts the job afresh.
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
  EXPECT_NE(
      refused.status().message().find("moved aside to " + file + ".corrupt-"),
      std::string::npos)
      << refused.status();
  EXPECT_NE(access(file.c_str(), F_OK), 0);
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

// Files of `dir` whose name contains `part`.
std::vector<std::string> FilesWith(const std::string& dir,
                                   const std::string& part) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(part) != std::string::npos) out.push_back(n);
  }
  return out;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Service, CorruptSnapshotsAreMovedAsideReportedAndTheJobStartsAfresh) {
  char tmpl[] = "/tmp/dmuon-corrupt-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ServiceOptions o;
  o.state_dir = dir;
  o.snapshot_every = 1;
  std::mt19937_64 rng(std::random_device{}());
  const auto grads = StepsOfGradients(kIdle, 2, rng);
  // Good snapshots of "good" and "later" at step 2.
  {
    auto svc = NewService(o);
    for (const char* id : {"good", "later"}) {
      Rank r;
      ASSERT_TRUE(
          r.Open(*svc, Request(id, 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
      RunSteps(*svc, r, 1, grads);
    }
  }
  SnapshotStore names(dir, nullptr);
  // Damaged: junk under "junk"'s name; crafted: a valid file of "good"
  // under "evil"'s name.
  { std::ofstream(names.PathOf("junk")) << "not a snapshot"; }
  const std::string crafted = ReadAll(names.PathOf("good"));
  { std::ofstream(names.PathOf("evil"), std::ios::binary) << crafted; }

  RecordingMetrics metrics;
  std::vector<std::string> logged;
  absl::Mutex log_mu;
  o.snapshot_failed = [&](const absl::Status& st) {
    absl::MutexLock l(&log_mu);
    logged.push_back(std::string(st.message()));
  };
  auto svc = NewService(o, 2, &metrics);
  const absl::Status scan = svc->LoadSnapshots();
  EXPECT_TRUE(absl::IsDataLoss(scan)) << scan;
  EXPECT_NE(scan.message().find("moved aside to"), std::string::npos) << scan;
  // Both moved aside, bytes intact; the good ones stay.
  const auto aside = FilesWith(dir, ".corrupt-");
  EXPECT_EQ(aside.size(), 2u);
  for (const auto& n : aside) {
    const std::string bytes = ReadAll(dir + "/" + n);
    EXPECT_TRUE(bytes == "not a snapshot" || bytes == crafted) << n;
  }
  EXPECT_EQ(FilesWith(dir, ".dmst").size(), 4u);  // 2 good + 2 moved aside
  EXPECT_EQ(metrics.snapshot_failures()["corrupt"], 2u);
  EXPECT_EQ(logged.size(), 2u);
  v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.snapshot_errors_size(), 2);
  for (const auto& e : status.snapshot_errors())
    EXPECT_NE(e.find(".corrupt-"), std::string::npos) << e;
  // "evil" starts afresh (its file was moved aside at start).
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("evil", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 1);
  }

  // Damaged after the start (found good then): the reopen fails, naming
  // where the file went; the next reopen starts afresh.
  {
    std::string bytes = ReadAll(names.PathOf("later"));
    bytes[bytes.size() / 2] ^= 0x5a;
    std::ofstream(names.PathOf("later"), std::ios::binary | std::ios::trunc)
        << bytes;
  }
  Rank r;
  const absl::Status refused =
      r.Open(*svc, Request("later", 0, 1, v1::TRANSPORT_SHM, kIdle));
  EXPECT_TRUE(absl::IsDataLoss(refused)) << refused;
  for (const char* part :
       {"checksum mismatch", "moved aside to", "zero momentum at step 1"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos)
        << part << ": " << refused;
  }
  EXPECT_FALSE(std::filesystem::exists(names.PathOf("later")));
  EXPECT_EQ(FilesWith(dir, ".corrupt-").size(), 3u);
  EXPECT_EQ(metrics.snapshot_failures()["corrupt"], 3u);
  EXPECT_EQ(svc->Status().snapshot_errors_size(), 3);
  ASSERT_TRUE(
      r.Open(*svc, Request("later", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
  // The good one still resumes.
  Rank g;
  ASSERT_TRUE(
      g.Open(*svc, Request("good", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(g.open.next_step(), 3);
}

TEST(Service, SnapshotWriteFailuresAreCountedReportedAndReturned) {
  char tmpl[] = "/tmp/dmuon-wfail-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ServiceOptions o;
  o.state_dir = dir;
  o.snapshot_every = 1;
  std::vector<std::string> logged;
  absl::Mutex log_mu;
  o.snapshot_failed = [&](const absl::Status& st) {
    absl::MutexLock l(&log_mu);
    logged.push_back(std::string(st.message()));
  };
  RecordingMetrics metrics;
  auto svc = NewService(o, 2, &metrics);
  // The temporary file's name is taken by a directory: every write fails.
  const std::string tmp = SnapshotStore(dir, nullptr).PathOf("w") + ".tmp";
  ASSERT_TRUE(std::filesystem::create_directory(tmp));
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("w", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  std::mt19937_64 rng(std::random_device{}());
  RunSteps(*svc, r, 1, StepsOfGradients(kIdle, 2, rng));  // steps still work
  EXPECT_EQ(metrics.snapshot_failures()["write"], 2u);
  const absl::Status final_snapshot = svc->SnapshotAll();
  EXPECT_TRUE(absl::IsUnavailable(final_snapshot)) << final_snapshot;
  EXPECT_NE(final_snapshot.message().find(tmp), std::string::npos)
      << final_snapshot;
  EXPECT_EQ(metrics.snapshot_failures()["write"], 3u);
  {
    absl::MutexLock l(&log_mu);
    EXPECT_EQ(logged.size(), 3u);
  }
  EXPECT_EQ(svc->Status().snapshot_errors_size(), 3);
  EXPECT_FALSE(
      std::filesystem::exists(SnapshotStore(dir, nullptr).PathOf("w")));
  // The disk recovers: the next write succeeds.
  std::filesystem::remove(tmp);
  ASSERT_TRUE(svc->SnapshotAll().ok());
  EXPECT_TRUE(std::filesystem::exists(SnapshotStore(dir, nullptr).PathOf("w")));
  EXPECT_FALSE(std::filesystem::exists(tmp));
}

}  // namespace
}  // namespace dmuon::server::testing
