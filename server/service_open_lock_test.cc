// Heavy per-job work holds none of the service's locks (docs/design.md,
// its locks): while one job's open is stopped in the middle of it (a new
// job's momentum allocated and zero-filled, the shard cover check of its
// last rank) or a closed job's memory is being let go, another job steps,
// Status answers and other jobs open. ServiceOptions::heavy_work_hook stops
// the work where it runs; a call that waited for it would still be waiting
// when the test gives up on it (a bound, not a timing: the work stays
// stopped until the test lets it go). Also the rules the open keeps while
// its work runs unlocked: --max-state-bytes counts a job being made, a rank
// being opened is taken, the reaper keeps a job whose rank is being opened,
// the ranks of a job being made join it, and a resumed job's open that
// fails gives its snapshot back.

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/protocol.h"
#include "server/testing/service_harness.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server::testing {
namespace {

using Clock = std::chrono::steady_clock;

// How long a call that must not wait for the stopped work is given.
constexpr absl::Duration kBound = absl::Seconds(10);

const std::vector<Param> kSmall = {{"w", 24, 16, v1::SHARDING_REPLICATED}};

// Stops the heavy work named `work` of job `job` until Release (or a minute
// passes, so that a failing test still ends), from when it is armed.
class Gate {
 public:
  Gate(std::string job, std::string work, bool armed = true)
      : job_(std::move(job)), work_(std::move(work)), armed_(armed) {}
  std::function<void(const std::string&, std::string_view)> Hook() {
    return [this](const std::string& job, std::string_view work) {
      if (job != job_ || work != work_) return;
      absl::MutexLock l(&mu_);
      if (!armed_) return;
      ++reached_;
      mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Seconds(60));
    };
  }
  // Whether the work reached the gate within kBound.
  bool WaitReached() {
    absl::MutexLock l(&mu_);
    auto reached = [this] {
      mu_.AssertHeld();
      return reached_ > 0;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kBound);
  }
  void Release() {
    absl::MutexLock l(&mu_);
    released_ = true;
  }
  void Arm() {
    absl::MutexLock l(&mu_);
    armed_ = true;
  }

 private:
  const std::string job_, work_;
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_);
  int reached_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

// `fn` on a thread of its own; Done says whether it returned within kBound.
class Call {
 public:
  explicit Call(std::function<void()> fn)
      : thread_([this, fn = std::move(fn)] {
          fn();
          done_.Notify();
        }) {}
  ~Call() { thread_.join(); }
  bool Done() { return done_.WaitForNotificationWithTimeout(kBound); }

 private:
  absl::Notification done_;
  std::thread thread_;
};

// One step of the open 1-rank `r` of kSmall, checked against the fp64
// reference (its first step: momentum from zero).
void StepChecked(OptimizerService& svc, Rank& r, int64_t step,
                 std::mt19937_64& rng, Reference& ref) {
  auto g = RandomGradients(kSmall, rng);
  ASSERT_TRUE(r.Send(svc, step, g).ok());
  auto msgs = r.sink->WaitStep(step);
  ASSERT_FALSE(msgs.empty());
  ASSERT_TRUE(msgs.back().has_step_complete()) << msgs.back().DebugString();
  const auto want = ref.Step(std::vector<double>(g[0].begin(), g[0].end()),
                             {kSmall[0].rows, kSmall[0].cols});
  EXPECT_LT(RelErr(r.Update(0, msgs), want), 1e-3);
}

// While `gate` holds a heavy piece of work: another job steps (twice),
// Status lists it, and a third job opens and closes. Returns whether all of
// it ended within kBound; the gate is released then (so that calls that
// waited end too).
bool OthersGoOn(Gate& gate, OptimizerService& svc, Rank& other, int64_t* step,
                std::mt19937_64& rng, Reference& ref) {
  Call call([&] {
    for (int i = 0; i < 2; ++i) StepChecked(svc, other, ++*step, rng, ref);
    const v1::StatusResponse st = svc.Status();
    bool listed = false;
    for (const auto& j : st.jobs())
      listed |= j.job_id() == "other" && j.completed_steps() == *step;
    EXPECT_TRUE(listed) << st.DebugString();
    Rank third;
    EXPECT_TRUE(
        third.Open(svc, Request("third", 0, 1, v1::TRANSPORT_SHM, kSmall))
            .ok());
    EXPECT_TRUE(svc.CloseSession(third.open.session_id()).ok());
  });
  const bool done = call.Done();
  gate.Release();
  return done;
}

