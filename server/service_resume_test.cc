// OpenSessionRequest.resume (docs/protocol.md "Resume") and the protocol
// minor version, without sockets: fresh, continue, replace and unspecified
// on a job in memory (open or idle) and on one only in a --state-dir
// snapshot after a restart; ranks joining a job just started; ownership
// before resume; a client of a newer minor refused naming both versions.
// Every continued or replaced run is compared bit for bit with an
// uninterrupted one.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/protocol.h"
#include "server/principal.h"
#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kTable = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                   {"b", 40, 24, v1::SHARDING_REPLICATED}};
using Grads = std::vector<std::vector<std::vector<float>>>;
using Updates = std::vector<std::vector<float>>;

v1::OpenSessionRequest Req(const std::string& job, v1::Resume resume,
                           int rank = 0, int world = 1) {
  auto r = Request(job, rank, world, v1::TRANSPORT_SHM, kTable);
  r.set_resume(resume);
  r.set_protocol_minor(ProtocolMinor());
  r.set_client_version("test");
  return r;
}

// Steps from..to of the ranks (every rank sends the same gradients:
// replicated); rank 0's last updates.
Updates RunSteps(OptimizerService& svc, std::vector<Rank*> ranks, int from,
                 int to, const Grads& grads) {
  Updates last;
  for (int s = from; s <= to; ++s) {
    for (Rank* r : ranks) EXPECT_TRUE(r->Send(svc, s, grads[s - 1]).ok()) << s;
    for (size_t k = 0; k < ranks.size(); ++k) {
      auto msgs = ranks[k]->sink->WaitStep(s);
      EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
      if (k != 0) continue;
      last.clear();
      for (int i = 0; i < ranks[0]->open.layout().slots_size(); ++i)
        last.push_back(ranks[0]->Update(i, msgs));
    }
  }
  return last;
}

// Steps 1..to of a job of its own on a service of its own.
Updates Straight(int to, const Grads& grads) {
  auto svc = NewService();
  Rank r;
  EXPECT_TRUE(r.Open(*svc, Req("straight", v1::RESUME_FRESH)).ok());
  return RunSteps(*svc, {&r}, 1, to, grads);
}

void ExpectHas(const absl::Status& st, absl::StatusCode code,
               const std::vector<std::string>& parts) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << p << ": " << st;
}

TEST(Resume, ModesOnAJobInMemory) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 4, rng);
  auto svc = NewService();
  {
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Req("j", v1::RESUME_FRESH)).ok());
    EXPECT_EQ(r.open.next_step(), 1);
    EXPECT_EQ(r.open.capabilities().protocol_minor(), ProtocolMinor());
    RunSteps(*svc, {&r}, 1, 2, grads);
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  // Idle in memory at step 2: fresh is refused, saying how to go on.
  Rank r;
  ExpectHas(r.Open(*svc, Req("j", v1::RESUME_FRESH)),
            absl::StatusCode::kAlreadyExists,
            {"job 'j'", "completed step 2", "idle in this dmuond's memory",
             "resume=continue", "resume=True", "resume=replace",
             "resume=\"replace\""});
  // Continue: step 3 on, bit for bit an uninterrupted run.
  ASSERT_TRUE(r.Open(*svc, Req("j", v1::RESUME_CONTINUE)).ok());
  EXPECT_EQ(r.open.next_step(), 3);
  EXPECT_EQ(RunSteps(*svc, {&r}, 3, 3, grads), Straight(3, grads));
  ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  // Unspecified keeps protocol 1.0's behaviour: continues.
  Rank u;
  ASSERT_TRUE(u.Open(*svc, Req("j", v1::RESUME_UNSPECIFIED)).ok());
  EXPECT_EQ(u.open.next_step(), 4);
  ASSERT_TRUE(svc->CloseSession(u.open.session_id()).ok());
  // Replace: step 1 of a fresh job, bit for bit.
  Rank x;
  ASSERT_TRUE(x.Open(*svc, Req("j", v1::RESUME_REPLACE)).ok());
  EXPECT_EQ(x.open.next_step(), 1);
  EXPECT_EQ(RunSteps(*svc, {&x}, 1, 2, grads), Straight(2, grads));
  // Continue on nothing: NOT_FOUND, saying why and what to do.
  Rank n;
  ExpectHas(n.Open(*svc, Req("nobody", v1::RESUME_CONTINUE)),
            absl::StatusCode::kNotFound,
            {"job 'nobody'", "holds no momentum", "without --state-dir",
             "resume=fresh"});
  // Nothing of it was made.
  const v1::StatusResponse status = svc->Status();
  for (const auto& j : status.jobs()) EXPECT_NE(j.job_id(), "nobody");
}

