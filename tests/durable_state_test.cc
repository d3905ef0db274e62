// Durable state with real processes (issue 14): a dmuond with --state-dir
// and --snapshot-every=1 killed (SIGKILL) or stopped (SIGTERM) mid-step; a
// daemon restarted on the directory continues every job from its last
// acknowledged step, and the next update is bit for bit the one an
// uninterrupted run computes (a second job on the restarted daemon). And a
// final snapshot that cannot be written makes dmuond exit non-zero; a
// corrupt snapshot file shows in `dmuonctl status`.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/muon_job.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

constexpr int kWorld = 1;

struct Trainer {
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
  std::vector<ParamSpec> table = TestTable(0, kWorld);
};

// Opens rank 0 of `job` (one rank, shm) on `d`, at `resume_step` if > 0.
absl::StatusOr<std::unique_ptr<Trainer>> TryOpen(const Daemon& d,
                                                 const std::string& job,
                                                 int64_t resume_step) {
  auto t = std::make_unique<Trainer>();
  ClientOptions o;
  o.deadline = std::chrono::seconds(30);
  auto c = Client::Connect(d.address(), o);
  if (!c.ok()) return c.status();
  t->client = *std::move(c);
  SessionSpec spec;
  spec.job_id = job;
  spec.world_size = kWorld;
  spec.params = t->table;
  spec.transport = TransportChoice::kShm;
  spec.resume_step = resume_step;
  auto s = t->client->OpenSession(spec);
  if (!s.ok()) return s.status();
  t->session = *std::move(s);
  return t;
}

