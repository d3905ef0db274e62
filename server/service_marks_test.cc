// Mark (protocol minor 5; docs/protocol.md "Marks") without sockets: a mark
// holds the momentum of the job's step (checked against an fp64 reference
// of the momentum, and bit for bit against GetState at that step), a wrong
// step or a step computed past is refused naming the job's step, a second
// Mark of a step replaces the first (a resumed run's new momentum), and
// marks are dropped by count and by --mark-bytes.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "base/protocol.h"
#include "server/service.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kTable = {{"a", 24, 40, v1::SHARDING_ROWS},
                                   {"b", 40, 24, v1::SHARDING_REPLICATED}};
// One mark of the table: its fp32 momentum.
constexpr uint64_t kMarkBytes = (24 * 40 + 40 * 24) * 4u;
using Grads = std::vector<std::vector<std::vector<float>>>;
using Momentum = std::vector<std::vector<float>>;

v1::OpenSessionRequest Req(const std::string& job, int rank, int world,
                           v1::Resume resume = v1::RESUME_FRESH,
                           int64_t resume_step = 0) {
  auto r = Request(job, rank, world, v1::TRANSPORT_SHM, kTable);
  r.set_resume(resume);
  r.set_resume_step(resume_step);
  r.set_protocol_minor(ProtocolMinor());
  return r;
}

// Steps from..to of `ranks` (a job of ranks.size() ranks), each rank
// sending its view of the same whole gradients.
void RunSteps(OptimizerService& svc, std::vector<Rank>& ranks, int from, int to,
              const Grads& grads) {
  const int world = static_cast<int>(ranks.size());
  for (int s = from; s <= to; ++s) {
    for (int r = 0; r < world; ++r) {
      std::vector<std::vector<float>> views;
      for (size_t i = 0; i < kTable.size(); ++i)
        views.push_back(RankView(kTable[i], r, world, grads[s - 1][i]));
      ASSERT_TRUE(ranks[r].Send(svc, s, views).ok()) << s;
    }
    for (Rank& r : ranks) {
      auto msgs = r.sink->WaitStep(s);
      ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
    }
  }
}

// The job's momentum as GetState streams it.
Momentum Read(OptimizerService& svc, const std::string& session) {
  auto chunks = GetState(svc, session);
  EXPECT_TRUE(chunks.ok()) << chunks.status();
  Momentum out(kTable.size());
  if (!chunks.ok()) return out;
  for (const auto& c : *chunks) {
    if (!c.has_momentum()) continue;
    auto& m = out[c.momentum().param_id()];
    m.resize(c.momentum().total_bytes() / 4);
    std::memcpy(reinterpret_cast<char*>(m.data()) + c.momentum().offset(),
                c.momentum().data().data(), c.momentum().data().size());
  }
  return out;
}

// fp64 momentum after steps 1..to (beta 0.95, the harness's Reference).
std::vector<std::vector<double>> ReferenceMomentum(const Grads& grads, int to) {
  std::vector<std::vector<double>> m(kTable.size());
  for (int s = 0; s < to; ++s) {
    for (size_t i = 0; i < kTable.size(); ++i) {
      m[i].resize(grads[s][i].size(), 0.0);
      for (size_t k = 0; k < m[i].size(); ++k)
        m[i][k] = 0.95 * m[i][k] + 0.05 * grads[s][i][k];
    }
  }
  return m;
}

v1::MarkRequest MarkReq(const Rank& r, int64_t step = 0) {
  v1::MarkRequest req;
  req.set_session_id(r.open.session_id());
  req.set_step(step);
  return req;
}

void ExpectHas(const absl::Status& st, absl::StatusCode code,
               const std::vector<std::string>& parts) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << p << ": " << st;
}

// Service options with a fresh --state-dir under /tmp (removed by the
// test at its end).
ServiceOptions WithStateDir() {
  std::string dir = NewTempDir("marks");
  ServiceOptions o;
  o.state_dir = dir;
  return o;
}

