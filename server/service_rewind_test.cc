// Rewind (protocol minor 1): undoing the last completed step so that a
// client can declare its gradients again (edited after their hand-off, or a
// step the trainer skipped), and the cases it is refused.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kTwo = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                 {"b", 40, 24, v1::SHARDING_REPLICATED}};

v1::StepRequest RewindOf(int64_t step) {
  v1::StepRequest m;
  m.mutable_rewind()->set_step(step);
  return m;
}

// Runs `grads` as steps from..to on rank `r`; returns the last updates.
std::vector<std::vector<float>> RunSteps(
    OptimizerService& svc, Rank& r, int from, int to,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> last;
  for (int s = from; s <= to; ++s) {
    EXPECT_TRUE(r.Send(svc, s, grads[s - from]).ok()) << "step " << s;
    auto msgs = r.sink->WaitStep(s);
    EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
    last.clear();
    for (int i = 0; i < r.open.layout().slots_size(); ++i)
      last.push_back(r.Update(i, msgs));
  }
  return last;
}

TEST(Rewind, RedoneStepIsExactlyTheEditedOne) {
  // Steps 1-2, step 2 rewound and redone with other (edited) gradients,
  // rewound and redone once more, then step 3: every update is bit for bit
  // that of a run that had the edited gradients from the start.
  std::mt19937_64 rng(7);
  const auto g =
      StepsOfGradients(kTwo, 4, rng);  // g[1]: handed off, g[3]: edited
  for (v1::Transport t : {v1::TRANSPORT_SHM, v1::TRANSPORT_INLINE}) {
    auto ref_svc = NewService();
    Rank ref;
    ASSERT_TRUE(ref.Open(*ref_svc, Request("ref", 0, 1, t, kTwo)).ok());
    const auto want2 = RunSteps(*ref_svc, ref, 1, 2, {g[0], g[3]});
    const auto want3 = RunSteps(*ref_svc, ref, 3, 3, {g[2]});

    auto svc = NewService();
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, t, kTwo)).ok());
    RunSteps(*svc, r, 1, 2, {g[0], g[1]});
    ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(2)).ok());
    EXPECT_EQ(svc->Status().jobs(0).completed_steps(), 1);
    RunSteps(*svc, r, 2, 2, {g[1]});
    ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(2)).ok());
    EXPECT_EQ(RunSteps(*svc, r, 2, 2, {g[3]}), want2) << t;
    EXPECT_EQ(RunSteps(*svc, r, 3, 3, {g[2]}), want3) << t;
    EXPECT_EQ(svc->Status().jobs(0).completed_steps(), 3);
  }
}