struct Fixture {
  explicit Fixture(Gate& gate, ServiceOptions o = {}) {
    o.heavy_work_hook = gate.Hook();
    svc = NewService(o);
    EXPECT_TRUE(
        other.Open(*svc, Request("other", 0, 1, v1::TRANSPORT_INLINE, kSmall))
            .ok());
  }
  std::unique_ptr<OptimizerService> svc;
  Rank other;
  int64_t step = 0;
  std::mt19937_64 rng{std::random_device{}()};
  Reference ref;
};

// Job `id` (1 rank of kSmall) opened, stepped once (checked) and closed:
// idle at completed step 1.
void IdleAfterOneStep(Fixture& f, const std::string& id) {
  Rank r;
  ASSERT_TRUE(
      r.Open(*f.svc, Request(id, 0, 1, v1::TRANSPORT_INLINE, kSmall)).ok());
  Reference ref;
  StepChecked(*f.svc, r, 1, f.rng, ref);
  ASSERT_TRUE(f.svc->CloseSession(r.open.session_id()).ok());
}

// A fresh --state-dir (the caller removes it).
std::string StateDir() {
  std::string dir = NewTempDir("openlock");
  return dir;
}

ServiceOptions WithStateDir(const std::string& dir, int retention) {
  ServiceOptions o;
  o.state_dir = dir;
  o.job_retention_seconds = retention;
  return o;
}

TEST(OpenLock, NewJobMomentumHoldsNoLock) {
  Gate gate("big", "momentum");
  Fixture f(gate);
  absl::StatusOr<v1::OpenSessionResponse> big;
  {
    Call open([&] {
      big = f.svc->OpenSession(
          Request("big", 0, 1, v1::TRANSPORT_SHM,
                  {{"a", 512, 256, v1::SHARDING_REPLICATED}, kSmall[0]}));
    });
    ASSERT_TRUE(gate.WaitReached());
    EXPECT_TRUE(OthersGoOn(gate, *f.svc, f.other, &f.step, f.rng, f.ref))
        << "another job's calls waited for a new job's momentum";
    gate.Release();
    EXPECT_TRUE(open.Done());
  }
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->next_step(), 1);
  EXPECT_EQ(f.svc->open_sessions(), 2);
}

TEST(OpenLock, CoverCheckHoldsNoLock) {
  Gate gate("sharded", "cover");
  Fixture f(gate);
  const std::vector<Param> rows = {{"r", 64, 32, v1::SHARDING_ROWS}};
  Rank r0;
  ASSERT_TRUE(
      r0.Open(*f.svc, Request("sharded", 0, 2, v1::TRANSPORT_SHM, rows)).ok());
  absl::StatusOr<v1::OpenSessionResponse> r1;
  {
    Call open([&] {
      r1 =
          f.svc->OpenSession(Request("sharded", 1, 2, v1::TRANSPORT_SHM, rows));
    });
    ASSERT_TRUE(gate.WaitReached());
    // The rank being opened is taken meanwhile: another open of it is
    // refused at once.
    absl::StatusOr<v1::OpenSessionResponse> again;
    bool at_once = false;
    {
      Call dup([&] {
        again = f.svc->OpenSession(
            Request("sharded", 1, 2, v1::TRANSPORT_SHM, rows));
      });
      at_once = dup.Done();
      if (!at_once) gate.Release();
    }
    EXPECT_TRUE(at_once) << "an open of the same rank waited";
    EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists)
        << again.status();
    EXPECT_NE(again.status().message().find("being opened"), std::string::npos)
        << again.status();
    EXPECT_TRUE(OthersGoOn(gate, *f.svc, f.other, &f.step, f.rng, f.ref))
        << "another job's calls waited for a cover check";
    EXPECT_TRUE(open.Done());
  }
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(f.svc->open_sessions(), 3);
}