TEST(Marks, HoldTheJobsMomentumAndRefuseAnotherStep) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 4, rng);
  auto svc = NewService();
  std::vector<Rank> ranks(2);
  for (int r = 0; r < 2; ++r)
    ASSERT_TRUE(ranks[r].Open(*svc, Req("j", r, 2)).ok());
  // Nothing completed: nothing to mark.
  ExpectHas(svc->Mark(MarkReq(ranks[0])).status(),
            absl::StatusCode::kFailedPrecondition, {"job 'j'", "no step"});
  RunSteps(*svc, ranks, 1, 3, grads);
  auto m = svc->Mark(MarkReq(ranks[1]));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step(), 3);
  EXPECT_EQ(std::vector<int64_t>(m->marks().begin(), m->marks().end()),
            std::vector<int64_t>{3});
  EXPECT_EQ(m->mark_bytes(), kMarkBytes);
  EXPECT_EQ(m->not_durable(), "");
  // Another rank marking the same step: marked again, the same answer
  // (the momentum has not changed).
  auto again = svc->Mark(MarkReq(ranks[0], 3));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), m->SerializeAsString());
  // Another step than the job's: refused, naming the job's.
  ExpectHas(svc->Mark(MarkReq(ranks[0], 2)).status(),
            absl::StatusCode::kFailedPrecondition,
            {"Mark of step 2", "job 'j' is at completed step 3"});
  ExpectHas(svc->Mark(MarkReq(ranks[0], -1)).status(),
            absl::StatusCode::kInvalidArgument, {"MarkRequest.step is -1"});
  // Step 4 under way (every rank handed in its gradients): refused.
  const Momentum at3 = Read(*svc, ranks[0].open.session_id());
  const auto want = ReferenceMomentum(grads, 3);
  for (size_t i = 0; i < kTable.size(); ++i)
    EXPECT_LT(RelErr(at3[i], want[i]), 1e-6) << kTable[i].name;
  RunSteps(*svc, ranks, 4, 4, grads);
  ExpectHas(svc->Mark(MarkReq(ranks[0], 3)).status(),
            absl::StatusCode::kFailedPrecondition,
            {"Mark of step 3", "at completed step 4"});
  auto m4 = svc->Mark(MarkReq(ranks[0]));
  ASSERT_TRUE(m4.ok()) << m4.status();
  EXPECT_EQ(std::vector<int64_t>(m4->marks().begin(), m4->marks().end()),
            (std::vector<int64_t>{3, 4}));
  // Status lists them.
  const v1::StatusResponse status = svc->Status();
  for (const auto& j : status.jobs()) {
    if (j.job_id() != "j") continue;
    EXPECT_EQ(std::vector<int64_t>(j.marks().begin(), j.marks().end()),
              (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(j.mark_bytes(), 2 * m->mark_bytes());
  }
  EXPECT_FALSE(svc->Mark(MarkReq(Rank{})).ok());  // no such session
}

TEST(Marks, AreDroppedByCountAndByBytes) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 5, rng);
  const uint64_t one = kMarkBytes;
  ServiceOptions o;
  o.marks_per_job = 3;
  o.mark_bytes = 4 * one + one / 2;  // four marks fit
  auto svc = NewService(o);
  std::vector<Rank> a(1), b(1);
  ASSERT_TRUE(a[0].Open(*svc, Req("a", 0, 1)).ok());
  ASSERT_TRUE(b[0].Open(*svc, Req("b", 0, 1)).ok());
  for (int s = 1; s <= 4; ++s) {
    RunSteps(*svc, a, s, s, grads);
    ASSERT_TRUE(svc->Mark(MarkReq(a[0])).ok()) << s;
  }
  // Count: a keeps its 3 newest.
  auto la = svc->Mark(MarkReq(a[0]));
  ASSERT_TRUE(la.ok());
  EXPECT_EQ(std::vector<int64_t>(la->marks().begin(), la->marks().end()),
            (std::vector<int64_t>{2, 3, 4}));
  // Bytes: b's two marks push out a's oldest ones, daemon-wide.
  for (int s = 1; s <= 2; ++s) {
    RunSteps(*svc, b, s, s, grads);
    ASSERT_TRUE(svc->Mark(MarkReq(b[0])).ok()) << s;
  }
  la = svc->Mark(MarkReq(a[0]));
  ASSERT_TRUE(la.ok());
  EXPECT_EQ(std::vector<int64_t>(la->marks().begin(), la->marks().end()),
            (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(la->mark_bytes(), 2 * one);
  // A budget smaller than one mark: RESOURCE_EXHAUSTED naming the flag.
  ServiceOptions tiny;
  tiny.mark_bytes = one - 1;
  auto small = NewService(tiny);
  std::vector<Rank> c(1);
  ASSERT_TRUE(c[0].Open(*small, Req("c", 0, 1)).ok());
  RunSteps(*small, c, 1, 1, grads);
  ExpectHas(small->Mark(MarkReq(c[0])).status(),
            absl::StatusCode::kResourceExhausted,
            {"--mark-bytes=", std::to_string(one) + " bytes"});
}

// Opens ranks 0..world-1 of job `id` resumed at `step` (0: its own).
absl::Status OpenAll(OptimizerService& svc, std::vector<Rank>& ranks,
                     const std::string& id, int world, int64_t step,
                     v1::Resume resume = v1::RESUME_CONTINUE) {
  ranks = std::vector<Rank>(world);
  for (int r = 0; r < world; ++r) {
    if (auto st = ranks[r].Open(svc, Req(id, r, world, resume, step));
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

void CloseAll(OptimizerService& svc, std::vector<Rank>& ranks) {
  for (Rank& r : ranks) ASSERT_TRUE(svc.CloseSession(r.open.session_id()).ok());
}

// Every parameter's momentum against the fp64 reference after `to` steps.
void ExpectReference(const Momentum& got, const Grads& grads, int to) {
  const auto want = ReferenceMomentum(grads, to);
  for (size_t i = 0; i < kTable.size(); ++i)
    EXPECT_LT(RelErr(got[i], want[i]), 1e-6) << kTable[i].name << " @" << to;
}

// Job `id` started by 2 ranks, stepped to `mark` and marked there.
void OpenStepAndMark(OptimizerService& svc, std::vector<Rank>& ranks,
                     const std::string& id, int mark, const Grads& grads) {
  ASSERT_TRUE(OpenAll(svc, ranks, id, 2, 0, v1::RESUME_FRESH).ok());
  RunSteps(svc, ranks, 1, mark, grads);
  auto m = svc.Mark(MarkReq(ranks[0]));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->not_durable(), "");
}

// Two ranks mark step 3 and go on to 5; the job is then resumed at the
// mark with 1 rank and, again, with 4: each time its momentum is the
// mark's bit for bit and its steps continue from 4 as an uninterrupted run
// of the same gradients would (the fp64 reference).
TEST(Marks, ResumeAtAMarkAtAnyWorldSizeContinuesFromIt) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 6, rng);
  auto svc = NewService();
  std::vector<Rank> ranks;
  OpenStepAndMark(*svc, ranks, "j", 3, grads);
  const Momentum at3 = Read(*svc, ranks[0].open.session_id());
  RunSteps(*svc, ranks, 4, 5, grads);
  // While a rank is open: refused, naming it.
  std::vector<Rank> early(1);
  ExpectHas(early[0].Open(*svc, Req("j", 0, 1, v1::RESUME_CONTINUE, 3)),
            absl::StatusCode::kFailedPrecondition,
            {"job 'j'", "mark of step 3", "ranks 0,1", "open"});
  CloseAll(*svc, ranks);
  for (int world : {1, 4}) {
    ASSERT_TRUE(OpenAll(*svc, ranks, "j", world, 3).ok()) << world;
    for (Rank& r : ranks) EXPECT_EQ(r.open.next_step(), 4) << world;
    EXPECT_EQ(Read(*svc, ranks[0].open.session_id()), at3) << world;
    RunSteps(*svc, ranks, 4, 6, grads);
    ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 6);
    const v1::StatusResponse status = svc->Status();
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_EQ(status.jobs(0).world_size(), world);
    EXPECT_EQ(status.jobs(0).completed_steps(), 6);
    CloseAll(*svc, ranks);
  }
}