TEST(Resume, RanksJoiningAJobJustStartedAndReplaceWhileOpen) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 2, rng);
  auto svc = NewService();
  // Every rank says fresh (or replace): ranks 1.. join rank 0's new job.
  Rank a, b, c;
  ASSERT_TRUE(a.Open(*svc, Req("m", v1::RESUME_FRESH, 0, 3)).ok());
  ASSERT_TRUE(b.Open(*svc, Req("m", v1::RESUME_REPLACE, 1, 3)).ok());
  ASSERT_TRUE(c.Open(*svc, Req("m", v1::RESUME_FRESH, 2, 3)).ok());
  EXPECT_EQ(b.open.next_step(), 1);
  EXPECT_EQ(c.open.next_step(), 1);
  RunSteps(*svc, {&a, &b, &c}, 1, 1, grads);
  // Between steps, rank 2 leaves; its replacement may not replace the job
  // under ranks 0 and 1, nor start it fresh; continue rejoins.
  ASSERT_TRUE(svc->CloseSession(c.open.session_id()).ok());
  Rank c2;
  ExpectHas(c2.Open(*svc, Req("m", v1::RESUME_REPLACE, 2, 3)),
            absl::StatusCode::kFailedPrecondition,
            {"job 'm' cannot be replaced", "ranks 0,1 of it are open",
             "completed step 1", "Close every session"});
  ExpectHas(c2.Open(*svc, Req("m", v1::RESUME_FRESH, 2, 3)),
            absl::StatusCode::kAlreadyExists,
            {"completed step 1", "2 of its 3 ranks open"});
  ASSERT_TRUE(c2.Open(*svc, Req("m", v1::RESUME_CONTINUE, 2, 3)).ok());
  EXPECT_EQ(c2.open.next_step(), 2);
  // Every rank closed: rank 0 replaces it, the others join at step 1 (a
  // continue now finds nothing to continue).
  for (Rank* r : {&a, &b, &c2})
    ASSERT_TRUE(svc->CloseSession(r->open.session_id()).ok());
  Rank a2, b2, c3, late;
  ASSERT_TRUE(a2.Open(*svc, Req("m", v1::RESUME_REPLACE, 0, 3)).ok());
  EXPECT_EQ(a2.open.next_step(), 1);
  ExpectHas(late.Open(*svc, Req("m", v1::RESUME_CONTINUE, 1, 3)),
            absl::StatusCode::kNotFound, {"job 'm'", "holds no momentum"});
  ASSERT_TRUE(b2.Open(*svc, Req("m", v1::RESUME_REPLACE, 1, 3)).ok());
  ASSERT_TRUE(c3.Open(*svc, Req("m", v1::RESUME_FRESH, 2, 3)).ok());
  EXPECT_EQ(c3.open.next_step(), 1);
  EXPECT_EQ(RunSteps(*svc, {&a2, &b2, &c3}, 1, 2, grads), Straight(2, grads));
}