TEST(OpenLock, ReleaseHoldsNoLock) {
  Gate gate("closing", "release");
  Fixture f(gate);
  Rank c;
  ASSERT_TRUE(
      c.Open(*f.svc, Request("closing", 0, 1, v1::TRANSPORT_SHM,
                             {{"a", 512, 256, v1::SHARDING_REPLICATED}}))
          .ok());
  {
    Call close(
        [&] { EXPECT_TRUE(f.svc->CloseSession(c.open.session_id()).ok()); });
    ASSERT_TRUE(gate.WaitReached());
    EXPECT_TRUE(OthersGoOn(gate, *f.svc, f.other, &f.step, f.rng, f.ref))
        << "another job's calls waited for a closed session's release";
    gate.Release();
    EXPECT_TRUE(close.Done());
  }
  EXPECT_EQ(f.svc->open_sessions(), 1);
}

TEST(OpenLock, StateBytesCountAJobBeingMade) {
  Gate gate("first", "momentum");
  ServiceOptions o;
  const std::vector<Param> big = {{"a", 256, 256, v1::SHARDING_REPLICATED}};
  // "other" and one big job, not two.
  o.max_state_bytes = (24 * 16 + 256 * 256 + 256 * 256 / 2) * sizeof(float);
  Fixture f(gate, o);
  absl::StatusOr<v1::OpenSessionResponse> first;
  {
    Call open([&] {
      first =
          f.svc->OpenSession(Request("first", 0, 1, v1::TRANSPORT_SHM, big));
    });
    ASSERT_TRUE(gate.WaitReached());
    absl::StatusOr<v1::OpenSessionResponse> second;
    {
      Call racing([&] {
        second =
            f.svc->OpenSession(Request("second", 0, 1, v1::TRANSPORT_SHM, big));
      });
      const bool done = racing.Done();
      gate.Release();
      EXPECT_TRUE(done) << "an open waited for another job's momentum";
    }
    EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted)
        << second.status();
    EXPECT_NE(second.status().message().find("reserved by 1 being opened"),
              std::string::npos)
        << second.status();
    gate.Release();
    EXPECT_TRUE(open.Done());
  }
  ASSERT_TRUE(first.ok()) << first.status();
  // Published: the reservation became the job's bytes (still refused).
  auto third =
      f.svc->OpenSession(Request("third", 0, 1, v1::TRANSPORT_SHM, big));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(third.status().message().find("reserved"), std::string::npos)
      << third.status();
}

TEST(OpenLock, RanksOfAJobBeingMadeJoinIt) {
  Gate gate("pair", "momentum");
  Fixture f(gate);
  absl::StatusOr<v1::OpenSessionResponse> r0, r1;
  {
    Call open0([&] {
      r0 = f.svc->OpenSession(
          Request("pair", 0, 2, v1::TRANSPORT_INLINE, kSmall));
    });
    ASSERT_TRUE(gate.WaitReached());
    // Rank 1 waits for the job rank 0 is making (a wait the test cannot
    // see; it joins whichever way the two meet).
    Call open1([&] {
      r1 = f.svc->OpenSession(
          Request("pair", 1, 2, v1::TRANSPORT_INLINE, kSmall));
    });
    absl::SleepFor(absl::Milliseconds(100));
    gate.Release();
    EXPECT_TRUE(open0.Done());
    EXPECT_TRUE(open1.Done());
  }
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  int pairs = 0;
  const v1::StatusResponse status = f.svc->Status();
  for (const auto& j : status.jobs()) {
    if (j.job_id() != "pair") continue;
    ++pairs;
    EXPECT_EQ(j.ranks_open(), 2);
  }
  EXPECT_EQ(pairs, 1);
}

