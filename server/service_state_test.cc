// The service's state without sockets: a rank leaving mid-step (rollback),
// drain and the final snapshot, a shrunk segment, GetState/SetState,
// --state-dir snapshots and restarts, SetState rolling a snapshot back.

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

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cost_model.h"
#include "kernels/testing/oracle.h"
#include "planner/planner.h"
#include "server/service.h"
#include "server/snapshot_store.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

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
  const std::string tmpl = NewTempDir("drain");
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
  auto state = GetState(*svc1, r1.open.session_id());
  ASSERT_TRUE(state.ok()) << state.status();
  auto straight = run(*svc1, r1, 3, 4);

  auto svc2 = NewService();
  Rank r2;
  ASSERT_TRUE(r2.Open(*svc2, Request("j", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  (*state)[0].set_session_id(r2.open.session_id());
  auto set = SetState(*svc2, *state);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, 2);
  auto resumed = run(*svc2, r2, 3, 4);
  EXPECT_EQ(resumed, straight);  // bit for bit

  // A state whose table differs is refused, naming the parameter.
  auto other = *state;
  other[0].mutable_header()->mutable_parameters(1)->set_shape(0, 41);
  EXPECT_EQ(SetState(*svc2, other).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Service, SnapshotResumesAfterRestart) {
  const std::string tmpl = NewTempDir("state");
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
  const std::string tmpl = NewTempDir("race");
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

TEST(Service, SetStateRollsBackANewerSnapshotFile) {
  // A SetState is an explicit restore: an older checkpoint replaces the
  // newer snapshot file (kept aside as .rolled-back-*), and the automatic
  // snapshots continue from the restored step.
  const std::string tmpl = NewTempDir("rollback");
  ServiceOptions o;
  o.state_dir = tmpl;
  o.snapshot_every = 1;
  const std::vector<Param> ps = {{"w", 20, 30, v1::SHARDING_REPLICATED}};
  std::mt19937_64 rng(std::random_device{}());
  std::vector<v1::StateChunk> at2;
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Request("rb", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    for (int s = 1; s <= 4; ++s) {
      ASSERT_TRUE(r.Send(*svc, s, RandomGradients(ps, rng)).ok());
      r.sink->WaitStep(s);
      if (s == 2) {
        auto got = GetState(*svc, r.open.session_id());
        ASSERT_TRUE(got.ok()) << got.status();
        at2 = *got;
      }
    }
  }  // the file holds step 4
  const std::string dir = tmpl;
  auto files = [&dir](const std::string& part) {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (name.find(part) != std::string::npos) out.push_back(e.path());
    }
    return out;
  };
  auto steps_in = [](const std::string& path) -> int64_t {
    auto f = SnapshotStore::Read(path);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->head.header().completed_steps() : -1;
  };
  std::vector<std::string> snap;
  for (const std::string& f : files(".dmst"))
    if (absl::EndsWith(f, ".dmst")) snap.push_back(f);
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(steps_in(snap[0]), 4);
  // The step before it is kept (the previous snapshot)...
  ASSERT_EQ(files(".dmst.prev").size(), 1u);
  EXPECT_EQ(steps_in(files(".dmst.prev")[0]), 3);
  {
    // Another run of the job (a restarted daemon) resumes at step 4, and is
    // restored to step 2.
    auto svc = NewService(o);
    ASSERT_TRUE(svc->LoadSnapshots().ok());
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Request("rb", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    EXPECT_EQ(r.open.next_step(), 5);
    at2[0].set_session_id(r.open.session_id());
    auto set = SetState(*svc, at2);
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_EQ(*set, 2);
    EXPECT_EQ(steps_in(snap[0]), 2);
    const auto kept = files(".rolled-back-");
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_EQ(steps_in(kept[0]), 4);
    ASSERT_TRUE(r.Send(*svc, 3, RandomGradients(ps, rng)).ok());
    r.sink->WaitStep(3);
    EXPECT_EQ(steps_in(snap[0]), 3);
    // The same job restored again, to step 2: its own newer file (step 3)
    // goes back too.
    auto again = SetState(*svc, at2);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(steps_in(snap[0]), 2);
    EXPECT_EQ(files(".rolled-back-").size(), 2u);
    // ...and goes with a rollback: it was of the rolled-back run.
    EXPECT_TRUE(files(".dmst.prev").empty());
    EXPECT_EQ(svc->Status().snapshot_errors_size(), 0);
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("rb", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  EXPECT_EQ(r.open.next_step(), 3);
}

// Idle jobs (ServiceOptions::job_retention_seconds): the reaper is driven
// with the test's clock, never started.

}  // namespace
}  // namespace dmuon::server::testing