TEST(Resume, ASnapshotNotLoadedYetHoldsMomentumAndReplaceMovesItAside) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 4, rng);
  ServiceOptions o;
  o.state_dir = NewTempDir("resume");
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Req("s", v1::RESUME_FRESH)).ok());
    RunSteps(*svc, {&r}, 1, 3, grads);
    ASSERT_TRUE(svc->SnapshotAll().ok());
  }
  const std::string path = SnapshotStore(o.state_dir, nullptr).PathOf("s");
  {
    // A restart: the job is only a file until it is opened.
    auto svc = NewService(o);
    ASSERT_TRUE(svc->LoadSnapshots().ok());
    Rank r;
    ExpectHas(r.Open(*svc, Req("s", v1::RESUME_FRESH)),
              absl::StatusCode::kAlreadyExists,
              {"job 's'", "completed step 3",
               "snapshot under --state-dir " + o.state_dir, "resume=continue",
               "resume=replace"});
    // Not made by the refusal: still only its file.
    ASSERT_EQ(svc->Status().jobs_size(), 1);
    EXPECT_TRUE(svc->Status().jobs(0).on_disk());
    ASSERT_TRUE(r.Open(*svc, Req("s", v1::RESUME_CONTINUE)).ok());
    EXPECT_EQ(r.open.next_step(), 4);
    EXPECT_EQ(RunSteps(*svc, {&r}, 4, 4, grads), Straight(4, grads));
    ASSERT_TRUE(svc->SnapshotAll().ok());
  }
  {
    // Replace a job that is only a file: the file is moved aside (kept),
    // the new job's snapshots are written (not refused as older), and a
    // restart continues the new job, not the old.
    auto svc = NewService(o);
    ASSERT_TRUE(svc->LoadSnapshots().ok());
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Req("s", v1::RESUME_REPLACE)).ok());
    EXPECT_EQ(r.open.next_step(), 1);
    int aside = 0;
    for (const auto& e : std::filesystem::directory_iterator(o.state_dir))
      aside += e.path().string().rfind(path + ".replaced-", 0) == 0;
    EXPECT_EQ(aside, 1);
    EXPECT_FALSE(std::filesystem::exists(path));
    RunSteps(*svc, {&r}, 1, 1, grads);
    ASSERT_TRUE(svc->SnapshotAll().ok());
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  {
    auto svc = NewService(o);
    ASSERT_TRUE(svc->LoadSnapshots().ok());
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Req("s", v1::RESUME_CONTINUE)).ok());
    EXPECT_EQ(r.open.next_step(), 2);
    EXPECT_EQ(RunSteps(*svc, {&r}, 2, 2, grads), Straight(2, grads));
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
    // Replace an idle job in memory whose snapshot is on disk too: both
    // go; a late snapshot of the replaced job cannot bring it back.
    ASSERT_TRUE(svc->SnapshotAll().ok());
    Rank x;
    ASSERT_TRUE(x.Open(*svc, Req("s", v1::RESUME_REPLACE)).ok());
    EXPECT_EQ(x.open.next_step(), 1);
    EXPECT_FALSE(std::filesystem::exists(path));
    ASSERT_TRUE(svc->SnapshotAll().ok());  // the new job at step 0
    ASSERT_TRUE(svc->CloseSession(x.open.session_id()).ok());
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ExpectHas(r.Open(*svc, Req("s", v1::RESUME_CONTINUE)),
            absl::StatusCode::kNotFound,
            {"job 's'", "nor a snapshot under --state-dir " + o.state_dir});
  ASSERT_TRUE(r.Open(*svc, Req("s", v1::RESUME_FRESH)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
}

// Opens a fresh `job` as `who` (one rank), runs steps 1..grads.size() and
// closes it.
void StepAs(OptimizerService& svc, const std::string& job, const Principal& who,
            const Grads& grads) {
  auto open = svc.OpenSession(Req(job, v1::RESUME_FRESH), who);
  ASSERT_TRUE(open.ok()) << open.status();
  Rank r;
  r.open = *open;
  auto shm = transport::OpenShmRegion(r.open.shm_name(),
                                      r.open.layout().total_bytes());
  ASSERT_TRUE(shm.ok());
  r.shm = *std::move(shm);
  ASSERT_TRUE(svc.Attach(r.open.session_id(), r.sink).ok());
  RunSteps(svc, {&r}, 1, static_cast<int>(grads.size()), grads);
  ASSERT_TRUE(svc.CloseSession(r.open.session_id()).ok());
}

TEST(Resume, OwnershipIsCheckedFirst) {
  ServiceOptions o;
  o.state_dir = NewTempDir("resume-owner");
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 1, rng);
  const Principal alice{"alice"}, bob{"bob"};
  {
    auto svc = NewService(o);
    StepAs(*svc, "mine", alice, grads);
    // In memory: another principal learns nothing, whatever the mode.
    for (v1::Resume m : {v1::RESUME_FRESH, v1::RESUME_CONTINUE,
                         v1::RESUME_REPLACE, v1::RESUME_UNSPECIFIED}) {
      const absl::Status st = svc->OpenSession(Req("mine", m), bob).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
      EXPECT_EQ(st.message().find("step"), std::string::npos) << st;
    }
    ASSERT_TRUE(svc->SnapshotAll().ok());
  }
  // Only a file: the same, and bob's replace leaves alice's file alone.
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  for (v1::Resume m : {v1::RESUME_FRESH, v1::RESUME_CONTINUE,
                       v1::RESUME_REPLACE, v1::RESUME_UNSPECIFIED}) {
    const absl::Status st = svc->OpenSession(Req("mine", m), bob).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  }
  auto open = svc->OpenSession(Req("mine", v1::RESUME_CONTINUE), alice);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->next_step(), 2);
}

