// Idle jobs and snapshot files without sockets: retention and the reaper
// (driven with the test's clock), dropped jobs resuming from their snapshot,
// corrupt snapshot files moved aside, snapshot write failures.

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
#include "server/testing/temp_dir.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

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
  const std::string tmpl = NewTempDir("idle");
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
  // Out of memory, listed from its file until reopened.
  ASSERT_EQ(svc->Status().jobs_size(), 1);
  EXPECT_TRUE(svc->Status().jobs(0).on_disk());
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
  const std::string tmpl = NewTempDir("corrupt");
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
  // 2 good, their previous snapshots (step 1), 2 moved aside.
  EXPECT_EQ(FilesWith(dir, ".dmst").size(), 6u);
  EXPECT_EQ(FilesWith(dir, ".dmst.prev").size(), 2u);
  EXPECT_EQ(metrics.snapshot_failures()["corrupt"], 2u);
  EXPECT_EQ(logged.size(), 2u);
  v1::StatusResponse status = svc->Status();
  ASSERT_EQ(status.snapshot_errors_size(), 2);
  for (const auto& e : status.snapshot_errors())
    EXPECT_NE(e.find(".corrupt-"), std::string::npos) << e;
  // "junk" asked to continue: refused, saying where its file went.
  {
    Rank r;
    auto req = Request("junk", 0, 1, v1::TRANSPORT_SHM, kIdle);
    req.set_resume(v1::RESUME_CONTINUE);
    const absl::Status none = r.Open(*svc, req);
    EXPECT_TRUE(absl::IsNotFound(none)) << none;
    EXPECT_NE(none.message().find("was moved aside to " + names.PathOf("junk") +
                                  ".corrupt-"),
              std::string::npos)
        << none;
  }
  // "evil" starts afresh (its file was moved aside at start), and its open
  // says so, once: the next job of the id is told nothing.
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("evil", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 1);
    for (const std::string& part : std::vector<std::string>{
             "job 'evil' starts from zero momentum at step 1",
             "could not be used",
             "moved aside to " + names.PathOf("evil") + ".corrupt-"}) {
      EXPECT_NE(r.open.notice().find(part), std::string::npos)
          << part << ": " << r.open.notice();
    }
    Rank r2;
    ASSERT_TRUE(
        r2.Open(*svc, Request("junk", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    EXPECT_NE(r2.open.notice().find("job 'junk' starts from zero"),
              std::string::npos)
        << r2.open.notice();
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
  EXPECT_NE(r.open.notice().find("job 'later' starts from zero momentum"),
            std::string::npos)
      << r.open.notice();
  // The good one still resumes, with nothing to say.
  Rank g;
  ASSERT_TRUE(
      g.Open(*svc, Request("good", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(g.open.next_step(), 3);
  EXPECT_EQ(g.open.notice(), "");
}

TEST(Service, SnapshotWriteFailuresAreCountedReportedAndReturned) {
  const std::string tmpl = NewTempDir("wfail");
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
  const std::string tmp = SnapshotStore(dir, nullptr).TempPathOf("w");
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
