// The service's limits (ServiceOptions; docs/security.md "Limits"): each
// refused request fails with its code and a message naming the dmuond flag,
// and another job keeps stepping. Also: a client that shrinks its shm
// segment while its step computes (no SIGBUS), a session that never
// attaches, and step counts at the edge of int64.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"

namespace dmuon::server::testing {
namespace {

using Clock = std::chrono::steady_clock;

const std::vector<Param> kOne = {{"w", 32, 32, v1::SHARDING_REPLICATED}};

// Whether `st` has `code` and its message contains `part`.
::testing::AssertionResult Refused(const absl::Status& st,
                                   absl::StatusCode code,
                                   const std::string& part) {
  if (st.code() == code &&
      std::string(st.message()).find(part) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << st << " is not " << absl::StatusCodeToString(code) << " naming '"
         << part << "'";
}

// Opens a fresh 1-rank inline job `id` and runs one step of it: the daemon
// still works for everyone else.
void OtherJobSteps(OptimizerService& svc, const std::string& id) {
  Rank r;
  ASSERT_TRUE(r.Open(svc, Request(id, 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
  std::mt19937_64 rng(7);
  ASSERT_TRUE(r.Send(svc, 1, RandomGradients(kOne, rng)).ok());
  auto msgs = r.sink->WaitStep(1);
  ASSERT_FALSE(msgs.empty());
  EXPECT_TRUE(msgs.back().has_step_complete()) << msgs.back().DebugString();
  EXPECT_TRUE(svc.CloseSession(r.open.session_id()).ok());
}

TEST(Limits, WorldSize) {
  ServiceOptions o;
  o.max_world_size = 8;
  auto svc = NewService(o);
  // 5e7 ranks in a 40-byte request: refused before anything is sized.
  auto r =
      svc->OpenSession(Request("big", 0, 50000000, v1::TRANSPORT_INLINE, kOne));
  EXPECT_TRUE(Refused(r.status(), absl::StatusCode::kResourceExhausted,
                      "--max-world-size"));
  EXPECT_TRUE(Refused(r.status(), absl::StatusCode::kResourceExhausted,
                      "world_size 50000000"));
  EXPECT_TRUE(
      svc->OpenSession(Request("ok", 0, 8, v1::TRANSPORT_INLINE, kOne)).ok());
  OtherJobSteps(*svc, "other");
}

TEST(Limits, DefaultWorldSizeLimit) {
  auto svc = NewService();
  EXPECT_EQ(
      svc->OpenSession(Request("big", 0, 50000000, v1::TRANSPORT_INLINE, kOne))
          .status()
          .code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(
      svc->OpenSession(Request("ok", 0, 4096, v1::TRANSPORT_INLINE, kOne))
          .ok());
}

TEST(Limits, JobParameters) {
  ServiceOptions o;
  o.max_job_parameters = 3;
  auto svc = NewService(o);
  std::vector<Param> four;
  for (int i = 0; i < 4; ++i)
    four.push_back({absl::StrCat("w", i), 8, 8, v1::SHARDING_REPLICATED});
  auto r = svc->OpenSession(Request("j", 0, 1, v1::TRANSPORT_INLINE, four));
  EXPECT_TRUE(Refused(r.status(), absl::StatusCode::kResourceExhausted,
                      "--max-job-parameters"));
  four.pop_back();
  EXPECT_TRUE(
      svc->OpenSession(Request("j", 0, 1, v1::TRANSPORT_INLINE, four)).ok());
  OtherJobSteps(*svc, "other");
}

TEST(Limits, JobElements) {
  ServiceOptions o;
  o.max_job_elements = 32 * 32;
  auto svc = NewService(o);
  auto r = svc->OpenSession(Request("j", 0, 1, v1::TRANSPORT_INLINE,
                                    {{"w", 32, 33, v1::SHARDING_ROWS}}));
  EXPECT_TRUE(Refused(r.status(), absl::StatusCode::kResourceExhausted,
                      "--max-job-elements"));
  // A product past int64 is refused too, not wrapped.
  auto req = Request("j", 0, 1, v1::TRANSPORT_INLINE, kOne);
  req.mutable_parameters(0)->set_shape(0, int64_t{1} << 62);
  req.mutable_parameters(0)->set_shape(1, 4);
  EXPECT_TRUE(Refused(svc->OpenSession(req).status(),
                      absl::StatusCode::kResourceExhausted,
                      "--max-job-elements"));
  OtherJobSteps(*svc, "other");
}

TEST(Limits, StateBytesAcrossJobs) {
  ServiceOptions o;
  o.max_state_bytes = 2 * 32 * 32 * sizeof(float);  // two jobs of kOne
  auto svc = NewService(o);
  Rank a;
  ASSERT_TRUE(
      a.Open(*svc, Request("a", 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
  Rank b;
  ASSERT_TRUE(
      b.Open(*svc, Request("b", 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
  auto c = svc->OpenSession(Request("c", 0, 1, v1::TRANSPORT_INLINE, kOne));
  EXPECT_TRUE(Refused(c.status(), absl::StatusCode::kResourceExhausted,
                      "--max-state-bytes"));
  // The jobs held keep stepping; an idle one still counts until dropped.
  std::mt19937_64 rng(1);
  ASSERT_TRUE(a.Send(*svc, 1, RandomGradients(kOne, rng)).ok());
  EXPECT_TRUE(a.sink->WaitStep(1).back().has_step_complete());
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  EXPECT_EQ(svc->OpenSession(Request("c", 0, 1, v1::TRANSPORT_INLINE, kOne))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  // Reopening a held job is not a new job.
  Rank b2;
  EXPECT_TRUE(
      b2.Open(*svc, Request("b", 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
}

TEST(Limits, ScheduleLength) {
  ServiceOptions o;
  o.max_ns_steps = 10;
  auto svc = NewService(o);
  auto req = Request("j", 0, 1, v1::TRANSPORT_INLINE, kOne);
  req.mutable_groups(0)->set_schedule("custom");
  for (int i = 0; i < 11; ++i) {
    auto* c = req.mutable_groups(0)->add_coefficients();
    c->set_a(3.4445);
    c->set_b(-4.7750);
    c->set_c(2.0315);
  }
  EXPECT_TRUE(Refused(svc->OpenSession(req).status(),
                      absl::StatusCode::kResourceExhausted, "--max-ns-steps"));
  auto named = Request("j", 0, 1, v1::TRANSPORT_INLINE, kOne);
  named.mutable_groups(0)->set_ns_steps(11);
  EXPECT_TRUE(Refused(svc->OpenSession(named).status(),
                      absl::StatusCode::kResourceExhausted, "--max-ns-steps"));
  req.mutable_groups(0)->mutable_coefficients()->RemoveLast();
  EXPECT_TRUE(svc->OpenSession(req).ok());
  OtherJobSteps(*svc, "other");
}

// One rule for every schedule, named or custom: --max-ns-steps, up to the
// kernels' bound (named schedules once had their own limit of 99).
TEST(Limits, NamedAndCustomSchedulesShareTheLimit) {
  for (int limit : {kDefaultMaxNsSteps, 300}) {
    ServiceOptions o;
    o.max_ns_steps = limit;
    auto svc = NewService(o);
    for (const char* schedule : {"classic", "polar_express", "you", "custom"}) {
      for (int steps : {limit / 2, limit, limit + 1}) {
        const std::string id = absl::StrCat("j", limit, schedule, steps);
        auto req = Request(id, 0, 1, v1::TRANSPORT_INLINE, kOne);
        auto* g = req.mutable_groups(0);
        g->set_schedule(schedule);
        if (std::string(schedule) == "custom") {
          for (int i = 0; i < steps; ++i) {
            auto* c = g->add_coefficients();
            c->set_a(1.5);
            c->set_b(-0.5);
            c->set_c(0.0);
          }
        } else {
          g->set_ns_steps(steps);
        }
        auto s = svc->OpenSession(req);
        if (steps <= limit) {
          EXPECT_TRUE(s.ok()) << schedule << " " << steps << ": " << s.status();
        } else {
          EXPECT_TRUE(Refused(s.status(), absl::StatusCode::kResourceExhausted,
                              "--max-ns-steps"))
              << schedule << " " << steps << ": " << s.status();
        }
      }
    }
  }
}

TEST(Limits, DefaultScheduleLength) {
  auto svc = NewService();
  auto req = Request("j", 0, 1, v1::TRANSPORT_INLINE, kOne);
  req.mutable_groups(0)->set_schedule("custom");
  for (int i = 0; i < 20000; ++i) {
    auto* c = req.mutable_groups(0)->add_coefficients();
    c->set_a(1);
  }
  EXPECT_TRUE(Refused(svc->OpenSession(req).status(),
                      absl::StatusCode::kResourceExhausted,
                      "at most 100 (--max-ns-steps)"));
}

TEST(Limits, JobIdLengthAndCharacters) {
  auto svc = NewService();
  EXPECT_TRUE(Refused(svc->OpenSession(Request(std::string(257, 'j'), 0, 1,
                                               v1::TRANSPORT_INLINE, kOne))
                          .status(),
                      absl::StatusCode::kInvalidArgument,
                      "--max-job-id-bytes"));
  EXPECT_TRUE(svc->OpenSession(Request(std::string(256, 'j'), 0, 1,
                                       v1::TRANSPORT_INLINE, kOne))
                  .ok());
  for (const std::string& id :
       {std::string("a\nb"), std::string("tab\t"), std::string("nul\0x", 5),
        std::string("caf\xc3\xa9"), std::string("del\x7f")}) {
    EXPECT_TRUE(
        Refused(svc->OpenSession(Request(id, 0, 1, v1::TRANSPORT_INLINE, kOne))
                    .status(),
                absl::StatusCode::kInvalidArgument, "printable ASCII"))
        << absl::CHexEscape(id);
  }
  EXPECT_TRUE(svc->OpenSession(Request("host-1 pid:42/run_#3 ~x", 0, 1,
                                       v1::TRANSPORT_INLINE, kOne))
                  .ok());
  OtherJobSteps(*svc, "other");
}

std::vector<std::string> JobIds(OptimizerService& svc) {
  std::vector<std::string> ids;
  const v1::StatusResponse status = svc.Status();
  for (const auto& j : status.jobs()) ids.push_back(j.job_id());
  std::sort(ids.begin(), ids.end());
  return ids;
}

TEST(Limits, IdleJobsOldestDroppedFirst) {
  ServiceOptions o;
  o.max_idle_jobs = 2;
  auto svc = NewService(o);
  Rank busy;
  ASSERT_TRUE(
      busy.Open(*svc, Request("busy", 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
  for (const char* id : {"a", "b", "c", "d"}) {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request(id, 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The two oldest idle jobs are due now; the reaper drops them.
  const ReapResult reaped = svc->ReapIdleJobs(Clock::now());
  ASSERT_EQ(reaped.dropped.size(), 2u);
  EXPECT_EQ(reaped.dropped[0].first, "a");
  EXPECT_EQ(reaped.dropped[1].first, "b");
  EXPECT_EQ(JobIds(*svc), (std::vector<std::string>{"busy", "c", "d"}));
  // The open job is untouched and steps.
  std::mt19937_64 rng(2);
  ASSERT_TRUE(busy.Send(*svc, 1, RandomGradients(kOne, rng)).ok());
  EXPECT_TRUE(busy.sink->WaitStep(1).back().has_step_complete());
}

bool ShmExists(const std::string& name) {
  struct stat st;
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

TEST(Limits, UnattachedSessionIsClosed) {
  auto svc = NewService();  // attach_timeout_seconds = 60
  auto lazy = svc->OpenSession(Request("lazy", 0, 1, v1::TRANSPORT_SHM, kOne));
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  ASSERT_TRUE(ShmExists(lazy->shm_name()));
  Rank ok;
  ASSERT_TRUE(ok.Open(*svc, Request("ok", 0, 1, v1::TRANSPORT_SHM, kOne)).ok());
  EXPECT_EQ(svc->open_sessions(), 2);
  // Not yet due.
  EXPECT_NE(svc->ExpireUnattached(Clock::now()), Clock::time_point::max());
  EXPECT_EQ(svc->open_sessions(), 2);
  svc->ExpireUnattached(Clock::now() + std::chrono::seconds(61));
  EXPECT_EQ(svc->open_sessions(), 1);
  EXPECT_FALSE(ShmExists(lazy->shm_name()));
  EXPECT_EQ(
      svc->Attach(lazy->session_id(), std::make_shared<FakeSink>()).code(),
      absl::StatusCode::kNotFound);
  bool released = false;
  EXPECT_TRUE(
      svc->CloseSession(lazy->session_id(), Clock::now(), &released).ok());
  EXPECT_TRUE(released);  // the segment is unmapped too
  // The attached session is kept and steps.
  std::mt19937_64 rng(3);
  ASSERT_TRUE(ok.Send(*svc, 1, RandomGradients(kOne, rng)).ok());
  EXPECT_TRUE(ok.sink->WaitStep(1).back().has_step_complete());
}

TEST(Limits, UnattachedSessionIsClosedByItsThread) {
  ServiceOptions o;
  o.attach_timeout_seconds = 1;
  auto svc = NewService(o);
  auto lazy = svc->OpenSession(Request("lazy", 0, 1, v1::TRANSPORT_SHM, kOne));
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  const auto until = Clock::now() + std::chrono::seconds(30);
  while (svc->open_sessions() > 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(svc->open_sessions(), 0);
  EXPECT_FALSE(ShmExists(lazy->shm_name()));
}

// --- Step counts at the edge of int64.

TEST(Limits, CompletedStepsRange) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kOne)).ok());
  auto state = GetState(*svc, r.open.session_id());
  ASSERT_TRUE(state.ok()) << state.status();
  (*state)[0].set_session_id(r.open.session_id());
  for (int64_t bad : {std::numeric_limits<int64_t>::max(),
                      (int64_t{1} << 62) + 1, int64_t{-1}}) {
    (*state)[0].mutable_header()->set_completed_steps(bad);
    EXPECT_TRUE(Refused(SetState(*svc, *state).status(),
                        absl::StatusCode::kInvalidArgument, "completed_steps"))
        << bad;
  }
  // The largest allowed count steps on without overflow (UBSan checks).
  const int64_t top = int64_t{1} << 62;
  (*state)[0].mutable_header()->set_completed_steps(top);
  auto set = SetState(*svc, *state);
  ASSERT_TRUE(set.ok()) << set.status();
  std::mt19937_64 rng(4);
  for (int64_t step = top + 1; step <= top + 2; ++step) {
    ASSERT_TRUE(r.Send(*svc, step, RandomGradients(kOne, rng)).ok());
    auto msgs = r.sink->WaitStep(step);
    ASSERT_FALSE(msgs.empty());
    EXPECT_TRUE(msgs.back().has_step_complete());
  }
  EXPECT_EQ(svc->Status().jobs(0).completed_steps(), top + 2);
}

// --- A client shrinks its shm segment while its step computes.

// An executor that holds its first Compute until released.
class GatedExecutor : public Executor {
 public:
  explicit GatedExecutor(std::unique_ptr<Executor> inner)
      : inner_(std::move(inner)) {}
  std::string device() const override { return inner_->device(); }
  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    if (!gated_.exchange(true)) {
      entered_.Notify();
      release_.WaitForNotification();
    }
    return inner_->Compute(batch);
  }
  absl::Notification entered_, release_;

 private:
  std::unique_ptr<Executor> inner_;
  std::atomic<bool> gated_{false};
};

// The client's descriptor of its segment (as in service_state_test).
int SegmentFd(const std::string& name) {
  int fd = -1;
  for (int cand = 3; cand < 1024; ++cand) {
    char path[64], link[256] = {0};
    snprintf(path, sizeof(path), "/proc/self/fd/%d", cand);
    if (readlink(path, link, sizeof(link) - 1) > 0 &&
        std::string(link).find(name.substr(1)) != std::string::npos) {
      fd = cand;
    }
  }
  return fd;
}

TEST(ShmShrink, AfterGradientsReadyIsDataLossNotSigbus) {
  auto gated = std::make_unique<GatedExecutor>(NewCpuExecutor(0, 1));
  GatedExecutor* gate = gated.get();
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::move(gated));
  ex.push_back(NewCpuExecutor(1, 1));
  auto svc = std::make_unique<OptimizerService>(
      ServiceOptions{}, std::make_unique<Scheduler>(std::move(ex), 4), nullptr);
  const std::vector<Param> big = {{"w", 256, 256, v1::SHARDING_REPLICATED}};
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("victim", 0, 1, v1::TRANSPORT_SHM, big)).ok());
  std::mt19937_64 rng(5);
  ASSERT_TRUE(r.Send(*svc, 1, RandomGradients(big, rng)).ok());
  ASSERT_TRUE(gate->entered_.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // Gathered, computing: the client shrinks its segment under the update
  // slot. Nothing may touch the mappings from here on.
  const int fd = SegmentFd(r.open.shm_name());
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 64), 0);
  gate->release_.Notify();
  absl::Status why;
  ASSERT_TRUE(r.sink->WaitAbort(&why));
  EXPECT_EQ(why.code(), absl::StatusCode::kDataLoss) << why;
  EXPECT_NE(std::string(why.message()).find(r.open.shm_name()),
            std::string::npos)
      << why;
  auto msgs = r.sink->WaitStep(1);
  ASSERT_FALSE(msgs.empty());
  EXPECT_TRUE(msgs.back().has_error());
  // Every other job goes on.
  OtherJobSteps(*svc, "other");
  Rank shm;
  ASSERT_TRUE(
      shm.Open(*svc, Request("other-shm", 0, 1, v1::TRANSPORT_SHM, kOne)).ok());
  ASSERT_TRUE(shm.Send(*svc, 1, RandomGradients(kOne, rng)).ok());
  EXPECT_TRUE(shm.sink->WaitStep(1).back().has_step_complete());
}

}  // namespace
}  // namespace dmuon::server::testing