// Reopened idle at another world size without a step: the job continues
// from its own step, its momentum unchanged; a table whose matrices differ
// is refused naming the parameter, and a step held nowhere names every
// step held.
TEST(Marks, AnIdleJobReopensAtAnotherWorldSizeWithItsTable) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 4, rng);
  auto svc = NewService();
  std::vector<Rank> ranks;
  OpenStepAndMark(*svc, ranks, "j", 2, grads);
  RunSteps(*svc, ranks, 3, 3, grads);
  const Momentum at3 = Read(*svc, ranks[0].open.session_id());
  CloseAll(*svc, ranks);
  std::vector<Rank> bad(1);
  auto changed = Req("j", 0, 3, v1::RESUME_CONTINUE);
  changed.mutable_parameters(1)->set_name("c");
  ExpectHas(bad[0].Open(*svc, changed), absl::StatusCode::kInvalidArgument,
            {"job 'j' parameter 1 is 'b'", "this table says 'c'"});
  ExpectHas(
      bad[0].Open(*svc, Req("j", 0, 3, v1::RESUME_CONTINUE, 1)),
      absl::StatusCode::kFailedPrecondition,
      {"cannot resume at completed step 1", "step 3", "marks of steps 2"});
  ASSERT_TRUE(OpenAll(*svc, ranks, "j", 3, 0).ok());
  EXPECT_EQ(ranks[2].open.next_step(), 4);
  EXPECT_EQ(Read(*svc, ranks[1].open.session_id()), at3);
  RunSteps(*svc, ranks, 4, 4, grads);
  ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 4);
}