// A job of `owner` stepped `steps` times and snapshotted in `dir`.
void Snapshotted(const std::string& dir, const std::string& job,
                 const Principal& owner, int steps) {
  ServiceOptions o;
  o.state_dir = dir;
  auto svc = NewService(o);
  std::mt19937_64 rng(std::random_device{}());
  StepAs(*svc, job, owner, StepsOfGradients(kTable, steps, rng));
  ASSERT_TRUE(svc->SnapshotAll().ok());
}

// Issue 27, defect 1: a refused open read the job's snapshot first (and
// kept it), so a trainer that owns nothing could grow the daemon's memory by
// every snapshot it named. Here the file's momentum is damaged: an open
// that read it would fail with DATA_LOSS and move the file aside; refused
// opens leave it where it is.
TEST(Resume, AnOpenRefusedOnCheapChecksReadsNoSnapshot) {
  ServiceOptions o;
  o.state_dir = NewTempDir("refused-reads");
  o.max_sessions = 1;
  const Principal alice{"alice"}, bob{"bob"};
  Snapshotted(o.state_dir, "mine", alice, 2);
  const std::string path = SnapshotStore(o.state_dir, nullptr).PathOf("mine");
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  {  // damaged after the start's check
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-8, std::ios::end);  // momentum, before the CRC
    f.put('\x7f');
  }
  for (v1::Resume m :
       {v1::RESUME_FRESH, v1::RESUME_CONTINUE, v1::RESUME_UNSPECIFIED}) {
    const absl::Status st = svc->OpenSession(Req("mine", m), bob).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  }
  Rank other;  // the one session --max-sessions allows
  ASSERT_TRUE(other.Open(*svc, Req("other", v1::RESUME_FRESH)).ok());
  ExpectHas(svc->OpenSession(Req("mine", v1::RESUME_CONTINUE), alice).status(),
            absl::StatusCode::kResourceExhausted, {"--max-sessions"});
  ASSERT_TRUE(svc->Drain() >= 0);
  ExpectHas(svc->OpenSession(Req("mine", v1::RESUME_CONTINUE), alice).status(),
            absl::StatusCode::kUnavailable, {"draining"});
  EXPECT_TRUE(std::filesystem::exists(path)) << "read and moved aside";
  EXPECT_EQ(svc->Status().snapshot_errors_size(), 0);
  // Only an open that passes them reads it (and finds the damage).
  svc->Undrain();
  ASSERT_TRUE(svc->CloseSession(other.open.session_id()).ok());
  ExpectHas(svc->OpenSession(Req("mine", v1::RESUME_CONTINUE), alice).status(),
            absl::StatusCode::kDataLoss, {"moved aside"});
}