// Opens rank 0 of `job` (one rank, shm) on `d`.
std::unique_ptr<Trainer> Open(const Daemon& d, const std::string& job) {
  auto t = std::make_unique<Trainer>();
  ClientOptions o;
  o.deadline = std::chrono::seconds(30);
  auto c = Client::Connect(d.address(), o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  t->client = *std::move(c);
  SessionSpec spec;
  spec.job_id = job;
  spec.rank = 0;
  spec.world_size = kWorld;
  spec.params = t->table;
  spec.transport = TransportChoice::kShm;
  auto s = t->client->OpenSession(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  t->session = *std::move(s);
  return t;
}

// Declares the gradients of the session's current step for `params`.
void Declare(Trainer& t, uint64_t seed, const std::vector<int>& params) {
  for (int p : params) {
    auto g = View(Gradient(seed, t.session->step(), p, 0, kWorld), t.table[p]);
    auto dst = t.session->gradient(p);
    std::copy(g.begin(), g.end(), dst.begin());
    ASSERT_TRUE(t.session->GradientReady(p).ok());
  }
}

std::vector<int> AllParams(const Trainer& t) {
  std::vector<int> ids;
  for (int p = static_cast<int>(t.table.size()) - 1; p >= 0; --p)
    ids.push_back(p);
  return ids;
}

// Runs the session's current step whole; returns its updates.
std::vector<std::vector<float>> Step(Trainer& t, uint64_t seed) {
  Declare(t, seed, AllParams(t));
  std::vector<std::vector<float>> out;
  for (int p = 0; p < static_cast<int>(t.table.size()); ++p) {
    const absl::Status st = t.session->WaitUpdate(p);
    EXPECT_TRUE(st.ok()) << st;
    auto u = t.session->update(p);
    out.emplace_back(u.begin(), u.end());
  }
  const absl::Status st = t.session->FinishStep();
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Steps 1..`to` of a fresh job `job` on `d`: the uninterrupted run.
std::vector<std::vector<float>> Straight(const Daemon& d,
                                         const std::string& job, uint64_t seed,
                                         int to) {
  auto t = Open(d, job);
  if (!t) return {};
  std::vector<std::vector<float>> last;
  for (int s = 1; s <= to; ++s) last = Step(*t, seed);
  return last;
}

uint64_t Seed() { return std::random_device{}(); }

// Steps 1..3 acknowledged, step 4 half declared (its first parameters
// computed, momentum advanced), then the daemon gets `sig`; a daemon
// restarted on the directory must continue at step 4, bit for bit.
void InterruptAndResume(int sig, const std::vector<std::string>& flags,
                        int want_exit) {
  const std::string dir = TempDir(sig == SIGKILL ? "kill9" : "sigterm");
  const uint64_t seed = Seed();
  std::vector<std::string> all = {"--state-dir=" + dir, "--snapshot-every=1"};
  all.insert(all.end(), flags.begin(), flags.end());
  {
    Daemon d(all);
    ASSERT_NE(d.port(), 0) << d.log();
    auto t = Open(d, "durable");
    ASSERT_TRUE(t);
    for (int s = 1; s <= 3; ++s) Step(*t, seed);
    ASSERT_EQ(t->session->step(), 4);
    auto ids = AllParams(*t);
    ids.pop_back();  // parameter 0 never comes
    Declare(*t, seed, ids);
    // Let some of step 4 compute (momentum advanced in place).
    ASSERT_TRUE(t->session->WaitUpdate(ids.front()).ok());
    d.process().Signal(sig);
    EXPECT_EQ(d.process().Wait(30), want_exit) << d.log();
    if (sig == SIGTERM) {
      EXPECT_NE(d.log().find("state snapshotted"), std::string::npos)
          << d.log();
      // The trainer is told step 4 is void, naming the step to go on from.
      const absl::Status st = t->session->WaitUpdate(0);
      EXPECT_FALSE(st.ok());
    }
  }
  Daemon d(all);
  ASSERT_NE(d.port(), 0) << d.log();
  // The restart says what it found, and the job is listed before it is
  // reopened (issue 29, item 7).
  EXPECT_NE(d.log().find("1 job snapshot(s) found"), std::string::npos)
      << d.log();
  int code = 0;
  const std::string status = Ctl(d.address(), {"status"}, &code);
  EXPECT_EQ(code, 0) << status;
  EXPECT_NE(status.find("durable"), std::string::npos) << status;
  EXPECT_NE(status.find("on disk"), std::string::npos) << status;
  auto t = Open(d, "durable");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->session->step(), 4) << d.log();
  const auto resumed = Step(*t, seed);
  const auto straight = Straight(d, "straight", seed, 4);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t p = 0; p < resumed.size(); ++p)
    EXPECT_EQ(resumed[p], straight[p]) << "parameter " << p;  // bit for bit
}

TEST(DurableState, KilledDaemonResumesFromTheLastAcknowledgedStep) {
  InterruptAndResume(SIGKILL, {}, 128 + SIGKILL);
}

TEST(DurableState, SigtermMidStepSnapshotsTheLastCompleteStep) {
  // The step still incomplete after 3/4 of --exit-timeout-secs is void.
  InterruptAndResume(SIGTERM, {"--exit-timeout-secs=2"}, 0);
}

TEST(DurableState, AFinalSnapshotThatFailsExitsNonZero) {
  const std::string dir = TempDir("final-fails");
  Daemon d({"--state-dir=" + dir, "--exit-timeout-secs=5"});
  ASSERT_NE(d.port(), 0) << d.log();
  // The job's temporary file name (unique per daemon: its pid) is taken by a
  // directory: its writes fail.
  ASSERT_TRUE(std::filesystem::create_directory(
      dir + "/job-6e6f70652d6469736b.dmst.tmp-" +  // hex("nope-disk")
      std::to_string(d.process().pid())));
  {
    auto t = Open(d, "nope-disk");
    ASSERT_TRUE(t);
    Step(*t, Seed());
    ASSERT_TRUE(t->session->Close().ok());
  }
  int code;
  const std::string status = Ctl(d.address(), {"status", "--json"}, &code);
  EXPECT_EQ(code, 0) << status;
  d.process().Signal(SIGTERM);
  EXPECT_EQ(d.process().Wait(30), 1) << d.log();
  EXPECT_NE(d.log().find("final snapshot failed"), std::string::npos)
      << d.log();
  EXPECT_NE(d.log().find("snapshot: UNAVAILABLE"), std::string::npos)
      << d.log();
}

// Acknowledged and durable agree exactly (issue 27): a daemon killed after
// a step's snapshot is written but before the trainer got its step_complete
// restarts one step ahead of the trainer. The trainer here takes step 4 to
// its end (so its snapshot is written) and then plays the one that never got
// step_complete 4: its state is step 3's. Reopened with resume_step=3 on the
// restarted daemon, the job continues from step 3's momentum (the previous
// snapshot), and step 4 again is bit for bit the uninterrupted run's.
// Without resume_step the job would continue at step 5: that trainer's step
// 4 applied on top of momentum that already holds step 4's gradient.
TEST(DurableState, AStepNeverAcknowledgedIsResumedExactlyWithResumeStep) {
  const std::string dir = TempDir("unacked");
  const uint64_t seed = Seed();
  const std::vector<std::string> flags = {"--state-dir=" + dir,
                                          "--snapshot-every=1"};
  {
    Daemon d(flags);
    ASSERT_NE(d.port(), 0) << d.log();
    auto t = Open(d, "unacked");
    ASSERT_TRUE(t);
    for (int s = 1; s <= 4; ++s) Step(*t, seed);
    d.process().Signal(SIGKILL);
    EXPECT_EQ(d.process().Wait(30), 128 + SIGKILL) << d.log();
  }
  Daemon d(flags);
  ASSERT_NE(d.port(), 0) << d.log();
  // A step dmuond holds neither in the snapshot (4) nor in the previous one
  // (3) is refused, naming both, and changes nothing.
  auto two = TryOpen(d, "unacked", 2);
  ASSERT_FALSE(two.ok());
  EXPECT_EQ(two.status().code(), absl::StatusCode::kFailedPrecondition)
      << two.status();
  EXPECT_NE(two.status().message().find("holds its momentum of step 4"),
            std::string::npos)
      << two.status();
  EXPECT_NE(two.status().message().find("holds step 3"), std::string::npos)
      << two.status();
  auto t = TryOpen(d, "unacked", 3);
  ASSERT_TRUE(t.ok()) << t.status() << d.log();
  EXPECT_EQ((*t)->session->step(), 4);
  const auto resumed = Step(**t, seed);
  const auto straight = Straight(d, "straight", seed, 4);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t p = 0; p < resumed.size(); ++p)
    EXPECT_EQ(resumed[p], straight[p]) << "parameter " << p;  // bit for bit
  // The snapshot of the step never acknowledged is kept for the operator.
  bool kept = false;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    kept |=
        e.path().filename().string().find(".rolled-back-") != std::string::npos;
  EXPECT_TRUE(kept);
  // In memory the job is at step 4 now: a rank asking for step 3 is refused.
  ASSERT_TRUE((*t)->session->Close().ok());
  auto again = TryOpen(d, "unacked", 3);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  auto four = TryOpen(d, "unacked", 4);
  EXPECT_TRUE(four.ok()) << four.status();
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One --state-dir belongs to one daemon (issue 27, defect 4): a second
// dmuond on it is refused at start, naming the first, and touches nothing;
// a missing directory is made.
TEST(DurableState, ASecondDaemonOnTheSameStateDirIsRefused) {
  const std::string dir = TempDir("shared") + "/made/by/dmuond";
  Daemon first({"--state-dir=" + dir, "--snapshot-every=1"});
  ASSERT_NE(first.port(), 0) << first.log();
  auto t = Open(first, "mine");
  ASSERT_TRUE(t);
  const uint64_t seed = Seed();
  Step(*t, seed);
  Step(*t, seed);
  const std::string snapshot = dir + "/job-6d696e65.dmst";  // hex("mine")
  const std::string before = FileBytes(snapshot);
  ASSERT_FALSE(before.empty()) << first.log();
  const std::string log = TempDir("shared-log") + "/second.log";
  Process second(
      {Runfile("daemon/dmuond"), "--listen=127.0.0.1:0", "--state-dir=" + dir,
       "--snapshot-every=1", "--summary-every-secs=0"},
      log);
  EXPECT_EQ(second.Wait(30), 2);
  const std::string said = FileBytes(log);
  EXPECT_NE(
      said.find("--state-dir=" + dir + ": in use by another dmuond (pid " +
                std::to_string(first.process().pid()) + ","),
      std::string::npos)
      << said;
  EXPECT_EQ(FileBytes(snapshot), before);
  Step(*t, seed);  // the first goes on
  EXPECT_NE(FileBytes(snapshot), before);
}

TEST(DurableState, StatusTextListsSnapshotErrors) {
  // A terminal escape in the directory's name (issue 27: dmuonctl printed
  // the daemon's strings raw): shown as \x1b, never sent to the terminal.
  const std::string dir = TempDir("status-errors") + "/\x1b[31mred";
  std::filesystem::create_directories(dir);
  const std::string shown = dir.substr(0, dir.find('\x1b')) + "\\x1b[31mred";
  // A snapshot file that is not one: moved aside at start, and reported.
  {
    std::ofstream f(dir + "/job-626164.dmst");  // hex("bad")
    f << "not a snapshot";
  }
  Daemon d({"--state-dir=" + dir});
  ASSERT_NE(d.port(), 0) << d.log();
  int code;
  const std::string text = Ctl(d.address(), {"status"}, &code);
  EXPECT_EQ(code, 0) << text;
  EXPECT_NE(text.find("SNAPSHOT ERRORS (1, oldest first)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moved aside to " + shown + "/job-626164.dmst.corrupt-"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << "a raw escape printed";
}

}  // namespace
}  // namespace dmuon::testing