// A job dropped idle without --state-dir keeps its marks: Status lists it
// with them, and it resumes at one (a new job then, whose bytes count
// against --max-state-bytes like any new job's).
TEST(Marks, AJobHeldOnlyAsMarksResumesAtOne) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 4, rng);
  ServiceOptions o;
  o.job_retention_seconds = 0;
  o.max_state_bytes = kMarkBytes;  // one job
  auto svc = NewService(o);
  std::vector<Rank> ranks;
  OpenStepAndMark(*svc, ranks, "m", 2, grads);
  const Momentum at2 = Read(*svc, ranks[0].open.session_id());
  CloseAll(*svc, ranks);
  const auto later = std::chrono::steady_clock::now() + std::chrono::hours(1);
  ASSERT_EQ(svc->ReapIdleJobs(later).dropped.size(), 1u);
  v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).job_id(), "m");
  EXPECT_EQ(status.jobs(0).marks_size(), 1);
  // Another job takes the daemon's state budget: the resume is refused as
  // a new job would be, naming the flag.
  std::vector<Rank> other(1);
  ASSERT_TRUE(other[0].Open(*svc, Req("other", 0, 1)).ok());
  ExpectHas(OpenAll(*svc, ranks, "m", 1, 2),
            absl::StatusCode::kResourceExhausted, {"--max-state-bytes"});
  ASSERT_TRUE(svc->CloseSession(other[0].open.session_id()).ok());
  ASSERT_EQ(svc->ReapIdleJobs(later).dropped.size(), 1u);
  ASSERT_TRUE(OpenAll(*svc, ranks, "m", 1, 2).ok());
  EXPECT_EQ(ranks[0].open.next_step(), 3);
  EXPECT_EQ(Read(*svc, ranks[0].open.session_id()), at2);
  RunSteps(*svc, ranks, 3, 4, grads);
  ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 4);
}

// With --state-dir a mark is a file: a daemon started again on the
// directory lists it (its job only on disk); the job reopens at its
// snapshot's step with 3 ranks instead of 2, then at the mark with 1; a
// new run of the id (resume=replace) removes the mark.
TEST(Marks, SurviveARestartAsFiles) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 5, rng);
  ServiceOptions o = WithStateDir();
  const std::string dir = o.state_dir;
  Momentum at2, at4;
  {
    auto svc = NewService(o);
    std::vector<Rank> ranks;
    OpenStepAndMark(*svc, ranks, "d", 2, grads);
    at2 = Read(*svc, ranks[0].open.session_id());
    RunSteps(*svc, ranks, 3, 4, grads);
    at4 = Read(*svc, ranks[0].open.session_id());
    ASSERT_TRUE(svc->SnapshotAll().ok());  // step 4 on disk too
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_TRUE(status.jobs(0).on_disk());
  EXPECT_EQ(status.jobs(0).completed_steps(), 4);
  EXPECT_EQ(std::vector<int64_t>(status.jobs(0).marks().begin(),
                                 status.jobs(0).marks().end()),
            std::vector<int64_t>{2});
  EXPECT_EQ(status.jobs(0).mark_bytes(), 0u);  // on disk until resumed
  // Its snapshot's own step, at another world size (3 ranks, not 2).
  std::vector<Rank> ranks;
  ASSERT_TRUE(OpenAll(*svc, ranks, "d", 3, 0).ok());
  EXPECT_EQ(ranks[2].open.next_step(), 5);
  EXPECT_EQ(Read(*svc, ranks[1].open.session_id()), at4);
  CloseAll(*svc, ranks);
  // Then (idle in memory now) at the mark with 1 rank: the step-4
  // snapshot of the run it leaves is kept aside, not resumed again.
  ASSERT_TRUE(OpenAll(*svc, ranks, "d", 1, 2).ok());
  EXPECT_EQ(ranks[0].open.next_step(), 3);
  EXPECT_EQ(Read(*svc, ranks[0].open.session_id()), at2);
  RunSteps(*svc, ranks, 3, 5, grads);
  ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 5);
  CloseAll(*svc, ranks);
  const std::string file = dir + "/job-64.dmst.mark-2";
  EXPECT_TRUE(std::filesystem::exists(file));
  bool kept_aside = false;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    kept_aside |=
        e.path().filename().string().rfind("job-64.dmst.replaced-", 0) == 0;
  EXPECT_TRUE(kept_aside);
  // A new run of the id drops the old run's marks, files and all.
  ASSERT_TRUE(OpenAll(*svc, ranks, "d2", 1, 0, v1::RESUME_FRESH).ok());
  std::vector<Rank> fresh(1);
  auto req = Req("d", 0, 1, v1::RESUME_REPLACE);
  ASSERT_TRUE(fresh[0].Open(*svc, req).ok());
  EXPECT_FALSE(std::filesystem::exists(file));
  std::filesystem::remove_all(dir);
}