// A snapshot read for an open refused afterwards (here: a table that does
// not match it) is not kept in memory: the next open reads the file again,
// so a file removed meanwhile is gone for it.
TEST(Resume, ASnapshotReadForARefusedOpenIsNotKept) {
  ServiceOptions o;
  o.state_dir = NewTempDir("refused-keeps");
  Snapshotted(o.state_dir, "k", Principal{}, 3);
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  auto other_table = Request("k", 0, 1, v1::TRANSPORT_SHM,
                             {{"a", 24, 40, v1::SHARDING_REPLICATED}});
  other_table.set_protocol_minor(ProtocolMinor());
  ExpectHas(svc->OpenSession(other_table).status(),
            absl::StatusCode::kInvalidArgument, {"snapshot"});
  // Still readable: the same open with the job's own table resumes.
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Req("k", v1::RESUME_CONTINUE)).ok());
  EXPECT_EQ(r.open.next_step(), 4);
  ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());

  auto again = NewService(o);
  ASSERT_TRUE(again->LoadSnapshots().ok());
  ExpectHas(again->OpenSession(other_table).status(),
            absl::StatusCode::kInvalidArgument, {"snapshot"});
  std::filesystem::remove(SnapshotStore(o.state_dir, nullptr).PathOf("k"));
  ExpectHas(again->OpenSession(Req("k", v1::RESUME_CONTINUE)).status(),
            absl::StatusCode::kNotFound, {"nor a snapshot"});
}

// A job that is only a snapshot file is listed in Status (issue 29, item 7):
// found at start, or dropped idle with --state-dir; opened, it is a job
// again.
TEST(Resume, JobsOnlyOnDiskAreListed) {
  ServiceOptions o;
  o.state_dir = NewTempDir("on-disk");
  Snapshotted(o.state_dir, "kept", Principal{}, 3);
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  auto listed = [&](const std::string& id) -> std::optional<v1::JobStatus> {
    const v1::StatusResponse status = svc->Status();
    for (const auto& j : status.jobs())
      if (j.job_id() == id) return j;
    return std::nullopt;
  };
  auto disk = listed("kept");
  ASSERT_TRUE(disk);
  EXPECT_TRUE(disk->on_disk());
  EXPECT_EQ(disk->completed_steps(), 3);
  EXPECT_EQ(disk->parameters(), 2);
  EXPECT_EQ(disk->state_bytes(), (24u * 40 + 40 * 24) * 4);
  EXPECT_EQ(disk->ranks_open(), 0);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Req("kept", v1::RESUME_CONTINUE)).ok());
  auto open = listed("kept");
  ASSERT_TRUE(open);
  EXPECT_FALSE(open->on_disk());
  EXPECT_EQ(open->ranks_open(), 1);
  EXPECT_EQ(svc->Status().jobs_size(), 1);  // listed once
}

// Two trainers on one job id (issue 29, item 7): the second is told who
// holds the rank and for how long, not only that it is open.
TEST(Resume, ASecondOpenOfARankNamesTheFirstOnesPeer) {
  auto svc = NewService();
  Principal first;
  first.peer = "ipv4:10.1.2.3:41234";
  auto open = svc->OpenSession(Req("shared", v1::RESUME_FRESH), first);
  ASSERT_TRUE(open.ok()) << open.status();
  Principal second;
  second.peer = "ipv4:10.9.9.9:5000";
  ExpectHas(
      svc->OpenSession(Req("shared", v1::RESUME_UNSPECIFIED), second).status(),
      absl::StatusCode::kAlreadyExists,
      {"rank 0 of job 'shared' is already open by ipv4:10.1.2.3:41234",
       ", for 0 s", "job_id"});
}