TEST(Rewind, RefusedOutsideTheLastCompletedStep) {
  std::mt19937_64 rng(8);
  const auto g = StepsOfGradients(kTwo, 2, rng);
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  // Nothing completed yet.
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  RunSteps(*svc, r, 1, 1, {g[0]});
  // Not the last completed step.
  absl::Status st = svc->OnStepRequest(r.open.session_id(), RewindOf(2));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("last completed step is 1"), std::string::npos)
      << st;
  // Once: a rewound step must be redone before it can be rewound again.
  ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).ok());
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);

  // Mid-step: a gradient of the next step arrived.
  auto svc2 = NewService();
  Rank q;
  ASSERT_TRUE(q.Open(*svc2, Request("k", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  RunSteps(*svc2, q, 1, 1, {g[0]});
  v1::StepRequest one;
  one.mutable_gradients_ready()->set_step(2);
  one.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(svc2->OnStepRequest(q.open.session_id(), one).ok());
  EXPECT_EQ(svc2->OnStepRequest(q.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);
}

// --- Jobs of several ranks: every rank asks, then the step is undone.

constexpr int kWorld = 2;

// One step's gradients, by rank then parameter, as each rank sends them:
// replicated ones equal on every rank, rows ones each rank's block of one
// matrix, unreduced ones each rank's own.
using RankGrads = std::vector<std::vector<std::vector<float>>>;

RankGrads GradsOfStep(const std::vector<Param>& ps, std::mt19937_64& rng) {
  const auto base = RandomGradients(ps, rng);
  RankGrads out(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    const auto own = RandomGradients(ps, rng);
    for (size_t i = 0; i < ps.size(); ++i) {
      const Param& p = ps[i];
      if (p.sharding == v1::SHARDING_UNREDUCED) {
        out[r].push_back(own[i]);
      } else if (p.sharding == v1::SHARDING_ROWS) {
        const int64_t per = (p.rows + kWorld - 1) / kWorld;
        const int64_t b = std::min(p.rows, r * per);
        const int64_t e = std::min(p.rows, (r + 1) * per);
        out[r].emplace_back(base[i].begin() + b * p.cols,
                            base[i].begin() + e * p.cols);
      } else {
        out[r].push_back(base[i]);
      }
    }
  }
  return out;
}

struct Pair {
  std::unique_ptr<OptimizerService> svc = NewService();
  std::vector<Rank> ranks = std::vector<Rank>(kWorld);
  explicit Pair(v1::Transport t) {
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(ranks[r].Open(*svc, Request("w", r, kWorld, t, kMixed)).ok());
    }
  }
  // Step `s` on every rank (rank 1 first); the updates by rank.
  std::vector<std::vector<std::vector<float>>> Step(int64_t s,
                                                    const RankGrads& g) {
    for (int r = kWorld - 1; r >= 0; --r)
      EXPECT_TRUE(ranks[r].Send(*svc, s, g[r]).ok()) << "step " << s;
    std::vector<std::vector<std::vector<float>>> out(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      auto msgs = ranks[r].sink->WaitStep(s);
      EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
      for (int i = 0; i < ranks[r].open.layout().slots_size(); ++i)
        out[r].push_back(ranks[r].Update(i, msgs));
    }
    return out;
  }
  absl::Status Rewind(int r, int64_t s) {
    return svc->OnStepRequest(ranks[r].open.session_id(), RewindOf(s));
  }
  // Every momentum byte, in order.
  std::string Momentum() {
    auto chunks = GetState(*svc, ranks[0].open.session_id());
    EXPECT_TRUE(chunks.ok()) << chunks.status();
    std::string m;
    if (chunks.ok())
      for (const auto& c : *chunks)
        if (c.has_momentum()) m += c.momentum().data();
    return m;
  }
  int64_t Completed() { return svc->Status().jobs(0).completed_steps(); }
};

// Asks rank 0 to rewind `s` on a thread (it waits for rank 1); returns
// once Status lists the ask as waiting (JobStatus.rewind_waiting_ranks).
class HeldAsk {
 public:
  HeldAsk(Pair& p, int64_t s)
      : thread_([this, &p, s] {
          status_ = p.Rewind(0, s);
          done_ = true;
        }) {
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < until) {
      const v1::StatusResponse st = p.svc->Status();
      if (st.jobs_size() == 1 && st.jobs(0).rewind_waiting_ranks_size() == 1) {
        EXPECT_EQ(st.jobs(0).rewind_waiting_ranks(0), 0);
        EXPECT_EQ(st.jobs(0).rewind_step(), s);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "rank 0's rewind ask never showed in Status";
  }
  ~HeldAsk() {
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_; }
  absl::Status Join() {
    thread_.join();
    return status_;
  }

 private:
  std::atomic<bool> done_{false};
  absl::Status status_;
  std::thread thread_;
};

TEST(Rewind, TwoRanksRedoneStepIsExactlyTheEditedOne) {
  // Replicated, rows and unreduced parameters: step 2 handed off, rewound
  // by both ranks (rank 0 held until rank 1 asks), redone with edited
  // gradients: updates and momentum bit for bit those of a job that had
  // the edited gradients from the start, and so is step 3.
  std::mt19937_64 rng(9);
  std::vector<RankGrads> g;
  for (int k = 0; k < 4; ++k) g.push_back(GradsOfStep(kMixed, rng));
  for (v1::Transport t : {v1::TRANSPORT_SHM, v1::TRANSPORT_INLINE}) {
    Pair ref(t);
    ref.Step(1, g[0]);
    const auto want2 = ref.Step(2, g[3]);
    const std::string want_m2 = ref.Momentum();
    const auto want3 = ref.Step(3, g[2]);
    const std::string want_m3 = ref.Momentum();

    Pair p(t);
    p.Step(1, g[0]);
    p.Step(2, g[1]);
    const std::string m2 = p.Momentum();
    {
      HeldAsk ask(p, 2);
      EXPECT_FALSE(ask.done()) << "rank 0's rewind must wait for rank 1's";
      EXPECT_EQ(p.Completed(), 2);
      EXPECT_EQ(p.Momentum(), m2);  // nothing undone yet
      ASSERT_TRUE(p.Rewind(1, 2).ok());
      ASSERT_TRUE(ask.Join().ok());
    }
    EXPECT_EQ(p.Completed(), 1);
    // Rewound twice: the redo can be undone again.
    p.Step(2, g[1]);
    {
      HeldAsk ask(p, 2);
      ASSERT_TRUE(p.Rewind(1, 2).ok());
      ASSERT_TRUE(ask.Join().ok());
    }
    // Two steps rewound by two ranks each: the fallback "rewind" counted
    // once per step rewound, not per rank (server/fallbacks.h).
    EXPECT_EQ(p.svc->Status().fallbacks().at("rewind"), 2u) << t;
    EXPECT_EQ(p.Step(2, g[3]), want2) << t;
    EXPECT_EQ(p.Momentum(), want_m2) << t;
    EXPECT_EQ(p.Step(3, g[2]), want3) << t;
    EXPECT_EQ(p.Momentum(), want_m3) << t;
    EXPECT_EQ(p.Completed(), 3);
  }
}

TEST(Rewind, TwoRanksOneAskingAloneIsHeld) {
  std::mt19937_64 rng(10);
  const RankGrads g = GradsOfStep(kMixed, rng);
  Pair p(v1::TRANSPORT_SHM);
  p.Step(1, g);
  HeldAsk ask(p, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(ask.done());
  EXPECT_EQ(p.Completed(), 1);
  ASSERT_TRUE(p.Rewind(1, 1).ok());
  EXPECT_TRUE(ask.Join().ok());
  EXPECT_EQ(p.Completed(), 0);
  EXPECT_EQ(p.svc->Status().jobs(0).rewind_waiting_ranks_size(), 0);
  // Only the last completed step, and not again before it is redone.
  EXPECT_EQ(p.Rewind(0, 1).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Rewind, TwoRanksDisagreeingIsAnErrorAndTheJobIsUntouched) {
  std::mt19937_64 rng(11);
  std::vector<RankGrads> g;
  for (int k = 0; k < 2; ++k) g.push_back(GradsOfStep(kMixed, rng));
  for (v1::Transport t : {v1::TRANSPORT_SHM, v1::TRANSPORT_INLINE}) {
    Pair p(t);
    p.Step(1, g[0]);
    const std::string m1 = p.Momentum();
    HeldAsk ask(p, 1);
    // Rank 1 goes on to step 2 instead of rewinding step 1.
    absl::Status st = p.ranks[1].Send(*p.svc, 2, g[1][1]);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("rank 0 asked to rewind"), std::string::npos)
        << st;
    EXPECT_NE(st.message().find("rank 1 sent gradients of step 2"),
              std::string::npos)
        << st;
    // The waiting rank gets the same error; the job stays after step 1.
    absl::Status held = ask.Join();
    EXPECT_EQ(held, st);
    EXPECT_EQ(p.Completed(), 1);
    EXPECT_EQ(p.Momentum(), m1);
    EXPECT_EQ(p.svc->Status().fallbacks().at("rewind"), 0u);  // none took place
    EXPECT_EQ(p.svc->Status().sessions(0).step(), 2);
  }
}

TEST(Rewind, TwoRanksRankClosingEndsTheWait) {
  std::mt19937_64 rng(12);
  const RankGrads g = GradsOfStep(kMixed, rng);
  Pair p(v1::TRANSPORT_SHM);
  p.Step(1, g);
  HeldAsk ask(p, 1);
  ASSERT_TRUE(p.svc->CloseSession(p.ranks[1].open.session_id()).ok());
  absl::Status st = ask.Join();
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_NE(st.message().find("waited for rank 1"), std::string::npos) << st;
  EXPECT_EQ(p.Completed(), 1);
}

}  // namespace
}  // namespace dmuon::server::testing