// A trainer resumed at mark 2 takes other gradients for steps 3-4 and
// marks 4 again: the mark of 4 is the new run's (the old run's would pair
// the new checkpoint of step 4 with momentum it never had), in memory and
// in its file. A restart lists the marks by step (the lowest the oldest),
// whatever the directory's order, and drops the lowest past the count.
TEST(Marks, AStepMarkedAgainHoldsTheNewRunAndARestartKeepsStepOrder) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads first = StepsOfGradients(kTable, 6, rng);
  Grads second = StepsOfGradients(kTable, 6, rng);
  second[0] = first[0];  // the same steps 1-2: the resumed run's past
  second[1] = first[1];
  ServiceOptions o = WithStateDir();
  const std::string dir = o.state_dir;
  o.marks_per_job = 3;
  {
    auto svc = NewService(o);
    std::vector<Rank> ranks;
    OpenStepAndMark(*svc, ranks, "r", 2, first);
    RunSteps(*svc, ranks, 3, 4, first);
    ASSERT_TRUE(svc->Mark(MarkReq(ranks[0])).ok());
    CloseAll(*svc, ranks);
    ASSERT_TRUE(OpenAll(*svc, ranks, "r", 1, 2).ok());
    RunSteps(*svc, ranks, 3, 4, second);
    auto m = svc->Mark(MarkReq(ranks[0]));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(std::vector<int64_t>(m->marks().begin(), m->marks().end()),
              (std::vector<int64_t>{2, 4}));
    RunSteps(*svc, ranks, 5, 6, second);
    ASSERT_TRUE(svc->Mark(MarkReq(ranks[0])).ok());
    CloseAll(*svc, ranks);
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  const v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(std::vector<int64_t>(status.jobs(0).marks().begin(),
                                 status.jobs(0).marks().end()),
            (std::vector<int64_t>{2, 4, 6}));
  std::vector<Rank> ranks;
  ASSERT_TRUE(OpenAll(*svc, ranks, "r", 2, 4).ok());
  ExpectReference(Read(*svc, ranks[0].open.session_id()), second, 4);
  RunSteps(*svc, ranks, 5, 5, second);
  auto m = svc->Mark(MarkReq(ranks[0]));
  ASSERT_TRUE(m.ok()) << m.status();
  // Past the count of 3: the lowest step (2) goes, not the file found first.
  EXPECT_EQ(std::vector<int64_t>(m->marks().begin(), m->marks().end()),
            (std::vector<int64_t>{4, 6, 5}));
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-72.dmst.mark-2"));
  CloseAll(*svc, ranks);
  std::filesystem::remove_all(dir);
}