// resume_step (protocol minor 4) on a job in memory: only the step it is at;
// a bad field is refused naming it; a step of nothing is NOT_FOUND.
TEST(Resume, AResumeStepOnAJobInMemoryIsTheStepItIsAt) {
  std::mt19937_64 rng(std::random_device{}());
  const Grads grads = StepsOfGradients(kTable, 3, rng);
  auto svc = NewService();
  {
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Req("j", v1::RESUME_FRESH)).ok());
    RunSteps(*svc, {&r}, 1, 2, grads);
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  auto at = [](int64_t step, v1::Resume resume = v1::RESUME_CONTINUE) {
    auto req = Req("j", resume);
    req.set_resume_step(step);
    return req;
  };
  Rank one;
  ExpectHas(one.Open(*svc, at(1)), absl::StatusCode::kFailedPrecondition,
            {"job 'j' cannot resume at completed step 1",
             "holds its momentum of step 2", "in this dmuond's memory"});
  ExpectHas(one.Open(*svc, at(-1)), absl::StatusCode::kInvalidArgument,
            {"resume_step is -1"});
  ExpectHas(one.Open(*svc, at(2, v1::RESUME_FRESH)),
            absl::StatusCode::kInvalidArgument,
            {"resume_step 2", "RESUME_FRESH"});
  ExpectHas(one.Open(*svc, at(2, v1::RESUME_REPLACE)),
            absl::StatusCode::kInvalidArgument,
            {"resume_step 2", "RESUME_REPLACE"});
  auto nobody = at(5);
  nobody.set_job_id("nobody");
  ExpectHas(one.Open(*svc, nobody), absl::StatusCode::kNotFound,
            {"job 'nobody'", "holds no momentum"});
  // The step it is at, with resume unspecified too: continues, bit for bit.
  Rank two;
  ASSERT_TRUE(two.Open(*svc, at(2, v1::RESUME_UNSPECIFIED)).ok());
  EXPECT_EQ(two.open.next_step(), 3);
  EXPECT_EQ(RunSteps(*svc, {&two}, 3, 3, grads), Straight(3, grads));
}

TEST(Resume, ANewerClientMinorIsRefusedNamingBothVersions) {
  ServiceOptions o;
  o.version = "9.8.7";
  auto svc = NewService(o);
  auto req = Req("v", v1::RESUME_FRESH);
  req.set_protocol_minor(ProtocolMinor() + 1);
  req.set_client_version("5.6.7");
  ExpectHas(svc->OpenSession(req).status(),
            absl::StatusCode::kFailedPrecondition,
            {absl::StrCat("client speaks protocol 1.", ProtocolMinor() + 1),
             "client 5.6.7",
             absl::StrCat("dmuond speaks protocol 1.", ProtocolMinor()),
             "dmuond 9.8.7", "upgrade dmuond"});
  // A client of minor 0 (older than minor versions) is served.
  req.set_protocol_minor(0);
  req.clear_client_version();
  req.set_resume(v1::RESUME_UNSPECIFIED);
  auto open = svc->OpenSession(req);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->capabilities().protocol_minor(), ProtocolMinor());
  EXPECT_EQ(open->capabilities().version(), "9.8.7");
  // An unknown mode is refused, naming the field.
  auto bad = Req("w", v1::RESUME_FRESH);
  bad.set_resume(static_cast<v1::Resume>(7));
  ExpectHas(svc->OpenSession(bad).status(), absl::StatusCode::kInvalidArgument,
            {"resume is 7"});
}

}  // namespace
}  // namespace dmuon::server::testing