TEST(OpenLock, ReaperKeepsAJobWhoseRankIsBeingOpened) {
  Gate gate("idle", "cover", /*armed=*/false);
  ServiceOptions o;
  o.job_retention_seconds = 1;
  Fixture f(gate, o);
  ASSERT_NO_FATAL_FAILURE(IdleAfterOneStep(f, "idle"));
  absl::StatusOr<v1::OpenSessionResponse> again;
  gate.Arm();
  {
    // Its reopen stops in its cover check (the job's last rank).
    Call open([&] {
      again = f.svc->OpenSession(
          Request("idle", 0, 1, v1::TRANSPORT_INLINE, kSmall));
    });
    ASSERT_TRUE(gate.WaitReached());
    ReapResult reap;
    {
      Call reaper([&] {
        reap = f.svc->ReapIdleJobs(Clock::now() + std::chrono::hours(1));
      });
      const bool done = reaper.Done();
      gate.Release();
      EXPECT_TRUE(done) << "the reaper waited for a cover check";
    }
    EXPECT_TRUE(reap.dropped.empty());
    gate.Release();
    EXPECT_TRUE(open.Done());
  }
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->next_step(), 2);  // the job kept, at its step
  // Closed again and past its retention: dropped.
  ASSERT_TRUE(f.svc->CloseSession(again->session_id()).ok());
  EXPECT_EQ(
      f.svc->ReapIdleJobs(Clock::now() + std::chrono::hours(1)).dropped.size(),
      1u);
}

// A resumed job whose open fails after it took its snapshot (here: dmuond
// started draining while its momentum was moved in) gives the snapshot
// back: the next open resumes from it, not from zero.
TEST(OpenLock, AFailedOpenGivesItsSnapshotBack) {
  Gate gate("k", "momentum", /*armed=*/false);
  const std::string dir = StateDir();
  Fixture f(gate, WithStateDir(dir, /*retention=*/0));
  ASSERT_NO_FATAL_FAILURE(IdleAfterOneStep(f, "k"));
  const ReapResult reap = f.svc->ReapIdleJobs(Clock::now());
  ASSERT_EQ(reap.dropped.size(), 1u);
  ASSERT_TRUE(reap.dropped[0].second);  // snapshotted
  auto resume = Request("k", 0, 1, v1::TRANSPORT_INLINE, kSmall);
  resume.set_protocol_minor(ProtocolMinor());
  resume.set_resume(v1::RESUME_CONTINUE);
  gate.Arm();
  absl::StatusOr<v1::OpenSessionResponse> refused;
  {
    Call open([&] { refused = f.svc->OpenSession(resume); });
    ASSERT_TRUE(gate.WaitReached());
    {
      Call drain([&] { f.svc->Drain(); });
      const bool done = drain.Done();
      gate.Release();
      EXPECT_TRUE(done) << "Drain waited for a new job's momentum";
    }
    EXPECT_TRUE(open.Done());
  }
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
      << refused.status();
  f.svc->Undrain();
  auto resumed = f.svc->OpenSession(resume);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->next_step(), 2);
  std::filesystem::remove_all(dir);
}

// An open that found its job idle in memory (so read no snapshot), then
// the reaper dropped the job (snapshotting it) before the open was
// admitted: the open reads the snapshot back and resumes the job. It was
// admitted without it, and made the job anew from zero over its own
// snapshot (and owned by whoever opened it).
TEST(OpenLock, AJobDroppedBeforeTheAdmissionResumesFromItsSnapshot) {
  Gate gate("k", "admit", /*armed=*/false);
  const std::string dir = StateDir();
  Fixture f(gate, WithStateDir(dir, /*retention=*/3600));
  ASSERT_NO_FATAL_FAILURE(IdleAfterOneStep(f, "k"));
  gate.Arm();
  absl::StatusOr<v1::OpenSessionResponse> resumed;
  {
    Call open([&] {
      resumed =
          f.svc->OpenSession(Request("k", 0, 1, v1::TRANSPORT_INLINE, kSmall));
    });
    ASSERT_TRUE(gate.WaitReached());
    const ReapResult reap =
        f.svc->ReapIdleJobs(Clock::now() + std::chrono::hours(2));
    ASSERT_EQ(reap.dropped.size(), 1u);
    ASSERT_TRUE(reap.dropped[0].second);  // snapshotted
    gate.Release();
    EXPECT_TRUE(open.Done());
  }
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->next_step(), 2) << "made anew over its snapshot";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dmuon::server::testing