// A job rebuilt at another world size, from itself (idle in memory) or from
// a mark (the job dropped), keeps its principal's weight and device-share
// cap: a restart must not lift a cap (docs/design.md, the principal cap).
TEST(Marks, ARebuiltJobKeepsItsPrincipalsWeightAndCap) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 3, rng);
  Principal alice;
  alice.name = "alice";
  alice.weight = 2;
  alice.quotas.max_device_share = 0.3;
  ServiceOptions o;
  o.job_retention_seconds = 0;  // dropped as soon as its last rank closes
  for (bool from_mark : {false, true}) {
    auto svc = NewService(from_mark ? o : ServiceOptions{});
    std::vector<Rank> ranks(2);
    for (int r = 0; r < 2; ++r)
      ASSERT_TRUE(ranks[r].Open(*svc, Req("w", r, 2), alice).ok());
    RunSteps(*svc, ranks, 1, 2, grads);
    ASSERT_TRUE(svc->Mark(MarkReq(ranks[0]), alice).ok());
    CloseAll(*svc, ranks);
    if (from_mark) svc->ReapIdleJobs(std::chrono::steady_clock::now());
    // Dropped, the job is listed from its marks alone (world size 0).
    const v1::StatusResponse before = svc->Status();
    ASSERT_EQ(before.jobs_size(), 1);
    EXPECT_EQ(before.jobs(0).world_size(), from_mark ? 0 : 2) << from_mark;
    std::vector<Rank> one(1);
    ASSERT_TRUE(
        one[0].Open(*svc, Req("w", 0, 1, v1::RESUME_CONTINUE, 2), alice).ok())
        << from_mark;
    const v1::StatusResponse status = svc->Status();
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_EQ(status.jobs(0).world_size(), 1);
    EXPECT_EQ(status.jobs(0).weight(), 2) << from_mark;
    EXPECT_EQ(status.jobs(0).max_device_share(), 0.3) << from_mark;
    CloseAll(*svc, one);
  }
}

// Run A marks 4; the trainer goes back to mark 2 (run B, other gradients)
// and B reaches step 4 unmarked, then stops. The trainer's checkpoint of
// step 4 is A's: resume_step=4 gets A's mark, not the job's own step 4 of
// run B (in memory, and in its snapshot after a restart).
TEST(Marks, AMarkOfTheJobsOwnStepWinsOverAnotherRunsState) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads a = StepsOfGradients(kTable, 5, rng);
  Grads b = StepsOfGradients(kTable, 5, rng);
  b[0] = a[0];
  b[1] = a[1];
  ServiceOptions o = WithStateDir();
  const std::string dir = o.state_dir;
  {
    auto svc = NewService(o);
    std::vector<Rank> ranks;
    OpenStepAndMark(*svc, ranks, "o", 2, a);
    RunSteps(*svc, ranks, 3, 4, a);
    ASSERT_TRUE(svc->Mark(MarkReq(ranks[0])).ok());
    CloseAll(*svc, ranks);
    ASSERT_TRUE(OpenAll(*svc, ranks, "o", 2, 2).ok());
    RunSteps(*svc, ranks, 3, 4, b);  // run B at step 4, unmarked
    CloseAll(*svc, ranks);
    // In memory: the job is at 4 (run B); resume_step=4 is A's mark.
    ASSERT_TRUE(OpenAll(*svc, ranks, "o", 1, 4).ok());
    ExpectReference(Read(*svc, ranks[0].open.session_id()), a, 4);
    RunSteps(*svc, ranks, 5, 5, a);
    ExpectReference(Read(*svc, ranks[0].open.session_id()), a, 5);
    CloseAll(*svc, ranks);
    // Run B again to step 4, then snapshotted: on disk at 4 (B's).
    ASSERT_TRUE(OpenAll(*svc, ranks, "o", 2, 2).ok());
    RunSteps(*svc, ranks, 3, 4, b);
    CloseAll(*svc, ranks);
    ASSERT_TRUE(svc->SnapshotAll().ok());
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  std::vector<Rank> ranks;
  ASSERT_TRUE(OpenAll(*svc, ranks, "o", 2, 4).ok());
  ExpectReference(Read(*svc, ranks[1].open.session_id()), a, 4);
  CloseAll(*svc, ranks);
  // Without a step, the job continues from the state it holds (at 4).
  ASSERT_TRUE(OpenAll(*svc, ranks, "o", 1, 0).ok());
  EXPECT_EQ(ranks[0].open.next_step(), 5);
  std::filesystem::remove_all(dir);
}

// A job held only as marks stays its owner's: another principal's new run
// of the id (which would drop them) is PERMISSION_DENIED, the marks kept.
TEST(Marks, AnotherPrincipalCannotDropAJobsMarksByANewRun) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 2, rng);
  Principal alice, bob;
  alice.name = "alice";
  bob.name = "bob";
  ServiceOptions o;
  o.job_retention_seconds = 0;
  auto svc = NewService(o);
  std::vector<Rank> ranks(1);
  ASSERT_TRUE(ranks[0].Open(*svc, Req("m", 0, 1), alice).ok());
  RunSteps(*svc, ranks, 1, 2, grads);
  ASSERT_TRUE(svc->Mark(MarkReq(ranks[0]), alice).ok());
  CloseAll(*svc, ranks);
  svc->ReapIdleJobs(std::chrono::steady_clock::now());
  for (v1::Resume resume : {v1::RESUME_FRESH, v1::RESUME_REPLACE}) {
    std::vector<Rank> other(1);
    EXPECT_EQ(other[0].Open(*svc, Req("m", 0, 1, resume), bob).code(),
              absl::StatusCode::kPermissionDenied);
  }
  ASSERT_TRUE(
      ranks[0].Open(*svc, Req("m", 0, 1, v1::RESUME_CONTINUE, 2), alice).ok());
  ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 2);
  CloseAll(*svc, ranks);
}

// A mark file damaged on disk after a restart (its CRC fails): resuming
// at it is DATA_LOSS naming where the file was moved, and the mark is no
// longer listed, so the next open names the steps still held instead of
// failing on the same file again.
TEST(Marks, AnUnreadableMarkFileIsMovedAsideAndDropped) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 3, rng);
  ServiceOptions o = WithStateDir();
  const std::string dir = o.state_dir;
  {
    auto svc = NewService(o);
    std::vector<Rank> ranks;
    OpenStepAndMark(*svc, ranks, "c", 2, grads);
    RunSteps(*svc, ranks, 3, 3, grads);
    CloseAll(*svc, ranks);
    ASSERT_TRUE(svc->SnapshotAll().ok());
  }
  const std::string file = dir + "/job-63.dmst.mark-2";
  ASSERT_TRUE(std::filesystem::exists(file));
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-8, std::ios::end);
    f.write("garbage!", 8);  // the momentum's last bytes: the CRC fails
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  std::vector<Rank> ranks;
  absl::Status st = OpenAll(*svc, ranks, "c", 1, 2);
  ExpectHas(st, absl::StatusCode::kDataLoss,
            {"job 'c'", "mark of step 2", "moved aside", "no marks"});
  EXPECT_FALSE(std::filesystem::exists(file));
  EXPECT_EQ(svc->Status().jobs(0).marks_size(), 0);
  ExpectHas(OpenAll(*svc, ranks, "c", 1, 2),
            absl::StatusCode::kFailedPrecondition, {"step 2"});
  ASSERT_TRUE(OpenAll(*svc, ranks, "c", 1, 3).ok());  // its own step still
  ExpectReference(Read(*svc, ranks[0].open.session_id()), grads, 3);
  CloseAll(*svc, ranks);
  std::filesystem::remove_all(dir);
}

// A mark whose file cannot be written (its name taken by a directory) is
// kept in memory; not_durable and Status's snapshot errors say why.
TEST(Marks, AMarkThatCannotBeWrittenIsKeptInMemorySayingWhy) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 2, rng);
  std::string dir = NewTempDir("marks");
  std::filesystem::create_directory(dir + "/job-6e.dmst.mark-2");
  ServiceOptions o;
  o.state_dir = dir;
  auto svc = NewService(o);
  std::vector<Rank> ranks;
  ASSERT_TRUE(OpenAll(*svc, ranks, "n", 1, 0, v1::RESUME_FRESH).ok());
  RunSteps(*svc, ranks, 1, 2, grads);
  auto m = svc->Mark(MarkReq(ranks[0]));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(m->not_durable().find("job-6e.dmst.mark-2"), std::string::npos)
      << m->not_durable();
  EXPECT_EQ(std::vector<int64_t>(m->marks().begin(), m->marks().end()),
            std::vector<int64_t>{2});
  const v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.snapshot_errors_size(), 1);
  EXPECT_NE(status.snapshot_errors(0).find("mark-2"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dmuon::server::testing
